"""The ZeRO-3 engine: a torch.nn.Module's parameters partitioned by the C++
coordinator (the configured ``zero`` plugin) over the ranks of its world,
gathered just in time by module hooks. It sits on seams, as FSDP2's
``fully_shard`` does:

- _units.py: which modules are hooked (units) and which parameters each
  gathers (groups);
- _param.py: group and parameter state (flat shards, master copies,
  materialisation, saved-tensor packing);
- _shards.py: partitioning set-up and the shards' update before a pass;
- _passes.py: pass and hook orchestration (fetch, release, backward);
- _gradients.py and _grad_shards.py: reduce-scatters by group, and
  unscaling and clipping of the gradient shards;
- _offload.py and _budget.py: optimizer offload to the host, and where
  each group's tensors live under max_device_memory;
- this file: the engine's set-up (configuration, world) and the training
  API (backward, step, accumulation, checkpoints, full weights).

The world is torch.distributed's process group when it is initialised and
the configuration allows it (``[accelerator] communicator = "auto"`` or
``"host"``): the coordinator's gathers and the engine's reduce-scatters run
on it (gloo on cpu, NCCL on cuda) and no MPI is started. Otherwise it is the
accelerator's own (Open MPI under mpirun or ``ductile agent --mpi-world``,
NCCL over an MPI bootstrap, or a single process).
"""

import contextlib

import torch

from ... import _ductile
from ..._errors import IncompatibleError, InvalidArgumentError
from . import _budget, _config, _full, _grad_shards
from ._collectives import SessionCollectives
from ._gradients import GradientReducer
from ._memory import DeviceMemory
from ._offload import OffloadedOptimizer, place
from ._passes import ENGINE, EXTERNAL, Passes
from ._per_parameter import PerParameterOptimizers
from ._shards import Sharding


