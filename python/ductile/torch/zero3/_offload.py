"""Optimizer offload of the zero3 engine (ZeRO-Offload): for the groups it
covers, the fp32 master shard and Adam's state live in host memory (pinned
on cuda) and the ``cpu_adam`` plugin steps them (``DuctileCPUAdam``); the
device keeps the compute-dtype shard the coordinator gathers from.

What moves when, per offloaded group:

- backward: when the group's reduce-scatter completes (the reducer's
  ``on_group_ready``), its gradient shard is copied to the host (on cuda: on
  a copy stream, after an event on the compute stream, into pinned memory,
  ``non_blocking``); with ``step_in_backward`` the group's host step starts
  then, on a worker thread, and the device gradient is dropped;
- ``engine.step()``: clipping and fp16 unscaling read the device gradient
  shards and are folded into the plugin's ``grad_scale`` (the host copy is
  never rewritten); each group's host step waits for its own gradient copy
  only, writes the master (and, under mixed precision, its bf16/fp16
  rounding: the plugin's copy-out, half the bytes to move), and its copy
  back to the device is issued at once, so the next group's step overlaps
  it;
- before the next pass: the compute stream waits for those copies (an
  event each, no host wait) and the coordinator gathers the new values.

The host waits only for the CPU's own work and for a copy it is about to
read or overwrite (an event that has long completed by then).

Groups not offloaded keep their masters and state on the device and are
stepped by the optimizer ``optimizer_factory`` made, as without offload.
``OffloadedOptimizer`` shows both as that one optimizer (its class, its
param_groups, torch's state layout), so LR schedulers and checkpoints see
no difference and a checkpoint loads with or without offload.
"""

import concurrent.futures
import time
from typing import Any

import torch

from ..._errors import IncompatibleError
from ._grad_shards import clip_coefficient, global_norm


class HostShard:
    """A group's host buffers: the fp32 master (what the optimizer's
    parameters view), the fp32 gradient copy, and under mixed precision the
    rounded copy that goes to the device. The master and the rounded copy
    are made with the group's shards (``attach``)."""

    def __init__(self, group, device, pin):
        pin = bool(pin) and device.type == "cuda"
        self.pinned = pin
        self.master = None
        self.grad = torch.zeros(group.shard_numel, dtype=torch.float32, pin_memory=pin)
        self.grad_views = self.grad.split(group.sizes)
        self.half = None
        self.half_views = None
        self.grad_copied = None   # event: the last gradient copy to the host is done
        self.params_copied = None  # event: the last copy to the device is done
        self.sent = False          # a step's copy to the device was issued, not yet waited on

    def attach(self, group, shard=None):
        """Makes the master (and the rounded copy under mixed precision).
        `shard`: the coordinator's shard when it lives in host memory; it
        serves as the master (fp32) or the rounded copy, so the step writes
        it directly and nothing goes to a device."""
        n = group.shard_numel
        if shard is not None and shard.dtype == torch.float32:
            self.master = shard
        else:
            self.master = torch.zeros(n, dtype=torch.float32, pin_memory=self.pinned)
        if group.dtype != torch.float32:
            self.half = shard if shard is not None else \
                torch.zeros(n, dtype=group.dtype, pin_memory=self.pinned)
            self.half_views = self.half.split(group.sizes)


