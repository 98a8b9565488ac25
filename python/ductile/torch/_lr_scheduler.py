"""VariableBatchLRScheduler: the learning rate of every optimizer step scaled
by that step's real batch size, from the sampler's packing."""

import math

from .. import batching as _batching
from .._errors import InvalidArgumentError


class VariableBatchLRScheduler:
    """Scales the learning rate of every optimizer step by that step's real
    batch size (samples over all ranks, from the sampler's packing) with an lr
    rule plugin ("linear", "sqrt", "none" or any other), as DeepSpeed's
    VariableBatchSizeLR does.

    Without ``lr_scheduler``: each param group follows the C++
    variable-batch schedule (``ductile.batching.LrSchedule``) whose base rate
    is the group's initial lr (or ``base_lr``), with the base ``schedule``
    ("constant", "warmup_linear", "warmup_cosine"), ``warmup_steps``,
    ``total_steps``, ``min_lr``. With ``lr_scheduler`` (any
    torch.optim.lr_scheduler on the same optimizer): its rates are the base,
    scaled by the rule each step.

    Stepping follows DeepSpeed: construction sets the rate of step 0; call
    :meth:`step` after every ``optimizer.step()``. Steps run through the
    sampler's epochs in order (epoch 0's steps, then epoch 1's, ...). On
    resume, load the sampler's state before this scheduler's: after an
    elastic resume the step sizes are those of the sampler's new packing.
    """

    def __init__(self, optimizer, sampler, *, lr_rule="linear", base_batch_size,
                 lr_params=None, base_lr=None, schedule="constant", warmup_steps=0,
                 total_steps=0, min_lr=0.0, lr_scheduler=None, runtime=None, plugin_path=None):
        self.optimizer = optimizer
        self.sampler = sampler
        self.base_batch_size = float(base_batch_size)
        self.lr_scheduler = lr_scheduler
        self.rule = _batching.LrRule(str(lr_rule), lr_params, runtime, plugin_path)
        self._schedule_args = dict(schedule=schedule, min_lr=float(min_lr),
                                   warmup_steps=int(warmup_steps), total_steps=int(total_steps))
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs = [float(base_lr) if base_lr is not None else float(g["initial_lr"])
                         for g in optimizer.param_groups]
        self.last_step = 0
        self._layout_version = None  # the sampler's packing the sizes below come from
        self._unscaled = None
        if lr_scheduler is not None:
            self._unscaled = [g["lr"] for g in optimizer.param_groups]
        self._last_lr = [g["lr"] for g in optimizer.param_groups]
        if self.sampler.first_step(self.sampler.resume_epoch) == 0:
            self._apply()
        # else: a sampler that resumed past step 0; load_state_dict sets the rates.

    def _cover(self, step):
        """Makes sure the batch size of `step` is known. Sizes start at the
        first step the sampler knows (0, or where it resumed elastically) and
        follow its epochs; a new packing (sampler.load_state_dict) restarts
        them."""
        if self._layout_version != self.sampler.layout_version:
            self._layout_version = self.sampler.layout_version
            self._epochs = self.sampler.resume_epoch
            self._first = self.sampler.first_step(self._epochs)
            self._sizes = []
            self._schedules = None
        if step < self._first:
            raise InvalidArgumentError(
                f"step {step} is before step {self._first}, where the sampler resumed (epoch "
                f"{self.sampler.resume_epoch}): its batch size is not known; load this "
                "scheduler's state_dict, saved with the sampler's")
        grown = False
        while self._first + len(self._sizes) <= step:
            sizes = self.sampler.batch_sizes(self._epochs)
            if len(sizes) == 0:
                raise InvalidArgumentError(f"epoch {self._epochs} of the sampler has no steps")
            self._sizes.extend(int(s) for s in sizes)
            self._epochs += 1
            grown = True
        if grown or self._schedules is None:
            if self.lr_scheduler is None:
                # The C++ schedule indexes sizes by global step; the steps
                # before the resume never come back, so their sizes are 0.
                sizes = [0] * self._first + self._sizes
                self._schedules = [
                    _batching.LrSchedule(self.rule, self.base_batch_size, sizes,
                                         base_lr=lr, **self._schedule_args)
                    for lr in self.base_lrs]
            else:
                self._schedules = []

    def batch_size(self, step=None):
        """Samples of a step (default: the current one)."""
        step = self.last_step if step is None else int(step)
        self._cover(step)
        return self._sizes[step - self._first]

    def lr_at(self, step):
        """The rates of every param group at ``step`` (no lr_scheduler only)."""
        self._cover(int(step))
        return [s.lr_at(int(step)) for s in self._schedules]

    def _apply(self):
        step = self.last_step
        self._cover(step)
        if self.lr_scheduler is None:
            rates = [s.lr_at(step) for s in self._schedules]
        else:
            batch = float(self.batch_size(step))
            rates = [self.rule.scale(lr, batch, self.base_batch_size) for lr in self._unscaled]
        for group, lr in zip(self.optimizer.param_groups, rates):
            group["lr"] = lr
        self._last_lr = rates

    def step(self):
        """Moves to the next optimizer step and sets its learning rates."""
        if self.lr_scheduler is not None:
            # The wrapped scheduler steps from its own (unscaled) rates, so
            # chainable schedulers see what they set, never our scaling.
            for group, lr in zip(self.optimizer.param_groups, self._unscaled):
                group["lr"] = lr
            self.lr_scheduler.step()
            self._unscaled = [g["lr"] for g in self.optimizer.param_groups]
        self.last_step += 1
        self._apply()

    def get_last_lr(self):
        return list(self._last_lr)

    def state_dict(self):
        return {"format": "ductile.VariableBatchLRScheduler", "version": 1,
                "last_step": self.last_step, "base_lrs": list(self.base_lrs),
                "base_batch_size": self.base_batch_size, "rule": self.rule.name,
                "schedule": dict(self._schedule_args),
                "unscaled": None if self._unscaled is None else list(self._unscaled),
                "lr_scheduler": None if self.lr_scheduler is None
                else self.lr_scheduler.state_dict()}

    def load_state_dict(self, state):
        """Restores a state_dict: the following steps get exactly the rates
        they would have had. Raises InvalidArgumentError for a state of
        another configuration."""
        if not isinstance(state, dict) or state.get("format") != "ductile.VariableBatchLRScheduler":
            raise InvalidArgumentError(
                "load_state_dict: not a VariableBatchLRScheduler state_dict")
        if state.get("version") != 1:
            raise InvalidArgumentError(
                f"load_state_dict: state version {state.get('version')!r} is not supported; "
                "this ductile reads version 1")
        mine = self.state_dict()
        missing = [key for key in mine if key not in state]
        if missing:
            raise InvalidArgumentError(
                f"load_state_dict: the state lacks {', '.join(missing)}: it is damaged")
        last_step = state["last_step"]
        if isinstance(last_step, bool) or not isinstance(last_step, int) or last_step < 0:
            raise InvalidArgumentError(
                f"load_state_dict: last_step = {last_step!r} must be an integer >= 0: the "
                "state is damaged")
        unscaled = state["unscaled"]
        if self.lr_scheduler is not None and (
                not isinstance(unscaled, list) or len(unscaled) != len(self.base_lrs)
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(v) for v in unscaled)):
            raise InvalidArgumentError(
                f"load_state_dict: unscaled = {unscaled!r} must be {len(self.base_lrs)} finite "
                "rates, one per param group: the state is damaged")
        for key in ("base_batch_size", "rule", "schedule", "base_lrs"):
            if state[key] != mine[key]:
                raise InvalidArgumentError(
                    f"load_state_dict: the state has {key} = {state[key]!r}, this scheduler "
                    f"{mine[key]!r}: it was saved with another configuration")
        if (state["lr_scheduler"] is None) != (self.lr_scheduler is None):
            raise InvalidArgumentError("load_state_dict: the state was saved "
                                       + ("with" if state["lr_scheduler"] else "without")
                                       + " a wrapped lr_scheduler; this scheduler differs")
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            self._unscaled = list(state["unscaled"])
        self.last_step = int(state["last_step"])
        self._apply()
