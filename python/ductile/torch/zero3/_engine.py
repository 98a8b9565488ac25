"""The engine: the sharded model it drives, the step and its log line, and
``initialize``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeAlias

import torch

from ... import _ductile
from ..._config import Config, PluginPath, StrPath, load_config
from ..._errors import IncompatibleError, InvalidArgumentError
from . import _optimizer_step, _param
from ._gradients import GradientReducer, LossScaling, MixedPrecision
from ._offload import place
from ._optimizer_step import OptimizerStep
from ._param import Sharding
from ._passes import ENGINE, EXTERNAL, Passes
from ._progress import StepLog
from ._rejoin import Recovery
from ._round_notice import RoundNotice
from ._snapshots import RESTORE_ENV, Snapshots
from ._world import DeviceMemory, SessionCollectives

from ._settings import (Build, OptimizerFactory, Settings, log_interval, offload_argument,
                        resolve, snapshot_keys, torch_world, warn_overridden)


class ShardedModel:
    """A model's parameters partitioned over the ranks of a world: the
    coordinator's handle, the sharding (parameters, groups, units), their
    placement and offload, the gradient reducer and the passes."""

    # previous: the parameters of the engine this one replaces at another
    # world size (rejoin): the same model's, their shards made anew and
    # left zero (the caller loads them). restoring: a snapshot is loaded
    # right after (DUCTILE_SNAPSHOT_RESTORE): the shards are left zero too.
    def __init__(self, model, runtime, world, precision, groups, offload, max_device_memory,
                 load_from, has_optimizer, step_in_backward, move_model=False, previous=None,
                 restoring=False):
        self.session = _ductile.zero.Session(runtime, world)
        self.memory = DeviceMemory(self.session.backend)
        if self.session.host_world:
            if world.device.type != self.memory.device.type:
                raise IncompatibleError(
                    f"zero3: torch.distributed's {world.backend} process group works on "
                    f"{world.device.type}, the configured accelerator on {self.session.backend}; "
                    "use gloo with backend = \"cpu\" or NCCL with backend = \"cuda\"")
            self.comm = world
        else:
            self.comm = SessionCollectives(self.session, self.memory.device)
        self.rank = self.session.rank
        self.world_size = self.session.size

        self.sharding = Sharding(self.session, self.memory, self.comm, precision)
        if move_model and not any(p.is_meta for p in model.parameters()):
            # DeepSpeed's engine takes the model where it was built (the HF
            # Trainer leaves it on the CPU for it) and moves it, buffers too.
            model.to(self.memory.device)
        self.params = (self.sharding.collect(model) if previous is None
                       else self.sharding.adopt(previous))
        units = self.sharding.plan(model, groups)
        self.groups = self.sharding.groups
        self.placement = _optimizer_step.Placement(
            self.groups, precision.master_dtype if precision is not None else None,
            2 if has_optimizer else 0, _optimizer_step.gather_reserve(self.session, self.groups),
            _optimizer_step.staging_cap(self.session, self.groups))
        self.offload = place(self.groups, self.placement, offload,
                             _optimizer_step.budget_bytes(max_device_memory, self.memory.device),
                             has_optimizer, step_in_backward, self.memory.device)
        self.sharding.offload = self.offload
        self.sharding.partition(model, load_from, fill=previous is None and not restoring)
        reduce_dtype = precision.reduce_dtype if precision is not None else None
        self.gradients = GradientReducer(self.comm, reduce_dtype)
        self.passes = Passes(self.session, self.memory, self.params, self.groups,
                             self.gradients, self.begin_pass)
        self.passes.register_units(units)
        self.passes.install(model)

    def begin_pass(self):
        """Before a pass: on cuda, torch's current stream becomes the
        coordinator's compute stream (gathers ordered after the optimizer's
        writes and before the kernels that read them, copies reused only
        after those kernels: see docs/zero3.md, "Streams"); then the shards
        are brought up to date."""
        if self.memory.device.type == "cuda":
            self.session.set_compute_stream(torch.cuda.current_stream(self.memory.device)
                                            .cuda_stream)
        if self.sharding.changed:
            self.sharding.sync()


# The ZeRO-3 engine: ``Zero3Engine`` is the user's facade (DeepSpeed's engine API); the work sits
# on seams, one file each, as FSDP2's ``fully_shard`` does (docs/architecture.md lists them).

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

    # config: also the Settings the DeepSpeed drop-in resolved.
    def __init__(self, model: torch.nn.Module, optimizer_factory: OptimizerFactory | None = None,
                 config: ConfigSource | Settings | None = None, *,
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
        world = torch_world(group)
        settings = resolve(config, plugin_path, mixed_precision, world)
        self.config = settings.loaded
        # A DeepSpeed config's training keys as the mapping read them; None
        # for a TOML.
        self.training = settings.training
        self.mixed_precision = precision = settings.mixed_precision
        if settings is not config:  # not the DeepSpeed drop-in's, resolved from its config
            warn_overridden(settings, optimizer_factory, offload_optimizer)
        if optimizer_factory is None:
            optimizer_factory = settings.optimizer
        offload = settings.offload
        if offload_optimizer is not None:
            # The argument is about the optimizer only.
            param, pipeline = offload.param, offload.pipeline
            offload = offload_argument(offload_optimizer, settings.loaded.runtime)
            offload.param, offload.pipeline = param, pipeline

        sharded = ShardedModel(model, settings.loaded.runtime, world, precision, groups,
                               offload, max_device_memory, load_from,
                               optimizer_factory is not None, step_in_backward, move_model,
                               restoring=bool(os.environ.get(RESTORE_ENV)))
        self.module = model
        # What rejoin() builds the engine again from, at another world size.
        self._build = Build(settings.loaded, groups, offload, max_device_memory,
                            optimizer_factory)
        self._attach(sharded, optimizer_factory, settings.gradient_clipping, step_in_backward)
        self._lr_scheduler = None
        interval = log_interval(settings)  # checked by the schema
        self._step_log = StepLog(interval, self) if interval else None
        self._snapshots = Snapshots(self, *snapshot_keys(settings))
        # A callable given the step, whose JSON value each snapshot's
        # manifest keeps as its client state (the training loop's own
        # position: DuctileTrainer's sampler), or None; the same on every
        # node, whose manifests must be alike. The restored snapshot's
        # value, or None.
        self.snapshot_client_state: Callable[[int], Any] | None = None
        self.restored_client_state: Any = None
        # The step restored from DUCTILE_SNAPSHOT_RESTORE (a round that
        # resumes from memory under `ductile agent`), or None.
        self.restored_from_memory = self._snapshots.restore()
        # The DeepSpeed drop-in's engine (move_model) over this one: its
        # batch sizes follow the world size (_rejoin._check_supported), and
        # its counters a rejoin (_after_rejoin, called with the step restored).
        self._drop_in = move_model
        self._after_rejoin: Callable[[int], None] | None = None
        # In-place recovery under `ductile agent` (DUCTILE_ROUND_NOTICE set;
        # _rejoin.py), else None: the training loop's calls go straight on.
        self._recovery = Recovery.of(self)

    def _attach(self, sharded, optimizer_factory, gradient_clipping, step_in_backward):
        """Takes `sharded` (a ShardedModel of self.module) as the engine's,
        and makes its optimizer step."""
        precision = self.mixed_precision
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
            _param.register_owner(self, zp)

        self._scaler = precision.loss_scaler if precision is not None else None
        scaling = None
        if self._scaler is not None:
            scaling = LossScaling(self._scaler, self._groups, self._offload, self.comm,
                                  self._memory.device)
        self._steps = OptimizerStep(sharded, optimizer_factory, scaling,
                                    gradient_clipping, step_in_backward)
        self.optimizer = self._steps.optimizer
        self.step_in_backward = self._steps.step_in_backward

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
    def snapshot_overlap(self) -> bool:
        """Whether an in-memory snapshot's shard file (under ``ductile
        agent``) is copied, checksummed and written on a thread while the
        next step's forward and backward run, and committed before the next
        optimizer update (False: within step(), the default). The bytes
        and the commits are the same; the snapshot of step N commits during
        step N + 1 (_snapshots.py, "Overlap")."""
        return self._snapshots.overlap

    @snapshot_overlap.setter
    def snapshot_overlap(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise InvalidArgumentError(
                f"zero3: snapshot_overlap = {value!r} is not a bool; give True or False")
        self._snapshots.overlap = value

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
        ``ductile.zero3`` logger on rank 0; 0: none. From
        [zero] log_interval, else a DeepSpeed config's steps_per_print."""
        return 0 if self._step_log is None else self._step_log.interval

    @log_interval.setter
    def log_interval(self, value: int) -> None:
        # [zero] log_interval's bound (its schema's, steps_per_print's).
        value = _ductile.int_argument(value, "zero3: log_interval", 0, _ductile.MAX_LOG_INTERVAL)
        self.flush_log()
        self._step_log = StepLog(value, self) if value else None

    def flush_log(self) -> None:
        """Writes the progress lines not written yet, waiting for their
        values (a step's line is written at a later step, once its values
        reached the host without the step waiting for the device; close()
        and the process' exit flush too)."""
        if self._step_log is not None:
            self._step_log.lines.flush()

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
        self.shards_writable()

    def shards_writable(self) -> None:
        """Before writing the optimizer's shards: an offloaded master may
        still be read by its copy to the device (cuda), a snapshot's file
        by its thread (``snapshot_overlap``: committed first, collective);
        waits for them."""
        if self._snapshots.writing is not None:
            self._snapshots.finish_write()
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

    # Under `ductile agent` with DUCTILE_ROUND_NOTICE, forward, backward and
    # step go through the recovery (_rejoin.py), which keeps the step's
    # inputs and rejoins the next round when a peer is lost.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._recovery is not None:
            return self._recovery.forward(args, kwargs)
        return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)`` (the loss scaled first with fp16 loss
        scaling); gradient shards are complete when it returns."""
        # Not through _divided_backward: the plain step's calls are counted
        # (tests/python/test_zero3_groups.py).
        if self._recovery is not None:
            self._recovery.backward(loss, kwargs)
            return
        self._backward(loss, kwargs)

    def _divided_backward(self, loss, divisor, kwargs):
        """backward() of ``loss / divisor`` (the DeepSpeed drop-in divides by
        its gradient accumulation steps); returns that loss."""
        if self._recovery is not None:
            return self._recovery.backward(loss, kwargs, divisor)
        if divisor != 1:
            loss = loss / divisor
        self._backward(loss, kwargs)
        return loss

    def _backward(self, loss, kwargs):
        if self._scaler is not None:
            loss = loss * self._scaler.scale
        if self._steps.updates_in_backward and self._snapshots.enabled:
            # The optimizer steps during this backward (step_in_backward, the
            # offload pipeline): the last snapshot's replicas must be complete
            # first.
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
        if self._recovery is not None:
            self._recovery.step(lr_kwargs)
            return
        self._step(lr_kwargs)

    def _step(self, lr_kwargs):
        # Attributes, not calls, when snapshots are off: the step's host
        # work is counted (tests/python/test_zero3_groups.py).
        snapshots = self._snapshots
        if snapshots.enabled:
            snapshots.before_update()
        log = self._step_log
        if log is not None and log.lines:
            log.lines.poll()  # earlier steps' lines whose values have arrived
        logged = log is not None and log.due(self._steps.global_step + 1)
        if logged:
            groups = self.optimizer.param_groups if self.optimizer is not None else ()
            lr = groups[0]["lr"] if groups else None
            if isinstance(lr, torch.Tensor):
                lr = lr.detach().clone()  # a scheduler fills a tensor's value in place
        self._steps.step()
        scheduler = self._lr_scheduler
        if scheduler is not None and self._steps.step_applied:
            scheduler.step(**(lr_kwargs or {}))
        if logged:
            assert log is not None  # logged only with a log
            log.log(lr)
        if snapshots.enabled:
            snapshots.after_step()

    def rejoin(self, notice: RoundNotice | str | bytes) -> int:
        """Goes on in the next round of ``ductile agent`` in this process:
        leaves the old process group (a lost peer does not hold it up),
        joins the round's (``notice``: a RoundNotice, or its JSON; see
        _round_notice.py), shards the parameters and the optimizer state
        over the new world size and loads the notice's snapshot folder into
        them; returns the step restored. The engine, ``module``,
        ``optimizer`` (its param_groups' values), ``lr_scheduler`` stay the
        objects they were. Collective over the new round. Under the agent
        with DUCTILE_ROUND_NOTICE the engine calls it by itself (a failed
        collective, or a newer notice at a step's first forward)."""
        from . import _rejoin
        return _rejoin.rejoin(self, notice)

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
        # The training thread's time blocked by in-memory snapshots, over
        # the snapshots counted (_snapshots.py).
        s["snapshot_blocked_ns"] = self._snapshots.blocked_ns
        s["snapshots_timed"] = self._snapshots.timed
        s["snapshots_skipped"] = self._snapshots.skipped  # due while the last was written
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

    def full_parameters(self, dtype: _param.DtypeArgument = None) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on every rank (a dict name -> tensor, new
        memory), from the optimizer's shards (fp32 masters with mixed
        precision) unless `dtype` says otherwise. Collective."""
        return _param.full_parameters(self, dtype)

    def state_dict(self, dtype: _param.DtypeArgument = None,
                   rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with every parameter whole (new memory, on
        the cpu): the keys of the unwrapped model, tied parameters under each
        of their names, buffers as they are. Collective; with rank0_only the
        other ranks get an empty dict."""
        return _param.state_dict(self, dtype, rank0_only)

    def save_consolidated(self, path: StrPath, dtype: _param.DtypeArgument = None,
                          max_shard_bytes: int = 5 << 30) -> None:
        """Writes the whole model as Hugging Face safetensors into the folder
        `path` (``model.safetensors``, or numbered files with an index past
        max_shard_bytes; plus ``config.json`` for a transformers model), so
        that ``from_pretrained(path)`` loads it. Rank 0 writes, holding at
        most one file's tensors at a time. Collective."""
        _param.save_consolidated(self, path, dtype, max_shard_bytes)

    def close(self) -> None:
        """Removes the hooks and gives every parameter its full values back
        (all-gathered; collective). The engine is unusable afterwards."""
        self.flush_log()
        self._snapshots.close()
        if self._recovery is not None:
            self._recovery.close()
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


def initialize(model: torch.nn.Module, optimizer_factory: OptimizerFactory | None = None,
               config: ConfigSource | None = None, *, plugin_path: PluginPath = None,
               mixed_precision: MixedPrecision | str | torch.dtype | None = None,
               load_from: StrPath | None = None,
               group: torch.distributed.ProcessGroup | None = None,
               step_in_backward: bool = False, groups: Groups = "auto",
               allow_config_plugins: bool = False,
               offload_optimizer: bool | str | dict[str, Any] | None = None,
               max_device_memory: int | float | None = None) -> Zero3Engine:
    """Partitions ``model``'s parameters and installs the hooks; returns the
    engine. Collective: every rank calls it with the same model structure.

    ``optimizer_factory``: called with the list of shard parameters (one flat
    tensor per parameter, in ``model.named_parameters()`` order, fp32 masters
    with mixed precision), returns a ``torch.optim`` optimizer (or None: no
    optimizer). ``config``: a ductile TOML (path or text; a dict of sections
    through ``ductile.load_config(d, format="toml")``) with a ``[zero]``
    section (e.g. ``coordinator = "partitioned"``) and an ``[accelerator]``
    section, or a DeepSpeed JSON config (path, text, or dict, as
    ``deepspeed.initialize`` takes it: ZeRO stage 3; its bf16/fp16,
    gradient_clipping, optimizer and scheduler keys are honoured: the
    scheduler is ``engine.lr_scheduler``, stepped by ``step()``), or a loaded
    ``ductile.Config``. When
    torch.distributed is initialised (torchrun) and ``[accelerator]
    communicator`` is "auto" or "host", its process group (``group``, or the
    default one) is the world: no MPI. ``mixed_precision``: a
    ``MixedPrecision``, or "bf16"/"fp16" (fp32 masters and reduction).
    Initial values: the slices ``zero3.init`` kept, safetensors files
    (``load_from``), or rank 0's values, broadcast as
    DistributedDataParallel does. ``step_in_backward``: one optimizer per
    shard (``optimizer_factory([shard])``), stepped as soon as that shard's
    gradient is reduce-scattered, so the gradient shards never all exist at
    once (no global clipping or fp16 loss scaling then; accumulate with
    ``no_sync()`` for all but the last micro-batch). ``groups``: which
    modules are hooked and gather their parameters as one group (one
    collective each way): "auto" (the transformer blocks: a Hugging Face
    model's ``_no_split_modules``, else each child of an ``nn.ModuleList``;
    the root takes the rest), "module" (every module with parameters), a
    tuple of module classes or a callable ``module -> bool`` (those, and the
    root). ``offload_optimizer``: "cpu" (or True) keeps every group's fp32
    master and Adam state in host memory, stepped by the cpu_adam plugin
    (a dict takes DeepSpeed's offload_optimizer keys: device, pin_memory,
    ratio); the optimizer must be Adam or AdamW. ``max_device_memory``:
    bytes (int) or a fraction of the device's memory (float): the groups'
    optimizers that do not fit go to the host. ``engine.stats()`` reports
    the placement and the device bytes (docs/zero3.md, "Offload").
    ``mixed_precision``, ``offload_optimizer`` and ``optimizer_factory``
    win over what the config sets for the same thing (its bf16/fp16
    sections, offload_optimizer key, optimizer section), with a UserWarning
    naming the key they replace.
    ``allow_config_plugins``: load plugins from the directories the
    config's own ``[plugins] path`` names (off: see ``ductile.load_config``).
    Under ``ductile agent``, the engine writes snapshots of the training
    state into DUCTILE_SNAPSHOT_DIR every ``[zero] snapshot_interval``
    steps, and loads DUCTILE_SNAPSHOT_RESTORE when a round resumes from
    one (``engine.restored_from_memory``: its step; docs/zero3.md,
    "Snapshots in memory").
    Raises ConfigError (also for a plugin the config selects from a
    directory it names, without ``allow_config_plugins``),
    InvalidArgumentError (a parameter of an unsupported dtype or on the
    wrong device, a bad ``groups``).
    """
    if config is not None:
        config = load_config(config, plugin_path=plugin_path,
                             allow_config_plugins=allow_config_plugins)
    engine = Zero3Engine(model, optimizer_factory, config, plugin_path=plugin_path,
                         mixed_precision=mixed_precision, load_from=load_from, group=group,
                         step_in_backward=step_in_backward, groups=groups,
                         offload_optimizer=offload_optimizer,
                         max_device_memory=max_device_memory)
    scheduler = (engine.training or {}).get("scheduler")
    if scheduler is not None and engine.optimizer is not None:
        from ...deepspeed.lr_schedules import scheduler_from_config
        engine.lr_scheduler = scheduler_from_config(scheduler, engine.optimizer)
    return engine
