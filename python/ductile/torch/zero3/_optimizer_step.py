"""The optimizer step on shards: per-parameter optimizers, the device memory budget, and the
optimizer over the device's and the host's shards (the host's part: _offload.py)."""

import os
import warnings
from typing import Any

import torch

from ..._errors import IncompatibleError, InvalidArgumentError
from . import _gradients

# Where the engine keeps each group's tensors (parameter shard, fp32 master, Adam state, gradient
# shard; plus the coordinator's gathered copies), which of them go to the host under
# ``max_device_memory`` and in what order, and what is accounted: docs/zero3.md, "A budget". The
# accounting is the engine's own; activations and the framework's workspaces are the model's.

_FP32 = 4


def budget_bytes(value, device):
    """``max_device_memory`` as bytes: an int (bytes) or a float in (0, 1]
    (that fraction of the device's memory; on the cpu backend, of the
    host's)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(
            f"zero3: max_device_memory = {value!r}; valid: a number of bytes (int >= 1) or a "
            "fraction of the device's memory (float in (0, 1])")
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise InvalidArgumentError(
                f"zero3: max_device_memory = {value!r}; a fraction must lie in (0, 1] (or give "
                "bytes as an int)")
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(value * total)
    if value < 1:
        raise InvalidArgumentError(
            f"zero3: max_device_memory = {value}; valid: a number of bytes >= 1")
    return int(value)


class GroupBytes:
    """A group's device bytes by kind (see the module's docstring)."""

    def __init__(self, group, master_dtype, states):
        trained = sum(zp.shard_numel for zp in group.trained)
        self.group = group
        self.parameters = group.shard_numel * group.element_size
        self.master_weights = group.shard_numel * _FP32 \
            if master_dtype is not None and master_dtype != group.dtype else 0
        self.optimizer_state = states * trained * _FP32
        self.gradients = group.shard_numel * _FP32 if trained else 0

    @property
    def optimizer(self):
        """What offloading the group's optimizer frees on the device."""
        return self.optimizer_state + self.master_weights