def _record(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


class OptimizerOffload:
    """Moves and steps the offloaded groups (see the module's docstring)."""

    def __init__(self, groups, device, eager):
        self.groups = [g for g in groups if g.host is not None]
        self.device = device
        # DuctileCPUAdam over the offloaded shards, set with it
        self.optimizer: Any = None
        self.cuda = device.type == "cuda"
        # read only when self.cuda
        self.copy_stream: Any = torch.cuda.Stream(device) if self.cuda else None
        self.eager = eager          # step_in_backward: step each group as its gradient lands
        self.worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="ductile-zero3-offload") if eager else None
        self.pending = []           # futures of the eager steps
        self.factors = []           # grad_scale factors of this step (floats, 0-d tensors)
        self.counters = {"offload_grad_copies": 0, "offload_param_copies": 0,
                         "offload_grad_bytes": 0, "offload_param_bytes": 0,
                         "offload_steps": 0, "offload_step_ns": 0}

    # --- backward ------------------------------------------------------------------------

    def gradient_ready(self, group):
        """The group's gradient shard on the device is complete (for now:
        accumulation with sync on completes it again): copy it to the host."""
        host = group.host
        if host is None or group.grad_flat is None:
            return
        if self.cuda:
            # After the group's backward on the compute stream: its shard's
            # gathers are consumed, its gradient shard complete.
            ready = _record(torch.cuda.current_stream(self.device))
            self.copy_stream.wait_event(ready)
            with torch.cuda.stream(self.copy_stream):
                host.grad.copy_(group.grad_flat, non_blocking=True)
            group.grad_flat.record_stream(self.copy_stream)
            host.grad_copied = _record(self.copy_stream)
        else:
            host.grad.copy_(group.grad_flat)
        self.counters["offload_grad_copies"] += 1
        self.counters["offload_grad_bytes"] += host.grad.numel() * host.grad.element_size()
        if self.eager:
            _, params, grads, outs = self._work(group)
            # The device copy may go: the host copy is what the step reads.
            group.grad_flat = None
            group.grad_views = None
            worker = self.worker
            assert worker is not None  # made when eager
            self.pending.append(worker.submit(self._step, group, params, grads, outs, 1.0,
                                              ready if self.cuda else None))

    # --- the step --------------------------------------------------------------------------

    def scale(self, factor):
        """Multiplies the host gradients by `factor` (a float or a 0-d
        tensor) in this step's update, instead of rewriting them."""
        self.factors.append(factor)

    def unscale(self, grads_on_device, inverse_scale):
        if grads_on_device:
            torch._foreach_mul_(grads_on_device, inverse_scale)
        self.scale(inverse_scale)

    def clip(self, all_grads, device_grads, comm, max_norm, norm_type):
        """Clipping by the global norm: the device's gradient shards are
        scaled in place, the offloaded groups' through grad_scale (their
        norms count with the factors deferred so far: fp16's unscaling)."""
        on_device = {id(g) for g in device_grads}
        deferred = [g for g in all_grads if id(g) not in on_device]
        scale = 1.0
        for f in self.factors:
            scale = scale * f
        total = global_norm(device_grads, comm, self.device, norm_type, deferred, scale)
        coefficient = clip_coefficient(total, max_norm)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in device_grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, same in by_dtype.items():
            torch._foreach_mul_(same, coefficient.to(dtype))
        self.scale(coefficient)
        return total

    def _grad_scale(self):
        scale = 1.0
        for f in self.factors:
            # A tensor (the clipping coefficient) is read here: the host
            # needs the number to step (DeepSpeed's CPU Adam reads it too).
            scale *= float(f) if isinstance(f, torch.Tensor) else f
        return scale

    def step(self, skip=False):
        """Steps every offloaded group with a gradient (waits for the eager
        ones); after it the masters are current and their copies to the
        device issued."""
        try:
            for future in self.pending:
                future.result()
            if not skip and not self.eager:
                scale = self._grad_scale()
                ready = _record(torch.cuda.current_stream(self.device)) if self.cuda else None
                for group in self.groups:
                    _, params, grads, outs = self._work(group)
                    if params:
                        self._step(group, params, grads, outs, scale, ready)
        finally:
            self.pending = []
            self.factors = []

    def abandon(self):
        """After a failed step or backward: waits for what the worker runs."""
        for future in self.pending:
            future.exception()
        self.pending = []
        self.factors = []

    def _work(self, group):
        """(group, parameters, gradients, copy-outs) of the members that have
        a gradient, read on the calling thread (the engine may clear the
        ``.grad`` attributes before a worker runs)."""
        host = group.host
        params, grads, outs = [], [], []
        for k, zp in enumerate(group.members):
            if zp.requires_grad and zp.shard.grad is not None:
                params.append(zp.shard)
                grads.append(host.grad_views[k])
                if host.half_views is not None:
                    outs.append(host.half_views[k])
        return group, params, grads, outs if host.half_views is not None else None

    def _step(self, group, params, grads, outs, scale, ready):
        """One group's host step, then its copy to the device, issued after
        `ready` (an event of the compute stream after the last pass read the
        device shard; None on the cpu)."""
        start = time.perf_counter_ns()
        host = group.host
        if host.grad_copied is not None:
            host.grad_copied.synchronize()
        if host.params_copied is not None:
            host.params_copied.synchronize()  # the master (or half) is not read by a copy any more
        self.optimizer.step_parameters(params, grads, outs, grad_scale=scale)
        self._send(group, ready)
        self.counters["offload_steps"] += 1
        self.counters["offload_step_ns"] += time.perf_counter_ns() - start

    # --- to the device ---------------------------------------------------------------------

    def _send(self, group, ready=None):
        """Issues the copy of the updated parameters to the device shard,
        after `ready` (else after what the calling thread's current stream
        has queued)."""
        host = group.host
        source = host.half if host.half is not None else host.master
        if source is group.store:  # a shard in host memory, written by the step itself
            host.sent = True
            return
        if self.cuda:
            if ready is not None:
                self.copy_stream.wait_event(ready)
            else:
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                group.store.copy_(source, non_blocking=host.pinned)
            host.params_copied = _record(self.copy_stream)
        else:
            group.store.copy_(source)
        host.sent = True
        self.counters["offload_param_copies"] += 1
        self.counters["offload_param_bytes"] += group.store.numel() * group.store.element_size()

    def to_device(self, group):
        """Before a pass: the device shard holds the master's values. After
        a step the copy is in flight: the compute stream waits for it. After
        anything else that wrote the master (initial values, a load,
        GatheredParameters) it is copied now, rounded first under mixed
        precision."""
        host = group.host
        if not host.sent:
            if host.params_copied is not None:
                host.params_copied.synchronize()
            if host.half is not None:
                host.half.copy_(host.master)
            self._send(group)
        host.sent = False
        if self.cuda and host.params_copied is not None:
            torch.cuda.current_stream(self.device).wait_event(host.params_copied)

    def masters_changed(self):
        """The masters are (about to be) written outside a step: no copy of
        theirs is in flight any more, and the next pass copies them again."""
        for group in self.groups:
            host = group.host
            if host.params_copied is not None:
                host.params_copied.synchronize()
            host.sent = False

    def close(self):
        if self.worker is not None:
            self.abandon()
            self.worker.shutdown(wait=True)
            self.worker = None


