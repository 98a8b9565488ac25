"""Clipping and the optimizer step of the zero3 engine: the optimizer made
over the shards (one optimizer, one a parameter with step_in_backward, or
the device's and the host's parts with optimizer offload), clipping by the
global norm, the step (skipped on an fp16 overflow), clearing the gradient
shards, and the device memory the step accounts for under
max_device_memory.

The step never waits on the host for the device, except for fp16's
overflow decision (_grad_shards.py). After it the optimizer's shards have
changed: the next pass gathers the new values (``Sharding.changed``).
"""

from typing import Any

from ..._errors import IncompatibleError, InvalidArgumentError
from . import _budget, _grad_shards
from ._offload import OffloadedOptimizer
from ._per_parameter import PerParameterOptimizers


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
            if self.offload is not None:
                self._make_offloaded_optimizer(optimizer_factory)
            else:
                trained = [zp for zp in self.params if zp.requires_grad]
                self.optimizer = PerParameterOptimizers(optimizer_factory,
                                                        [zp.shard for zp in trained])
                by_id = dict(zip((zp.id for zp in trained), self.optimizer.optimizers))
                self.gradients.on_group_ready = lambda g: self._step_group(g, by_id)
        elif optimizer_factory is not None:
            if self.offload is not None:
                self._make_offloaded_optimizer(optimizer_factory)
            else:
                self.optimizer = optimizer_factory([zp.shard for zp in self.params])
            if self.optimizer is not None:
                self.optimizer.register_step_post_hook(self._optimizer_stepped)

    def set_gradient_clipping(self, value):
        self.gradient_clipping = value
        # Whether a step first clips, measures or unscales the gradient shards.
        self.prepares_gradients = (bool(value) or self.scaling is not None
                                   or self._measure_grad_norm)

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
            return self.offload.clip(_grad_shards.gradient_tensors(self.groups),
                                     _grad_shards.gradient_tensors(self.device_groups),
                                     self.comm, max_norm, norm_type)
        return _grad_shards.clip(_grad_shards.gradient_tensors(self.groups), self.comm,
                                 self.device, max_norm, norm_type)

    def _clip_and_scale(self):
        """Before a step: clips to gradient_clipping, and with fp16 loss
        scaling unscales and updates the scale; True when the step must be
        skipped (the gradient overflowed on some rank)."""
        if self.gradient_clipping:
            self.grad_norm = self.clip_grad_norm_(self.gradient_clipping)
        elif self.measure_grad_norm and self.offload is None and self.scaling is None:
            # The norm alone: no pass over the gradients to scale them by 1.
            self.grad_norm = _grad_shards.global_norm(
                _grad_shards.gradient_tensors(self.groups), self.comm, self.device, 2.0)
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
        factory's optimizer, the host's group by group (see _offload.py)."""
        gradient_bytes = self._gradient_bytes()
        try:
            skip = False
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
            self._resident = _budget.resident_bytes(self.groups, self.optimizer)
        self.device_high_water = _budget.account(self._resident, self.session, gradient_bytes)
        self.placement.check(self.device_high_water, self.global_step)