class Placement:
    """Which groups' optimizers are on the host, and the device bytes."""

    def __init__(self, groups, master_dtype, states, gather_reserve, staging_cap):
        self.master_dtype = master_dtype  # of the optimizer's shards; None: the shards' own
        self.bytes = [GroupBytes(g, master_dtype, states) for g in groups]
        self.gather_reserve = gather_reserve
        self.staging_cap = staging_cap
        self.world = groups[0].world if groups else 1
        self.offloaded = set()  # group ids whose optimizer is on the host
        self.shards_on_host = set()  # group ids whose parameter shard is in host memory
        self.budget = None
        self.warned = False

    def staging(self):
        """Device bytes of host shards copied for gathers in flight: at most
        all of them, the staging cap, and the gathered copies' reserve over
        the world size (a shard is 1/world of its gathered copy)."""
        on_host = sum(b.parameters for b in self.bytes if b.group.id in self.shards_on_host)
        return min(on_host, self.staging_cap, -(-self.gather_reserve // self.world))

    def device_need(self):
        total = self.gather_reserve + self.staging()
        for b in self.bytes:
            total += b.gradients
            if b.group.id not in self.shards_on_host:
                total += b.parameters
            if b.group.id not in self.offloaded:
                total += b.optimizer
        return total

    def choose(self, budget, all_optimizers, ratio=None, all_shards=False):
        """Offloads every group's optimizer (`all_optimizers`; with
        `ratio`, the largest ones until that share of the optimizer bytes)
        and every parameter shard with its optimizer (`all_shards`); then,
        under `budget`, the largest of the other optimizers until the need
        fits, and then the largest shards. IncompatibleError naming the
        numbers when it cannot."""
        candidates = sorted((b for b in self.bytes if b.optimizer_state),
                            key=lambda b: (-b.optimizer, b.group.id))
        if all_shards:
            for b in self.bytes:
                self.shards_on_host.add(b.group.id)
                if b.optimizer_state:
                    self.offloaded.add(b.group.id)
        if all_optimizers:
            total = sum(b.optimizer for b in candidates)
            moved = 0
            for b in candidates:
                if ratio is not None and total and moved >= ratio * total:
                    break
                self.offloaded.add(b.group.id)
                moved += b.optimizer
        self.budget = budget
        if budget is None:
            return self.offloaded
        for b in candidates:
            if self.device_need() <= budget:
                break
            self.offloaded.add(b.group.id)
        # The last resort: parameter shards, the largest first (their
        # optimizers are all on the host by now).
        for b in sorted(self.bytes, key=lambda b: (-b.parameters, b.group.id)):
            if self.device_need() <= budget:
                break
            self.shards_on_host.add(b.group.id)
        need = self.device_need()
        if need > budget:
            raise IncompatibleError(
                f"zero3: max_device_memory = {budget} bytes cannot be met: with the optimizer "
                f"state, master weights and parameter shards of every group on the host, the "
                f"device still needs {need} bytes (gradient shards {self.total('gradients')}, "
                f"gathered copies up to {self.gather_reserve}, host shards copied for them up "
                f"to {self.staging()}); valid: max_device_memory >= {need} (or lower [zero] "
                "max_live_parameters or prefetch_bucket_size to gather less at once)")
        return self.offloaded

    def check(self, high_water, step):
        """Warns once when a step's accounted bytes passed the budget: the
        coordinator gathered more than its limits promised."""
        if self.budget is not None and high_water > self.budget and not self.warned:
            self.warned = True
            warnings.warn(
                f"zero3: step {step} held {high_water} bytes on the device by the engine's "
                f"accounting, over max_device_memory = {self.budget}; the gathered copies took "
                f"more than the {self.gather_reserve} bytes planned for them", UserWarning,
                stacklevel=1)

    def total(self, kind, where="device"):
        out = 0
        for b in self.bytes:
            if kind == "parameters":
                on_host = b.group.id in self.shards_on_host
            else:
                on_host = b.group.id in self.offloaded and kind in ("optimizer_state",
                                                                     "master_weights")
            if on_host == (where == "host"):
                out += getattr(b, kind)
        return out

    def report(self):
        """{kind: {"device": bytes, "host": bytes}} of the plan."""
        return {kind: {"device": self.total(kind), "host": self.total(kind, "host")}
                for kind in ("parameters", "master_weights", "optimizer_state", "gradients")}


def gather_reserve(session, groups):
    """The most the coordinator's gathered copies may take: its live limit
    (max_live_parameters) plus the largest group, which a unit may gather
    beyond it, or every group at once without a limit; plus the root's
    group, open from the forward to the end of the backward."""
    stats = session.stats()
    limit = int(stats.get("max_live_numel") or 0)
    size = max(g.element_size for g in groups)
    everything = sum(g.world * g.shard_numel for g in groups)
    largest = max(g.world * g.shard_numel for g in groups)
    if limit <= 0 or limit >= everything:
        return everything * size
    return min(everything, limit + 2 * largest) * size


def staging_cap(session, groups):
    """The most bytes of host shards the coordinator copies to the device at
    once, as it bounds them for `groups` (its gathers in flight and its
    prefetch bucket are its own configuration)."""
    return session.staging_bytes_bound(max(g.shard_numel for g in groups),
                                       max(g.element_size for g in groups))


def resident_bytes(groups, optimizer):
    """The shards, and the masters and optimizer state on the device. It
    walks every parameter's state: the engine calls it again only when the
    optimizer's state changed in size (its first steps, a load)."""
    total = 0
    state = optimizer.state if optimizer is not None else {}
    for group in groups:
        if not group.shard_on_host:
            total += group.shard_numel * group.element_size
        if group.host is None:
            if group.master is not group.store:
                total += group.master.numel() * group.master.element_size()
            for zp in group.members:
                for value in state.get(zp.shard, {}).values():
                    if isinstance(value, torch.Tensor) and value.numel() == zp.shard_numel:
                        total += value.numel() * value.element_size()
    return total


def gathered_bytes(session):
    """The coordinator's pool of gathered copies at this point: the larger
    of its high-water of copies in use and what it holds now."""
    memory = session.gather_memory()
    return max(memory["high_water_bytes"], memory["in_use_bytes"] + memory["idle_bytes"])


# step_in_backward: one optimizer per parameter shard, each stepped as soon as that shard's
# gradient is reduce-scattered (as torch's ``_apply_optimizer_in_backward``), shown to the
# checkpoints as one optimizer with torch's layout.


class PerParameterOptimizers:
    def __init__(self, factory, shards):
        self.optimizers = []
        for shard in shards:
            optimizer = factory([shard])
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise InvalidArgumentError(
                    "zero3: with step_in_backward, optimizer_factory must return a "
                    f"torch.optim.Optimizer for each shard, got {type(optimizer).__name__}")
            if len(optimizer.param_groups) != 1:
                raise InvalidArgumentError(
                    "zero3: with step_in_backward, optimizer_factory([shard]) must make one "
                    "parameter group")
            self.optimizers.append(optimizer)
        self.kind = type(self.optimizers[0]).__name__ if self.optimizers else "none"

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self):
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self):
        """Nothing: every parameter was stepped during backward."""

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        state, groups, index = {}, [], 0
        for o in self.optimizers:
            sd = o.state_dict()
            for group in sd["param_groups"]:
                groups.append(dict(group, params=[index]))
            if 0 in sd["state"]:
                state[index] = sd["state"][0]
            index += 1
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optimizers):
            raise ValueError(f"{len(groups)} parameter groups for {len(self.optimizers)} "
                             "per-parameter optimizers")
        for o, group in zip(self.optimizers, groups):
            (index,) = group["params"]
            entry = state_dict["state"].get(index)
            o.load_state_dict({"state": {0: entry} if entry is not None else {},
                               "param_groups": [dict(group, params=[0])]})


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