def place(groups, placement, offload, budget, has_optimizer, step_in_backward, device):
    """Chooses the groups whose optimizer lives on the host and those whose
    parameter shard does (all that `offload` asks for, and what does not fit
    under `budget`) and gives the former host buffers, before their shards
    are made; returns the OptimizerOffload, or None when no group's
    optimizer is offloaded."""
    chosen = placement.choose(budget, offload.optimizer and has_optimizer, offload.ratio,
                              offload.param)
    for group in groups:
        group.shard_on_host = group.id in placement.shards_on_host
    if not chosen:
        return None
    if step_in_backward:
        # Each group is stepped on the host as its gradient lands: all of them.
        chosen.update(g.id for g in groups if g.trained)
    for group in groups:
        if group.id not in chosen:
            continue
        dtype = placement.master_dtype or group.dtype
        if dtype != torch.float32:
            raise IncompatibleError(
                f"zero3: optimizer offload steps fp32 masters; the shards of '{group.name}' are "
                f"{dtype}; valid: float32 parameters, or MixedPrecision with "
                "master_dtype=torch.float32")
        group.host = HostShard(group, device, offload.pin)
        group.host_grad_views = group.host.grad_views  # what the members' shard.grad are
    return OptimizerOffload(groups, device, step_in_backward)


# --- the optimizer -----------------------------------------------------------------------

_HYPER = ("lr", "betas", "eps", "weight_decay")


