"""The ZeRO-3 engine: a torch.nn.Module's parameters partitioned by the C++
coordinator (the configured ``zero`` plugin) over the ranks of its world,
gathered just in time by module hooks. ``Zero3Engine`` is the user's
facade (DeepSpeed's engine API); the work sits on seams, as FSDP2's
``fully_shard`` does (``FSDPState``, ``FSDPParamGroup``, ``FSDPParam``):

- _sharded_model.py: the sharding set-up (coordinator session, world,
  groups and shards, placement and offload, gradient reducer, hooks) and
  the shards' update before a pass;
- _units.py: which modules are hooked (units) and which parameters each
  gathers (groups);
- _shards.py: the parameters and groups registered with the coordinator,
  this rank's shards filled, and written back after a step;
- _param.py: group and parameter state (flat shards, master copies,
  materialisation, saved-tensor packing);
- _passes.py: fetch and release of each unit's groups, the hooks that
  drive them, and the passes (forward, backward) they run in;
- _gradients.py: reduce-scatters by group;
- _loss_scaling.py: fp16 loss scaling (unscale, overflow, the scale);
- _optimizer_step.py: the optimizer, clipping and the step;
- _grad_shards.py: what unscaling, the overflow check and clipping do to
  the gradient shards;
- _offload.py and _budget.py: optimizer offload to the host, and where
  each group's tensors live under max_device_memory;
- _step_log.py: the progress line every log_interval steps;
- _snapshots.py: the in-memory snapshots every snapshot_interval steps
  under ``ductile agent``, and the restore from one at start;
- this file: the configuration, and the training API (backward, step,
  accumulation, checkpoints, full weights), each call handed to its seam.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeAlias

import torch

from ..._config import Config, PluginPath, StrPath
from ..._errors import IncompatibleError, InvalidArgumentError
from . import _config, _full
from ._loss_scaling import LossScaling
from ._optimizer_step import OptimizerStep
from ._passes import ENGINE, EXTERNAL
from ._precision import MixedPrecision
from ._sharded_model import ShardedModel
from ._snapshots import Snapshots
from ._step_log import StepLog

# Builds the optimizer over the shard parameters it is given (None: no
# optimizer).
OptimizerFactory: TypeAlias = Callable[[list[torch.Tensor]], torch.optim.Optimizer | None]
# Which modules gather their parameters as one group: "auto", "module", a
# tuple of module classes or a predicate (zero3.initialize).
Groups: TypeAlias = (Literal["auto", "module"] | tuple[type[torch.nn.Module], ...]
                     | Callable[[torch.nn.Module], bool])
# A configuration: a TOML or DeepSpeed JSON (path, text, dict) or a loaded one.
ConfigSource: TypeAlias = StrPath | dict[str, Any] | Config


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declares that ``module``'s forward uses ``parameter`` although it
    belongs to another module (DeepSpeed's
    ``deepspeed.zero.register_external_parameter``): the engine gathers it
    with ``module``'s own parameters. Call it before ``initialize``."""
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgumentError(
            f"register_external_parameter: module must be a torch.nn.Module, got "
            f"{type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise InvalidArgumentError(
            f"register_external_parameter: parameter must be a torch.nn.Parameter, got "
            f"{type(parameter).__name__}")
    if module.__dict__.get(ENGINE):
        raise IncompatibleError(
            f"register_external_parameter: {type(module).__name__} is already managed by a "
            "zero3 engine; register external parameters before initialize()")
    listed = module.__dict__.setdefault(EXTERNAL, [])
    if not any(p is parameter for p in listed):
        listed.append(parameter)


