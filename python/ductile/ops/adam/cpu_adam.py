"""``DuctileCPUAdam``: a ``torch.optim.Optimizer`` with DeepSpeedCPUAdam's
constructor whose steps run in C++, in an optimizer plugin (``cpu_adam`` by
default: AVX-512/AVX2, multi-threaded, torch.optim.AdamW's results).

    from ductile.ops.adam import DeepSpeedCPUAdam       # was deepspeed.ops.adam
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Its state is torch's: ``state_dict()`` holds ``step``, ``exp_avg`` and
``exp_avg_sq`` per parameter as ``torch.optim.AdamW`` keeps them, so either
loads the other's. Python only finds the tensors and checks that they are
dense fp32 on the CPU; every number is computed by the plugin.
"""

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..._config import PluginPath
from ..._ductile import optimizer as _native
from ..._errors import InvalidArgumentError, UnsupportedError, shown as _shown

_HALF_TYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


class DuctileCPUAdam(torch.optim.Optimizer):
    """Adam (``adamw_mode=False``: L2 weight decay) or AdamW (decoupled weight
    decay, the default) on fp32 CPU tensors, stepped by an optimizer plugin.

    The positional arguments are DeepSpeedCPUAdam's. ``amsgrad=True`` is
    refused (as DeepSpeed does not support it). ``fp32_optimizer_states``
    is accepted for compatibility: parameters are fp32, so are the states.
    ``bias_correction=False`` steps with lr and the raw moments, as
    DeepSpeed does. Keyword-only: ``plugin`` names the optimizer plugin,
    ``plugin_params`` its parameters (cpu_adam: ``{"threads": N, "simd":
    "avx2", "threading": "pool"}``; default: the best instruction set, on
    the OpenMP runtime torch loaded), ``plugin_path`` extra plugin
    directories. Raises ConfigError for bad plugin parameters, NotFoundError
    for an unknown plugin.

    Threads: each step runs on as many threads as torch's intra-op count at
    that moment (``torch.get_num_threads()``: ``torch.set_num_threads``,
    ``OMP_NUM_THREADS``), as DeepSpeedCPUAdam does, so that ranks sharing a
    node share its cores; ``plugin_params={"threads": N}`` fixes N instead.
    """

    def __init__(self, model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True, *, plugin: str = "cpu_adam",
                 plugin_params: Mapping[str, Any] | None = None,
                 plugin_path: PluginPath = None) -> None:
        if amsgrad:
            raise UnsupportedError(
                "DuctileCPUAdam: amsgrad=True is not supported (nor by DeepSpeedCPUAdam); "
                "use amsgrad=False, or torch.optim.AdamW(amsgrad=True)")
        _check_betas(betas, "betas")
        if plugin_params is not None and not isinstance(plugin_params, Mapping):
            raise InvalidArgumentError(
                f"DuctileCPUAdam: plugin_params = {_shown(plugin_params)} is a "
                f"{type(plugin_params).__name__}; valid: None or a dict of the plugin's "
                "parameters, such as {\"threads\": 4}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, amsgrad=amsgrad, adamw_mode=adamw_mode)
        super().__init__(model_params, defaults)
        self.adam_w_mode = adamw_mode  # DeepSpeedCPUAdam's attribute
        self.fp32_optimizer_states = fp32_optimizer_states
        self._native = _native.Optimizer(plugin, plugin_params, plugin_path)
        # A count the caller fixed wins over torch's (0: the plugin's own).
        self._follow_torch = not (plugin_params or {}).get("threads")
        self._state_names = self._native.state_names
        # id(parameter) -> (group, index), for step_parameters
        self._where: dict[int, tuple[int, int]] | None = None

    @property
    def implementation(self) -> str:
        """How the plugin steps, e.g. ``"avx2, 8 threads (OpenMP: libgomp.so.1)"``."""
        return self._native.implementation

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``; the loaded moments are then copied
        into buffers of the kind the step makes (see _zeroed_state)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name in self._state_names:
                loaded = state.get(name)
                if isinstance(loaded, torch.Tensor) and loaded.dtype == torch.float32 \
                        and loaded.device.type == "cpu":
                    state[name] = _zeroed_state(loaded).copy_(loaded)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None,
             fp16_param_groups: Sequence[Sequence[torch.Tensor]] | None = None) -> float | None:
        """One step of every parameter that has a gradient. ``closure``
        recomputes the loss (returned). ``fp16_param_groups``: for each param
        group a list of bf16 or fp16 CPU tensors, one per parameter, that
        receive the updated parameters rounded to nearest even (the copy a
        mixed-precision model computes with), written by the same pass."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        threads = self._threads()
        if fp16_param_groups is not None:
            self._check_copy_groups(fp16_param_groups)
        for g, group in enumerate(self.param_groups):
            self._check_group(g, group)
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                copy = None if fp16_param_groups is None else fp16_param_groups[g][i]
                self._step_one(g, group, i, p, p.grad, copy, 1.0, threads)
        return loss

    @torch.no_grad()
    def step_parameters(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                        copy_out: Sequence[torch.Tensor] | None = None,
                        grad_scale: float = 1.0) -> None:
        """One step of some of the parameters only: ``params[k]`` with the
        gradient ``grads[k]`` (instead of its ``.grad``), its update rounded
        into ``copy_out[k]`` when given (a bf16/fp16 tensor of its size);
        every gradient is multiplied by ``grad_scale`` first (unscaling and
        clipping folded into the step). Why: an engine that holds the
        gradients apart from the parameters steps a layer as soon as its
        gradients are on the host, from a thread of its own; calls on
        disjoint parameters may run at the same time (the plugin allows it),
        each reads its parameter group's hyper-parameters when it starts,
        and torch's thread count."""
        threads = self._threads()
        where = self._where
        if where is None or len(where) != sum(len(g["params"]) for g in self.param_groups):
            where = self._where = {id(p): (g, i) for g, group in enumerate(self.param_groups)
                                   for i, p in enumerate(group["params"])}
        for k, (p, grad) in enumerate(zip(params, grads)):
            found = where.get(id(p))
            if found is None:
                raise InvalidArgumentError(
                    f"DuctileCPUAdam.step_parameters: params[{k}] is not a parameter of this "
                    "optimizer; valid: a tensor of its param_groups")
            g, i = found
            group = self.param_groups[g]
            self._check_group(g, group)
            self._step_one(g, group, i, p, grad, None if copy_out is None else copy_out[k],
                           grad_scale, threads)

    def _threads(self):
        """The thread count a step passes to the plugin: torch's intra-op
        count now (per thread: torch's count as this thread sees it), or 0
        for the plugin's own when ``plugin_params`` fixed one."""
        return torch.get_num_threads() if self._follow_torch else 0

    def _check_copy_groups(self, fp16_param_groups):
        """Before anything is stepped: one sequence of tensors per param
        group, each as long as its group (the tensors are checked as each
        parameter is stepped)."""
        groups = len(self.param_groups)
        if not isinstance(fp16_param_groups, (list, tuple)) or len(fp16_param_groups) != groups:
            raise InvalidArgumentError(
                f"DuctileCPUAdam.step: fp16_param_groups = {_shown(fp16_param_groups)} is "
                f"{_length_text(fp16_param_groups)}; valid: a list of {groups} list(s), one per "
                "param group, each with one bf16 or fp16 tensor per parameter")
        for g, (copies, group) in enumerate(zip(fp16_param_groups, self.param_groups)):
            want = len(group["params"])
            if not isinstance(copies, (list, tuple)) or len(copies) != want:
                raise InvalidArgumentError(
                    f"DuctileCPUAdam.step: fp16_param_groups[{g}] = {_shown(copies)} is "
                    f"{_length_text(copies)}; valid: a list of {want} bf16 or fp16 tensor(s), "
                    f"one per parameter of param group {g}")

    def _check_group(self, g, group):
        # A group loaded from torch.optim.AdamW's state_dict lacks the
        # keys DeepSpeed added: the constructor's values hold.
        for key in ("bias_correction", "adamw_mode"):
            group.setdefault(key, self.defaults[key])
        _check_betas(group.get("betas"), f"param group {g}: betas")
        if group.get("amsgrad", False):
            raise UnsupportedError(f"DuctileCPUAdam: param group {g} has amsgrad=True; "
                                   "only amsgrad=False is supported")

    def _step_one(self, g, group, i, p, grad, copy, grad_scale, threads):
        where = f"param group {g}, parameter {i}"
        _check_fp32(p, where)
        _check_fp32(grad, where + " (its gradient)", like=p)
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # as torch keeps it
            for name in self._state_names:
                state[name] = _zeroed_state(p)
        buffers = [state[name] for name in self._state_names]
        for name, buffer in zip(self._state_names, buffers):
            _check_fp32(buffer, f"{where} (its {name})", like=p)
        if copy is not None:
            _check_half(copy, where, p)
        beta1, beta2 = group["betas"]
        step = _next_step(state, where)
        self._native.step(
            p.data_ptr(), grad.data_ptr(), [b.data_ptr() for b in buffers], p.numel(),
            step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
            group["adamw_mode"], group["bias_correction"], grad_scale=grad_scale,
            copy_out=None if copy is None else copy.data_ptr(),
            copy_out_type=_HALF_TYPES[copy.dtype] if copy is not None else "bfloat16",
            threads=threads)
        _set_step(state, step)