def _constructor_defaults(made):
    """The keyword arguments that rebuild `made`'s class with its defaults
    (those its constructor accepts)."""
    import inspect
    accepted = inspect.signature(type(made).__init__).parameters
    return {k: v for k, v in made.defaults.items() if k in accepted}


# The step never waits on the host for the device, except for fp16's overflow decision
# (_gradients.py). After it the optimizer's shards have changed: the next pass gathers the new
# values (``Sharding.changed``).


class OptimizerStep:
    """The optimizer of one engine's shards, and its step."""

    def __init__(self, sharded, optimizer_factory, scaling, gradient_clipping,
                 step_in_backward):
        self.sharding = sharded.sharding
        self.session = sharded.session
        self.comm = sharded.comm
        self.device = sharded.memory.device
        self.params = sharded.params
        self.groups = sharded.groups
        self.device_groups = [g for g in self.groups if g.host is None]  # not offloaded
        self.placement = sharded.placement
        self.offload = sharded.offload
        self.gradients = sharded.gradients
        self.passes = sharded.passes
        self.scaling = scaling  # LossScaling with fp16, else None
        self._measure_grad_norm = False
        self.set_gradient_clipping(gradient_clipping)
        self.global_step = 0        # optimizer steps taken (saved in checkpoints)
        self.step_applied = False   # the last step changed the shards (no fp16 overflow)
        # The global gradient norm before clipping, of the last step that
        # clipped or measured it (a 0-d tensor); measured without clipping
        # only when measure_grad_norm is set (DeepSpeed's engine reports it).
        self.grad_norm = None
        self.device_high_water = 0  # of the last step, by the engine's accounting
        self._resident_key = None   # the optimizer state's size when _resident was counted
        self._resident = 0
        # The factory's optimizer, PerParameterOptimizers (step_in_backward) or
        # OffloadedOptimizer (offload); None without a factory.
        self.optimizer: Any = None
        self.step_in_backward = bool(step_in_backward)
        if self.step_in_backward:
            if optimizer_factory is None:
                raise InvalidArgumentError(
                    "zero3.initialize: step_in_backward needs an optimizer_factory")
            if scaling is not None or gradient_clipping:
                raise IncompatibleError(
                    "zero3.initialize: step_in_backward steps each parameter as soon as its "
                    "gradient is reduced, before the whole gradient exists: it cannot clip "
                    "the global norm (gradient_clipping) nor skip overflowing steps (fp16 "
                    "loss scaling)")
        if optimizer_factory is not None and self.offload is not None:
            self._make_offloaded_optimizer(optimizer_factory)
        elif self.step_in_backward:
            trained = [zp for zp in self.params if zp.requires_grad]
            self.optimizer = PerParameterOptimizers(optimizer_factory,
                                                    [zp.shard for zp in trained])
            by_id = dict(zip((zp.id for zp in trained), self.optimizer.optimizers))
            self.gradients.on_group_ready = lambda g: self._step_group(g, by_id)
        elif optimizer_factory is not None:
            self.optimizer = optimizer_factory([zp.shard for zp in self.params])
        self.hook = None  # the optimizer's step hook, removed when the engine rejoins
        if self.optimizer is not None and not self.step_in_backward:
            self.hook = self.optimizer.register_step_post_hook(self._optimizer_stepped)

    def set_gradient_clipping(self, value):
        self.gradient_clipping = value
        # Whether a step first clips, measures or unscales the gradient shards.
        self.prepares_gradients = (bool(value) or self.scaling is not None
                                   or self._measure_grad_norm)
        if self.offload is not None:
            # The pipeline steps during backward only what nothing reads whole first.
            self.offload.early = self.offload.pipeline and not self.prepares_gradients

    @property
    def updates_in_backward(self):
        """Whether a backward that syncs gradients changes the shards."""
        return self.step_in_backward or (self.offload is not None and self.offload.early)

    @property
    def measure_grad_norm(self):
        return self._measure_grad_norm

    @measure_grad_norm.setter
    def measure_grad_norm(self, value):
        self._measure_grad_norm = bool(value)
        self.set_gradient_clipping(self.gradient_clipping)

    def _make_offloaded_optimizer(self, optimizer_factory):
        made = optimizer_factory([zp.shard for zp in self.params])
        if made is None:
            raise InvalidArgumentError(
                "zero3.initialize: optimizer_factory returned None; optimizer offload needs an "
                "optimizer (torch.optim.Adam or AdamW)")
        hosted = [zp.shard for g in self.groups if g.host is not None for zp in g.members]
        self.optimizer = OffloadedOptimizer(made, hosted)
        self.offload.optimizer = self.optimizer.host
        self.offload.owner = self.optimizer
        self.gradients.on_group_ready = self.offload.gradient_ready

    def _optimizer_stepped(self, optimizer, args, kwargs):
        self.sharding.changed = True

    def _step_group(self, group, optimizers):
        """step_in_backward: the group's gradient shard is complete; step
        its parameters now and drop their gradients (the store is brought
        up to date before the next pass)."""
        if not self.gradients.sync:
            return
        for zp in group.trained:
            if zp.shard.grad is not None:
                optimizers[zp.id].step()
                zp.shard.grad = None
        group.grad_flat = None
        group.grad_views = None
        self.sharding.changed = True

    # --- clipping -------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """See Zero3Engine.clip_grad_norm_."""
        if self.passes.backward_active:
            raise IncompatibleError("zero3: clip_grad_norm_() called during backward")
        if self.step_in_backward:
            raise IncompatibleError("zero3: clip_grad_norm_() with step_in_backward: the "
                                    "parameters were stepped during backward already")
        max_norm, norm_type = float(max_norm), float(norm_type)
        if self.scaling is not None:
            self.scaling.unscale()
        if self.offload is not None:
            return self.offload.clip(_gradients.gradient_tensors(self.groups),
                                     _gradients.gradient_tensors(self.device_groups),
                                     self.comm, max_norm, norm_type)
        return _gradients.clip(_gradients.gradient_tensors(self.groups), self.comm,
                                 self.device, max_norm, norm_type)

    def _clip_and_scale(self):
        """Before a step: clips to gradient_clipping, and with fp16 loss
        scaling unscales and updates the scale; True when the step must be
        skipped (the gradient overflowed on some rank)."""
        if self.gradient_clipping:
            self.grad_norm = self.clip_grad_norm_(self.gradient_clipping)
        elif self.measure_grad_norm and self.offload is None and self.scaling is None:
            # The norm alone: no pass over the gradients to scale them by 1.
            self.grad_norm = _gradients.global_norm(
                _gradients.gradient_tensors(self.groups), self.comm, self.device, 2.0)
        elif self.measure_grad_norm:
            self.grad_norm = self.clip_grad_norm_(float("inf"))
        return self.scaling is not None and self.scaling.update()

    # --- the step -------------------------------------------------------------------

    def step(self):
        """See Zero3Engine.step."""
        if self.optimizer is None:
            raise IncompatibleError(
                "zero3: step() needs an optimizer; pass optimizer_factory to initialize()")
        if self.passes.backward_active:
            raise IncompatibleError("zero3: step() called during backward")
        if self.offload is not None:
            self._offloaded_step()
            return
        if self.step_in_backward:
            self.global_step += 1  # every parameter was stepped during backward
            self.step_applied = True
            self.zero_grad()
            return
        skip = self._clip_and_scale() if self.prepares_gradients else False
        gradient_bytes = self._gradient_bytes()
        if not skip:
            self.optimizer.step()
        self.step_applied = not skip
        self.global_step += 1
        self.zero_grad()
        self._account(gradient_bytes)

    def _offloaded_step(self):
        """step() with groups on the host: the device's part by the
        factory's optimizer, the host's group by group."""
        gradient_bytes = self._gradient_bytes()
        try:
            skip = False
            self.offload.settle()  # before the device's part: a pipelined step may fail
            if not self.step_in_backward:
                skip = self._clip_and_scale() if self.prepares_gradients else False
                if not skip:
                    self.optimizer.step_device()
            self.offload.step(skip)
            self.step_applied = not skip
        except BaseException:
            self.offload.abandon()
            raise
        finally:
            self.sharding.changed = True
        self.global_step += 1
        self.zero_grad()
        self._account(gradient_bytes)

    def zero_grad(self):
        for zp in self.params:
            zp.shard.grad = None
        for group in self.groups:
            group.grad_flat = None
            group.grad_views = None
        if self.scaling is not None:
            self.scaling.unscaled = False

    # --- device memory --------------------------------------------------------------

    def _gradient_bytes(self):
        total = 0
        for g in self.groups:  # a loop, not a generator: no Python call a group
            if g.grad_flat is not None:
                total += g.grad_flat.numel() * g.grad_flat.element_size()
        return total

    def _account(self, gradient_bytes):
        state = self.optimizer.state if self.optimizer is not None else {}
        size = (id(state), len(state))
        if size != self._resident_key:  # state added (first steps, a load): count again
            self._resident_key = size
            self._resident = resident_bytes(self.groups, self.optimizer)
        # The engine's accounting: what resident_bytes() counted, the gradient
        # shards at the step, the gathered copies.
        self.device_high_water = self._resident + gradient_bytes + gathered_bytes(self.session)
        self.placement.check(self.device_high_water, self.global_step)