class Zero3Engine:
    """The ZeRO-3 engine over one model, as ``ductile.torch.zero3.initialize``
    makes it (its arguments are described there): DeepSpeed's engine API,
    each call handed to the part that does it (ShardedModel,
    OptimizerStep, LossScaling). ``move_model``: move the model to the
    accelerator's device first, as ``deepspeed.initialize`` does (its
    drop-in passes it); zero3.initialize refuses a model elsewhere instead."""

    # config: also the Settings the DeepSpeed drop-in resolved (_config.py).
    def __init__(self, model: torch.nn.Module, optimizer_factory: OptimizerFactory | None = None,
                 config: ConfigSource | _config.Settings | None = None, *,
                 plugin_path: PluginPath = None,
                 mixed_precision: MixedPrecision | str | torch.dtype | None = None,
                 load_from: StrPath | None = None,
                 group: torch.distributed.ProcessGroup | None = None,
                 step_in_backward: bool = False, groups: Groups = "auto",
                 offload_optimizer: bool | str | dict[str, Any] | None = None,
                 max_device_memory: int | float | None = None, move_model: bool = False) -> None:
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(
                f"zero3.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
        if config is None:
            raise InvalidArgumentError(
                "zero3.initialize: config is required: a ductile TOML (path or text) with "
                "[zero] and [accelerator] sections, or a DeepSpeed JSON config (path, text or "
                "dict)")
        world = _config.torch_world(group)
        settings = _config.resolve(config, plugin_path, mixed_precision, world)
        self.config = settings.loaded
        # A DeepSpeed config's training keys as the mapping read them; None
        # for a TOML.
        self.training = settings.training
        self.mixed_precision = precision = settings.mixed_precision
        if settings is not config:  # not the DeepSpeed drop-in's, resolved from its config
            _config.warn_overridden(settings, optimizer_factory, offload_optimizer)
        if optimizer_factory is None:
            optimizer_factory = settings.optimizer
        offload = settings.offload
        if offload_optimizer is not None:
            param = offload.param  # the argument is about the optimizer only
            offload = _config.offload_argument(offload_optimizer, settings.loaded.runtime)
            offload.param = param

        sharded = ShardedModel(model, settings.loaded.runtime, world, precision, groups,
                               offload, max_device_memory, load_from,
                               optimizer_factory is not None, step_in_backward, move_model)
        self.module = model
        self.comm = sharded.comm
        self.rank = sharded.rank
        self.world_size = sharded.world_size
        self._session = sharded.session
        self._memory = sharded.memory
        self._sharding = sharded.sharding
        self._params = sharded.params
        self._groups = sharded.groups
        self._placement = sharded.placement
        self._offload = sharded.offload
        self._gradients = sharded.gradients
        self._passes = sharded.passes
        for zp in self._params:
            _full.register_owner(self, zp)

        self._scaler = precision.loss_scaler if precision is not None else None
        scaling = None
        if self._scaler is not None:
            scaling = LossScaling(self._scaler, self._groups, self._offload, self.comm,
                                  self._memory.device)
        self._steps = OptimizerStep(sharded, optimizer_factory, scaling,
                                    settings.gradient_clipping, step_in_backward)
        self.optimizer = self._steps.optimizer
        self.step_in_backward = self._steps.step_in_backward
        self._lr_scheduler = None
        interval = _config.log_interval(settings)  # checked by the schema
        self._step_log = StepLog(interval, self) if interval else None
        self._snapshots = Snapshots(self, *_config.snapshot_keys(settings))
        # The step restored from DUCTILE_SNAPSHOT_RESTORE (a round that
        # resumes from memory under `ductile agent`), or None.
        self.restored_from_memory = self._snapshots.restore()

    # A scheduler: any object with step() (and state_dict()/load_state_dict()
    # for checkpoints), a torch LRScheduler or one of lr_schedules'.
    @property
    def lr_scheduler(self) -> Any:
        """Stepped after every applied step(): a DeepSpeed config's
        "scheduler" (zero3.initialize builds it), or one set by the caller.
        After a restore from memory, the first scheduler set gets the
        snapshot's scheduler state."""
        return self._lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        self._snapshots.apply_scheduler_state(scheduler)
        self._lr_scheduler = scheduler

    @property
    def gradient_clipping(self) -> float | None:
        """The global norm step() clips the gradient to (DeepSpeed's
        ``gradient_clipping``); 0 or None: no clipping."""
        return self._steps.gradient_clipping

    @gradient_clipping.setter
    def gradient_clipping(self, value: float | None) -> None:
        self._steps.set_gradient_clipping(value)

    @property
    def log_interval(self) -> int:
        """Optimizer steps between the progress lines of the
        ``ductile.zero3`` logger on rank 0 (_step_log.py); 0: none. From
        [zero] log_interval, else a DeepSpeed config's steps_per_print."""
        return 0 if self._step_log is None else self._step_log.interval

    @log_interval.setter
    def log_interval(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(
                f"zero3: log_interval = {value!r}; valid: an integer >= 0 (optimizer steps "
                "between progress lines; 0: none)")
        self._step_log = StepLog(value, self) if value else None

    def count_batch(self, samples: int | torch.Tensor,
                    tokens: int | torch.Tensor | None = None) -> None:
        """Counts this rank's samples (and tokens) trained towards the next
        progress line's samples/s and tokens/s (ints or 0-d integer tensors,
        read only at a logged step). Does nothing without log_interval."""
        if self._step_log is not None:
            self._step_log.count(samples, tokens)

    @property
    def global_step(self) -> int:
        """The optimizer steps taken (saved in checkpoints)."""
        return self._steps.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self._steps.global_step = value

    @property
    def device(self) -> torch.device:
        """The torch device of the gathered parameters (cpu or cuda)."""
        return self._memory.device

    @property
    def step_applied(self) -> bool:
        """Whether the last step() changed the shards (False after an fp16
        overflow skipped it, and before the first step)."""
        return self._steps.step_applied

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm before clipping of the last step that
        computed it (a 0-d tensor; None before): every step with
        gradient_clipping, or with ``measure_grad_norm`` on."""
        return self._steps.grad_norm

    @property
    def measure_grad_norm(self) -> bool:
        """Whether step() computes the global gradient norm even without
        clipping (one more scalar all-reduce a step)."""
        return self._steps.measure_grad_norm

    @measure_grad_norm.setter
    def measure_grad_norm(self, value: bool) -> None:
        self._steps.measure_grad_norm = bool(value)

    # --- shards and passes --------------------------------------------------------

    def shards_changed(self) -> None:
        """Says that the optimizer's shards were written outside
        optimizer.step() (which the engine sees by itself): the next pass
        gathers the new values (offloaded masters are copied again). With
        offload on cuda, call ``shards_writable()`` before writing."""
        self._sharding.changed = True
        if self._offload is not None:
            self._offload.masters_changed()

    def shards_writable(self) -> None:
        """Before writing the optimizer's shards: an offloaded master may
        still be read by its copy to the device (cuda); waits for it."""
        if self._offload is not None:
            self._offload.masters_changed()

    @property
    def _pass_open(self):
        return self._passes.pass_open

    @property
    def _backward_active(self):
        return self._passes.backward_active

    # Called as fn("fetch" or "release", unit name, stats()) around each
    # unit's gathers (diagnostics); None: none.
    @property
    def module_callback(self) -> Callable[[str, str, dict[str, Any]], object] | None:
        return self._passes.module_callback

    @module_callback.setter
    def module_callback(self, fn: Callable[[str, str, dict[str, Any]], object] | None) -> None:
        self._passes.module_callback = fn

    # --- the training loop -----------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)`` (the loss scaled first with fp16 loss
        scaling); gradient shards are complete when it returns."""
        if self._scaler is not None:
            loss = loss * self._scaler.scale
        if self.step_in_backward and self._snapshots.enabled:
            # The optimizer steps during this backward: the last snapshot's
            # replicas must be complete first.
            self._snapshots.before_update()
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside sum full gradients locally, with no
        communication; the first backward after it reduce-scatters the sum
        (gradient accumulation with one reduce-scatter per step)."""
        previous = self._gradients.sync
        self._gradients.sync = False
        try:
            yield
        finally:
            self._gradients.sync = previous

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """FSDP2's switch: False keeps full gradients locally (see no_sync)."""
        self._gradients.sync = bool(sync)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scales the gradient shards so that the norm of the whole gradient
        (over every rank's shards) is at most max_norm; returns that norm
        (before clipping) as a tensor, the same on every rank. Collective;
        call after backward, before step (fp16: the shards are unscaled
        first). The host does not wait for the device."""
        return self._steps.clip_grad_norm_(max_norm, norm_type)

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        """Steps the optimizer on the shards, then clears the gradient shards
        and steps ``lr_scheduler`` (with ``lr_kwargs``) when there is one.
        With gradient_clipping (DeepSpeed config) the gradient is clipped
        first; with fp16 loss scaling a step whose gradient overflowed on
        any rank is skipped (the scheduler too) and the scale lowered.
        Every log_interval steps, a progress line; every snapshot_interval
        steps under ``ductile agent``, a snapshot in memory (_snapshots.py;
        both collective)."""
        # Attributes, not calls, when snapshots are off: the step's host
        # work is counted (tests/python/test_zero3_groups.py).
        snapshots = self._snapshots
        if snapshots.enabled:
            snapshots.before_update()
        log = self._step_log
        logged = log is not None and log.due(self._steps.global_step + 1)
        if logged:
            groups = self.optimizer.param_groups if self.optimizer is not None else ()
            lr = groups[0]["lr"] if groups else None
        self._steps.step()
        scheduler = self._lr_scheduler
        if scheduler is not None and self._steps.step_applied:
            scheduler.step(**(lr_kwargs or {}))
        if logged:
            assert log is not None  # logged only with a log
            log.log(lr)
        if snapshots.enabled:
            snapshots.after_step()

    def zero_grad(self) -> None:
        """Clears the gradient shards (step() does it after stepping)."""
        self._steps.zero_grad()

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        return self._scaler.scale if self._scaler is not None else 1.0

    # --- views and counters ----------------------------------------------------------

    def shard_parameters(self) -> list[torch.Tensor]:
        """This rank's shards, one flat tensor per parameter, in
        ``model.named_parameters()`` order: what the optimizer steps on
        (fp32 masters with mixed precision)."""
        return [zp.shard for zp in self._params]

    def stats(self) -> dict[str, Any]:
        """The coordinator's counters (gathers, prefetched, waited time, live
        and peak elements, trace) plus the engine's gradient reduce-scatters."""
        s = self._session.stats()
        s.update(self._gradients.counters)
        s["rank"] = self.rank
        s["world_size"] = self.world_size
        s["world"] = self.comm.kind
        s["shard_bytes"] = sum(zp.shard_numel * zp.element_size for zp in self._params)
        s["master_bytes"] = sum(zp.shard.numel() * zp.shard.element_size() for zp in self._params
                                if zp.shard.data_ptr() != zp.store.data_ptr())
        s["parameter_bytes"] = sum(zp.numel * zp.element_size for zp in self._params)
        s["groups"] = len(self._groups)
        s["placement"] = self._placement.report()
        s["offloaded_groups"] = sorted(g.name for g in self._groups if g.host is not None)
        s["host_shard_groups"] = sorted(g.name for g in self._groups if g.shard_on_host)
        s["max_device_memory"] = self._placement.budget
        s["device_need_bytes"] = self._placement.device_need()
        s["device_high_water_bytes"] = self._steps.device_high_water
        if self._offload is not None:
            s.update(self._offload.counters)
        s["units"] = len(self._passes.units)
        s.update({f"gather_{k}": v for k, v in self._session.gather_memory().items()})
        return s

    def units(self) -> dict[str, list[str]]:
        """The hooked modules (units), as module names, and the parameters
        each gathers as one group ({unit: [parameter names]}, its own group
        first)."""
        return {u.name: [zp.name for g in u.own for zp in g.members]
                for u in self._passes.units}

    def trace(self) -> list[str]:
        """The recorded module order, as unit names (empty while recording)."""
        return [self._passes.module_names[mid] for mid in self._session.trace()]

    def all_reduce(self, tensor: torch.Tensor,
                   op: Literal["sum", "mean", "min", "max"] = "mean") -> torch.Tensor:
        """All-reduces a contiguous tensor in place over the engine's ranks
        (op: sum, mean, min, max) and returns it. Collective."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            raise InvalidArgumentError("zero3: all_reduce needs a contiguous torch.Tensor")
        if op not in ("sum", "mean", "min", "max"):
            raise InvalidArgumentError(
                f"zero3: all_reduce op '{op}' is unknown; valid: sum, mean, min, max")
        self.comm.all_reduce(tensor, "sum" if op == "mean" else op).wait()
        if op == "mean":
            tensor.div_(self.world_size)
        return tensor

    def check_invariants(self) -> None:
        self._session.check_invariants()

    # --- full parameters, checkpoints ---------------------------------------------------

    def full_parameters(self, dtype: _full.DtypeArgument = None) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on every rank (a dict name -> tensor, new
        memory), from the optimizer's shards (fp32 masters with mixed
        precision) unless `dtype` says otherwise. Collective."""
        return _full.full_parameters(self, dtype)

    def state_dict(self, dtype: _full.DtypeArgument = None,
                   rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with every parameter whole (new memory, on
        the cpu): the keys of the unwrapped model, tied parameters under each
        of their names, buffers as they are. Collective; with rank0_only the
        other ranks get an empty dict."""
        return _full.state_dict(self, dtype, rank0_only)

    def save_consolidated(self, path: StrPath, dtype: _full.DtypeArgument = None,
                          max_shard_bytes: int = 5 << 30) -> None:
        """Writes the whole model as Hugging Face safetensors into the folder
        `path` (``model.safetensors``, or numbered files with an index past
        max_shard_bytes; plus ``config.json`` for a transformers model), so
        that ``from_pretrained(path)`` loads it. Rank 0 writes, holding at
        most one file's tensors at a time. Collective."""
        _full.save_consolidated(self, path, dtype, max_shard_bytes)

    def close(self) -> None:
        """Removes the hooks and gives every parameter its full values back
        (all-gathered; collective). The engine is unusable afterwards."""
        self._snapshots.finish_save()
        if self._passes.pass_open:
            self._passes.end_pass()
        if self._offload is not None:
            self._offload.close()
        full = self.full_parameters(dtype="param")
        self._passes.uninstall(self.module)
        with torch.no_grad():
            for zp in self._params:
                zp.param.data = full[zp.name]

    def save(self, directory: StrPath, client_state: Any = None, tag: str | None = None,
             background: bool = False) -> None:
        """Writes a checkpoint (shards, optimizer state, global_step, the
        lr_scheduler's state, `client_state`) into `directory`/<tag> (tag:
        "step<N>" by default) and commits it atomically by pointing `directory`/latest
        at it: an interrupted save leaves the previous checkpoint whole.
        Collective; an error on any rank is raised on every rank. See
        _checkpoint.py. ``background``: under ``ductile agent``, right after
        a step whose snapshot is in memory, the files are written from the
        snapshot on a thread and the save commits while training goes on;
        the next step, save, load or close, or wait_for_save(), waits for
        it and raises its error (_snapshots.py). Without such a snapshot the
        save is written before it returns, with a warning."""
        if background:
            self._snapshots.save(directory, client_state, tag)
            return
        self._snapshots.finish_save()
        from . import _checkpoint
        _checkpoint.save(self, directory, client_state, tag)

    def wait_for_save(self) -> None:
        """Waits until the save(background=True) in progress is committed;
        raises its error on every rank. Collective."""
        self._snapshots.finish_save()

    def load(self, directory: StrPath, lr_scheduler: bool = True) -> Any:
        """Restores shards, optimizer state, global_step and (with
        ``lr_scheduler``) the scheduler's state from the checkpoint
        `directory`/latest names (or from `directory` itself when it holds a
        manifest), saved at any world size; returns the client_state given
        to save(). Everything is read and checked on every rank first: on
        any error, every rank raises and the model and optimizer are
        unchanged. Collective."""
        self._snapshots.finish_save()
        from . import _checkpoint
        return _checkpoint.load(self, directory, lr_scheduler)