# DeepSpeed's name, so that swapping the import is the only change.
DeepSpeedCPUAdam = DuctileCPUAdam


def _zeroed_state(like):
    """A zero fp32 cpu tensor of `like`'s shape for a moment of the step. A
    large one lies in a HostBuffer (on huge pages: the step streams through
    it, host_buffer.cpp says how much that gains); the tensor keeps it alive."""
    nbytes = like.numel() * 4
    if nbytes < _native.HostBuffer.huge_page_bytes:
        return torch.zeros(like.shape, dtype=torch.float32)
    return torch.frombuffer(_native.HostBuffer(nbytes), dtype=torch.float32).view(like.shape)


def _check_fp32(tensor, where, like=None):
    if tensor.is_sparse or tensor.device.type != "cpu" or tensor.dtype != torch.float32 \
            or not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"DuctileCPUAdam: {where} is a {tensor.dtype} tensor on {tensor.device}"
            f"{'' if tensor.is_sparse or tensor.is_contiguous() else ', not contiguous'}"
            f"{', sparse' if tensor.is_sparse else ''}; valid: a dense, contiguous torch.float32 "
            "tensor on the cpu (offload the optimizer to the CPU first)")
    if like is not None and tensor.numel() != like.numel():
        raise InvalidArgumentError(
            f"DuctileCPUAdam: {where} has {tensor.numel()} elements, the parameter "
            f"{like.numel()}; valid: a state of the parameter's size")