def register_external_parameter(module, parameter):
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
    """See ``ductile.torch.zero3.initialize``."""

    def __init__(self, model, optimizer_factory=None, config=None, *, plugin_path=None,
                 mixed_precision=None, load_from=None, group=None, step_in_backward=False,
                 groups="auto", offload_optimizer=None, max_device_memory=None):
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(
                f"zero3.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
        if config is None:
            raise InvalidArgumentError(
                "zero3.initialize: config is required: a ductile TOML (path, text or dict) with "
                "[zero] and [accelerator] sections, or a DeepSpeed JSON config")
        world = _config.torch_world(group)
        settings = _config.resolve(config, plugin_path, mixed_precision, world)
        self.config = settings.loaded
        self.mixed_precision = settings.mixed_precision
        self.gradient_clipping = settings.gradient_clipping
        self._session = _ductile.zero.Session(settings.loaded.runtime, world)
        self._memory = DeviceMemory(self._session.backend)
        if self._session.host_world:
            if world.device.type != self._memory.device.type:
                raise IncompatibleError(
                    f"zero3: torch.distributed's {world.backend} process group works on "
                    f"{world.device.type}, the configured accelerator on {self._session.backend}; "
                    "use gloo with backend = \"cpu\" or NCCL with backend = \"cuda\"")
            self.comm = world
        else:
            self.comm = SessionCollectives(self._session, self._memory.device)
        self.rank = self._session.rank
        self.world_size = self._session.size
        self.module = model
        self.global_step = 0       # optimizer steps taken (saved in checkpoints)
        self._dirty = True         # the optimizer's shards changed since the last sync
        self._unscaled = False     # the gradient shards are unscaled for this step
        precision = self.mixed_precision
        self._scaler = precision.loss_scaler if precision is not None else None

        self._sharding = Sharding(self._session, self._memory, self.comm, precision)
        self._params = self._sharding.collect(model)
        units = self._sharding.plan(model, groups)
        self._groups = self._sharding.groups
        if optimizer_factory is None:
            optimizer_factory = settings.optimizer
        offload = settings.offload
        if offload_optimizer is not None:
            offload = _config.offload_settings(offload_optimizer,
                                               "zero3.initialize: offload_optimizer")
        self._placement = _budget.Placement(
            self._groups, precision.master_dtype if precision is not None else None,
            2 if optimizer_factory is not None else 0,
            _budget.gather_reserve(self._session, self._groups))
        self._offload = place(self._groups, self._placement, offload,
                              _budget.budget_bytes(max_device_memory, self._memory.device),
                              optimizer_factory is not None, step_in_backward,
                              self._memory.device)
        self._sharding.offload = self._offload
        self._sharding.partition(model, load_from)
        self._dirty = False
        reduce_dtype = precision.reduce_dtype if precision is not None else None
        largest = max(self.world_size * g.shard_numel *
                      torch.empty((), dtype=reduce_dtype or g.dtype).element_size()
                      for g in self._groups)
        self._gradients = GradientReducer(self.comm, reduce_dtype,
                                          max_inflight_bytes=max(2 * largest, 16 << 20))
        self._passes = Passes(self._session, self._memory, self._params, self._groups,
                              self._gradients, self._begin_pass)
        self._passes.register_units(units)
        self._passes.install(model)
        for zp in self._params:
            _full.register_owner(self, zp)
        self.optimizer = None
        self.step_in_backward = bool(step_in_backward)
        if self.step_in_backward:
            if optimizer_factory is None:
                raise InvalidArgumentError(
                    "zero3.initialize: step_in_backward needs an optimizer_factory")
            if self._scaler is not None or self.gradient_clipping:
                raise IncompatibleError(
                    "zero3.initialize: step_in_backward steps each parameter as soon as its "
                    "gradient is reduced, before the whole gradient exists: it cannot clip "
                    "the global norm (gradient_clipping) nor skip overflowing steps (fp16 "
                    "loss scaling)")
            if self._offload is not None:
                self._make_offloaded_optimizer(optimizer_factory)
            else:
                trained = [zp for zp in self._params if zp.requires_grad]
                self.optimizer = PerParameterOptimizers(optimizer_factory,
                                                        [zp.shard for zp in trained])
                by_id = dict(zip((zp.id for zp in trained), self.optimizer.optimizers))
                self._gradients.on_group_ready = lambda g: self._step_group(g, by_id)
        elif optimizer_factory is not None:
            if self._offload is not None:
                self._make_offloaded_optimizer(optimizer_factory)
            else:
                self.optimizer = optimizer_factory([zp.shard for zp in self._params])
            if self.optimizer is not None:
                self.optimizer.register_step_post_hook(self._optimizer_stepped)
        self._device_high_water = 0  # of the last step, by the engine's accounting
        self._resident_key = None    # the optimizer state's size when _resident was counted
        self._resident = 0

    # --- offload ------------------------------------------------------------------------

    def _make_offloaded_optimizer(self, optimizer_factory):
        made = optimizer_factory([zp.shard for zp in self._params])
        if made is None:
            raise InvalidArgumentError(
                "zero3.initialize: optimizer_factory returned None; optimizer offload needs an "
                "optimizer (torch.optim.Adam or AdamW)")
        hosted = [zp.shard for g in self._groups if g.host is not None for zp in g.members]
        self.optimizer = OffloadedOptimizer(made, hosted)
        self._offload.optimizer = self.optimizer.host
        self._gradients.on_group_ready = self._offload.gradient_ready

    def _device_grads(self):
        return _grad_shards.gradient_tensors([g for g in self._groups if g.host is None])

    def _gradient_bytes(self):
        return sum(g.grad_flat.numel() * g.grad_flat.element_size()
                   for g in self._groups if g.grad_flat is not None)

    def _account(self, gradient_bytes):
        state = self.optimizer.state if self.optimizer is not None else {}
        size = (id(state), len(state))
        if size != self._resident_key:  # state added (first steps, a load): count again
            self._resident_key = size
            self._resident = _budget.resident_bytes(self._groups, self.optimizer)
        self._device_high_water = _budget.account(self._resident, self._session,
                                                  self._placement, gradient_bytes)
        self._placement.check(self._device_high_water, self.global_step)

    # --- shards and passes --------------------------------------------------------

    def _optimizer_stepped(self, optimizer, args, kwargs):
        self._dirty = True

    def _step_group(self, group, optimizers):
        """step_in_backward: the group's gradient shard is complete; step
        its parameters now and drop their gradients (the store is brought
        up to date before the next pass)."""
        if not self._gradients.sync:
            return
        for zp in group.trained:
            if zp.shard.grad is not None:
                optimizers[zp.id].step()
                zp.shard.grad = None
        group.grad_flat = None
        group.grad_views = None
        self._dirty = True

    def shards_changed(self):
        """Says that the optimizer's shards were written outside
        optimizer.step() (which the engine sees by itself): the next pass
        gathers the new values (offloaded masters are copied again). With
        offload on cuda, call ``shards_writable()`` before writing."""
        self._dirty = True
        if self._offload is not None:
            self._offload.masters_changed()

    def shards_writable(self):
        """Before writing the optimizer's shards: an offloaded master may
        still be read by its copy to the device (cuda); waits for it."""
        if self._offload is not None:
            self._offload.masters_changed()

    def _begin_pass(self):
        """Before a pass: on cuda, torch's current stream becomes the
        coordinator's compute stream (gathers ordered after the optimizer's
        writes and before the kernels that read them, copies reused only
        after those kernels: see docs/python.md, "Streams"); then the shards
        are brought up to date."""
        if self._memory.device.type == "cuda":
            self._session.set_compute_stream(torch.cuda.current_stream(self._memory.device)
                                             .cuda_stream)
        self._sync_shards()

    def _sync_shards(self):
        if self._dirty:
            self._sharding.sync()
            self._dirty = False

    @property
    def _pass_open(self):
        return self._passes.pass_open

    @property
    def _backward_active(self):
        return self._passes.backward_active

    @property
    def module_callback(self):
        return self._passes.module_callback

    @module_callback.setter
    def module_callback(self, fn):
        self._passes.module_callback = fn

    # --- the training loop -----------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss, **kwargs):
        """``loss.backward(**kwargs)`` (the loss scaled first with fp16 loss
        scaling); gradient shards are complete when it returns."""
        if self._scaler is not None:
            loss = loss * self._scaler.scale
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside sum full gradients locally, with no
        communication; the first backward after it reduce-scatters the sum
        (gradient accumulation with one reduce-scatter per step)."""
        previous = self._gradients.sync
        self._gradients.sync = False
        try:
            yield
        finally:
            self._gradients.sync = previous

    def set_requires_gradient_sync(self, sync):
        """FSDP2's switch: False keeps full gradients locally (see no_sync)."""
        self._gradients.sync = bool(sync)

    def _grad_shards(self):
        return _grad_shards.gradient_tensors(self._groups)

    def _unscale(self):
        """Divides the gradient shards by the loss scale (once per step)."""
        if self._scaler is None or self._unscaled:
            return
        if self._offload is not None:
            self._offload.unscale(self._device_grads(), 1.0 / self._scaler.scale)
        else:
            _grad_shards.unscale(self._grad_shards(), self._scaler.scale)
        self._unscaled = True

    def _overflow(self):
        """True when a gradient shard of any rank holds inf or NaN (collective)."""
        return _grad_shards.overflow(self._grad_shards(), self.comm, self._memory.device)

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """Scales the gradient shards so that the norm of the whole gradient
        (over every rank's shards) is at most max_norm; returns that norm
        (before clipping) as a tensor, the same on every rank. Collective;
        call after backward, before step (fp16: the shards are unscaled
        first). The host does not wait for the device."""
        if self._passes.backward_active:
            raise IncompatibleError("zero3: clip_grad_norm_() called during backward")
        if self.step_in_backward:
            raise IncompatibleError("zero3: clip_grad_norm_() with step_in_backward: the "
                                    "parameters were stepped during backward already")
        max_norm, norm_type = float(max_norm), float(norm_type)
        self._unscale()
        if self._offload is not None:
            return self._offload.clip(self._grad_shards(), self._device_grads(), self.comm,
                                      max_norm, norm_type)
        return _grad_shards.clip(self._grad_shards(), self.comm, self._memory.device, max_norm,
                                 norm_type)

    def step(self):
        """Steps the optimizer on the shards, then clears the gradient shards.
        With gradient_clipping (DeepSpeed config) the gradient is clipped
        first; with fp16 loss scaling a step whose gradient overflowed on
        any rank is skipped and the scale lowered."""
        if self.optimizer is None:
            raise IncompatibleError(
                "zero3: step() needs an optimizer; pass optimizer_factory to initialize()")
        if self._passes.backward_active:
            raise IncompatibleError("zero3: step() called during backward")
        if self._offload is not None:
            self._offloaded_step()
            return
        if self.step_in_backward:
            self.global_step += 1  # every parameter was stepped during backward
            self.zero_grad()
            return
        skip = self._clip_and_scale()
        gradient_bytes = self._gradient_bytes()
        if not skip:
            self.optimizer.step()
        self.global_step += 1
        self.zero_grad()
        self._account(gradient_bytes)

    def _clip_and_scale(self):
        """Before a step: clips to gradient_clipping, and with fp16 loss
        scaling unscales and updates the scale; True when the step must be
        skipped (the gradient overflowed on some rank)."""
        if self.gradient_clipping:
            self.clip_grad_norm_(self.gradient_clipping)
        if self._scaler is None:
            return False
        self._unscale()
        skip = self._overflow()
        self._scaler.update(skip)
        return skip

    def _offloaded_step(self):
        """step() with groups on the host: the device's part by the
        factory's optimizer, the host's group by group (see _offload.py)."""
        gradient_bytes = self._gradient_bytes()
        try:
            skip = False
            if not self.step_in_backward:
                skip = self._clip_and_scale()
                if not skip:
                    self.optimizer.step_device()
            self._offload.step(skip)
        except BaseException:
            self._offload.abandon()
            raise
        finally:
            self._dirty = True
        self.global_step += 1
        self.zero_grad()
        self._account(gradient_bytes)

    def zero_grad(self):
        for zp in self._params:
            zp.shard.grad = None
        for group in self._groups:
            group.grad_flat = None
            group.grad_views = None
        self._unscaled = False

    @property
    def loss_scale(self):
        """The current loss scale (1.0 without loss scaling)."""
        return self._scaler.scale if self._scaler is not None else 1.0

    # --- views and counters ----------------------------------------------------------

    def shard_parameters(self):
        """This rank's shards, one flat tensor per parameter, in
        ``model.named_parameters()`` order: what the optimizer steps on
        (fp32 masters with mixed precision)."""
        return [zp.shard for zp in self._params]

    def named_shards(self):
        return [(zp.name, zp.shard) for zp in self._params]

    def stats(self):
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
        s["max_device_memory"] = self._placement.budget
        s["device_need_bytes"] = self._placement.device_need()
        s["device_high_water_bytes"] = self._device_high_water
        if self._offload is not None:
            s.update(self._offload.counters)
        s["units"] = len(self._passes.units)
        memory = self._session.gather_memory()
        if memory is not None:
            s.update({f"gather_{k}": v for k, v in memory.items()})
        return s

    def units(self):
        """The hooked modules (units), as module names, and the parameters
        each gathers as one group ({unit: [parameter names]}, its own group
        first)."""
        return {u.name: [zp.name for g in u.own for zp in g.members]
                for u in self._passes.units}

    def trace(self):
        """The recorded module order, as unit names (empty while recording)."""
        return [self._passes.module_names[mid] for mid in self._session.trace()]

    def all_reduce(self, tensor, op="mean"):
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

    def check_invariants(self):
        self._session.check_invariants()

    # --- full parameters, checkpoints ---------------------------------------------------

    def full_parameters(self, dtype=None):
        """Every parameter, whole, on every rank (a dict name -> tensor, new
        memory), from the optimizer's shards (fp32 masters with mixed
        precision) unless `dtype` says otherwise. Collective."""
        return _full.full_parameters(self, dtype)

    def state_dict(self, dtype=None, rank0_only=False):
        """``model.state_dict()`` with every parameter whole (new memory, on
        the cpu): the keys of the unwrapped model, tied parameters under each
        of their names, buffers as they are. Collective; with rank0_only the
        other ranks get an empty dict."""
        return _full.state_dict(self, dtype, rank0_only)

    def save_consolidated(self, path, dtype=None, max_shard_bytes=5 << 30):
        """Writes the whole model as Hugging Face safetensors into the folder
        `path` (``model.safetensors``, or numbered files with an index past
        max_shard_bytes; plus ``config.json`` for a transformers model), so
        that ``from_pretrained(path)`` loads it. Rank 0 writes, holding at
        most one file's tensors at a time. Collective."""
        _full.save_consolidated(self, path, dtype, max_shard_bytes)

    def close(self):
        """Removes the hooks and gives every parameter its full values back
        (all-gathered; collective). The engine is unusable afterwards."""
        if self._passes.pass_open:
            self._passes.end_pass()
        if self._offload is not None:
            self._offload.close()
        full = self.full_parameters(dtype="param")
        self._passes.uninstall(self.module)
        with torch.no_grad():
            for zp in self._params:
                zp.param.data = full[zp.name]

    def save(self, directory, client_state=None, tag=None):
        """Writes a checkpoint into `directory`/<tag> (tag: "step<N>" by
        default) and commits it atomically by pointing `directory`/latest
        at it: an interrupted save leaves the previous checkpoint whole.
        Collective; an error on any rank is raised on every rank. See
        _checkpoint.py."""
        from . import _checkpoint
        _checkpoint.save(self, directory, client_state, tag)

    def load(self, directory):
        """Restores shards, optimizer state and global_step from the
        checkpoint `directory`/latest names (or from `directory` itself
        when it holds a manifest), saved at any world size; returns the
        client_state given to save(). Everything is read and checked on
        every rank first: on any error, every rank raises and the model
        and optimizer are unchanged. Collective."""
        from . import _checkpoint
        return _checkpoint.load(self, directory)