def adam_settings(optimizer):
    """(adamw_mode, per-group bias_correction) of a torch Adam/AdamW or a
    DuctileCPUAdam; IncompatibleError for what the CPU plugin cannot run."""
    from ...ops.adam import DuctileCPUAdam
    name = type(optimizer).__name__
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, DuctileCPUAdam)):
        raise IncompatibleError(
            f"zero3: optimizer offload steps with the cpu_adam plugin, which runs Adam and "
            f"AdamW; optimizer_factory made a {name}. Valid: torch.optim.Adam, "
            "torch.optim.AdamW, ductile.ops.adam.DuctileCPUAdam, or no offload")
    modes = []
    for k, group in enumerate(optimizer.param_groups):
        for key, bad in (("amsgrad", True), ("maximize", True), ("capturable", True),
                         ("differentiable", True)):
            if group.get(key) is bad:
                raise IncompatibleError(
                    f"zero3: optimizer offload: param group {k} of the {name} has {key}=True, "
                    f"which the cpu_adam plugin does not run; valid: {key}=False")
        if isinstance(optimizer, DuctileCPUAdam):
            modes.append(bool(group.get("adamw_mode", optimizer.defaults["adamw_mode"])))
        elif isinstance(optimizer, torch.optim.AdamW):
            modes.append(True)
        else:
            modes.append(bool(group.get("decoupled_weight_decay", False)))
    if len(set(modes)) > 1:
        raise IncompatibleError(
            f"zero3: optimizer offload: the {name}'s param groups mix decoupled and L2 weight "
            "decay; valid: one kind for all groups")
    return (modes[0] if modes else True), [bool(g.get("bias_correction", True))
                                          for g in optimizer.param_groups]


class OffloadedOptimizer(torch.optim.Optimizer):
    """The engine's optimizer when some groups are offloaded: the
    factory's param groups (hyper-parameters as the factory set them, every
    shard), whose state lives in one dict (torch's layout: ``step``,
    ``exp_avg``, ``exp_avg_sq`` per shard, on the device or on the host).
    ``step()`` steps the device shards with an optimizer of the factory's
    class and the host shards with the cpu_adam plugin (the engine's step
    does the latter group by group: call ``engine.step()``, not this)."""

    def __init__(self, made, host_shards, plugin_params=None):
        from ...ops.adam import DuctileCPUAdam
        adamw_mode, bias = adam_settings(made)
        self.checkpoint_class = type(made).__name__
        groups = [dict(g) for g in made.param_groups]
        super().__init__(groups, made.defaults)
        hosted = {id(p) for p in host_shards}
        self._split = []  # per group: (device params, host params)
        for g in self.param_groups:
            self._split.append(([p for p in g["params"] if id(p) not in hosted],
                                [p for p in g["params"] if id(p) in hosted]))
        device_groups = [dict({k: v for k, v in g.items() if k != "params"}, params=d)
                         for g, (d, _) in zip(self.param_groups, self._split)]
        self.device = None
        if any(d for d, _ in self._split):
            self.device = type(made)(device_groups, **_constructor_defaults(made))
        host_groups = [dict({k: g[k] for k in _HYPER}, params=h, bias_correction=b,
                            adamw_mode=adamw_mode)
                       for g, (_, h), b in zip(self.param_groups, self._split, bias)]
        self.host = DuctileCPUAdam(host_groups, adamw_mode=adamw_mode,
                                   plugin_params=plugin_params)
        self._share_state()

    def _share_state(self):
        """One state dict for all: the sub-optimizers write into this one's
        (the parameters are disjoint), so state_dict() and the checkpoints
        see every shard's state."""
        if self.device is not None:
            self.device.state = self.state
        self.host.state = self.state

    def sync_hyper_parameters(self):
        """A scheduler changed this optimizer's groups: the sub-optimizers'
        follow."""
        for g, mine in enumerate(self.param_groups):
            if self.device is not None:
                for key, value in mine.items():
                    if key != "params":
                        self.device.param_groups[g][key] = value
            theirs = self.host.param_groups[g]
            for key in _HYPER:
                theirs[key] = mine[key]

    @torch.no_grad()
    def step_device(self):
        self.sync_hyper_parameters()
        if self.device is not None:
            self.device.step()

    def step(self, closure=None):
        """Both parts at once, from the parameters' ``.grad`` (the engine
        steps the host part itself, group by group)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_device()
        self.host.step()
        return loss

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._share_state()
        self.sync_hyper_parameters()

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)


def _constructor_defaults(made):
    """The keyword arguments that rebuild `made`'s class with its defaults
    (those its constructor accepts)."""
    import inspect
    accepted = inspect.signature(type(made).__init__).parameters
    return {k: v for k, v in made.defaults.items() if k in accepted}