def _check_half(tensor, where, param):
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _HALF_TYPES \
            or tensor.device.type != "cpu" or not tensor.is_contiguous() \
            or tensor.numel() != param.numel():
        shown = (f"a {tensor.dtype} tensor of {tensor.numel()} elements on {tensor.device}"
                 if isinstance(tensor, torch.Tensor) else repr(type(tensor)))
        raise InvalidArgumentError(
            f"DuctileCPUAdam: fp16_param_groups for {where} is {shown}; valid: a contiguous "
            f"torch.bfloat16 or torch.float16 cpu tensor of {param.numel()} elements")


def _next_step(state, where):
    """The step after the state's, which a loaded state_dict may hold as
    anything: a whole number >= 0 (torch keeps a float32 tensor)."""
    step = state["step"]
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    # typeshed's numbers.Real has no __int__ and no comparison with an int:
    # the ignores below are for that.
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < 0
            or value != int(value)  # type: ignore[call-overload]
            or value >= 2 ** 53):  # type: ignore[operator]
        raise InvalidArgumentError(
            f"DuctileCPUAdam: the state of {where} has step = {_shown(step)}; valid: a whole "
            "number of steps taken, from 0 to 2^53 (a state_dict of DuctileCPUAdam, "
            "DeepSpeedCPUAdam or torch.optim.AdamW)")
    return int(value) + 1  # type: ignore[call-overload]  # numbers.Real, as above


def _check_betas(betas, name):
    """(beta1, beta2), each a real number in [0, 1), as torch's Adam needs."""
    pair = tuple(betas) if isinstance(betas, (list, tuple)) else None
    if pair is None or len(pair) != 2 or not all(
            # typeshed's numbers.Real has no comparison with an int
            isinstance(b, numbers.Real) and not isinstance(b, bool)
            and 0 <= b < 1  # type: ignore[operator]
            for b in pair):
        raise InvalidArgumentError(
            f"DuctileCPUAdam: {name} = {_shown(betas)} is invalid; valid: a pair (beta1, beta2) "
            "of numbers in [0, 1), such as (0.9, 0.999)")


def _length_text(value):
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _set_step(state, step):
    # torch keeps a float32 tensor (DeepSpeed an int): keep what is there.
    if isinstance(state["step"], torch.Tensor):
        state["step"].fill_(step)
    else:
        state["step"] = step
