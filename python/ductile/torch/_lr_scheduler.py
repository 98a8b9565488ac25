"""VariableBatchLRScheduler: the learning rate of every optimizer step scaled
by that step's real batch size, from the sampler's packing."""

import math
from collections.abc import Mapping
from typing import Any

import torch

from .. import batching as _batching
from .._config import PluginPath
from .._errors import InvalidArgumentError
from ._sampler import DynamicBatchSampler, check_state_keys


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

    # runtime: a ductile.Runtime (the extension has no stubs).
    def __init__(self, optimizer: torch.optim.Optimizer, sampler: DynamicBatchSampler, *,
                 lr_rule: str = "linear", base_batch_size: float,
                 lr_params: Mapping[str, Any] | None = None, base_lr: float | None = None,
                 schedule: str = "constant", warmup_steps: int = 0, total_steps: int = 0,
                 min_lr: float = 0.0,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 runtime: Any = None, plugin_path: PluginPath = None) -> None:
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
        if lr_scheduler is None:  # the schedule's settings, checked now
            for lr in self.base_lrs:
                _batching.LrSchedule(self.rule, self.base_batch_size, [1], base_lr=lr,
                                     **self._schedule_args)
        self.last_step = 0
        self._unscaled = None
        if lr_scheduler is not None:
            self._unscaled = [g["lr"] for g in optimizer.param_groups]
        self._last_lr = [g["lr"] for g in optimizer.param_groups]
        if self.sampler.first_step(self.sampler.resume_epoch) == 0:
            self._apply(self.batch_size(0))
        # else: a sampler that resumed past step 0; load_state_dict sets the rates.

    def batch_size(self, step: int | None = None) -> int:
        """Samples of a step (default: the current one). The step's epoch is
        found by packing the sampler's epochs up to it, at most
        MAX_EPOCHS_AHEAD of them past the first one it knows (see
        DynamicBatchSampler.epoch_of); only their step counts are kept."""
        step = self.last_step if step is None else int(step)
        epoch = self.sampler.epoch_of(step)
        return int(self.sampler.batch_sizes(epoch)[step - self.sampler.first_step(epoch)])

    def _rates(self, step, batch):
        """The rate of every param group at `step`, whose batch holds `batch`
        samples: the C++ schedule's (a schedule of one step size gives every
        step that size), or the wrapped scheduler's rates scaled by the rule."""
        if self.lr_scheduler is None:
            return [_batching.LrSchedule(self.rule, self.base_batch_size, [batch], base_lr=lr,
                                         **self._schedule_args).lr_at(step)
                    for lr in self.base_lrs]
        unscaled = self._unscaled
        assert unscaled is not None  # kept whenever there is an lr_scheduler
        return [self.rule.scale(lr, float(batch), self.base_batch_size) for lr in unscaled]

    def lr_at(self, step: int) -> list[float]:
        """The rates of every param group at ``step`` (no lr_scheduler only)."""
        if self.lr_scheduler is not None:
            return []
        return self._rates(int(step), self.batch_size(int(step)))

    def _apply(self, batch):
        """Sets the rates of the current step, whose batch holds `batch` samples."""
        rates = self._rates(self.last_step, batch)
        for group, lr in zip(self.optimizer.param_groups, rates):
            group["lr"] = lr
        self._last_lr = rates

    def step(self) -> None:
        """Moves to the next optimizer step and sets its learning rates."""
        if self.lr_scheduler is not None:
            # The wrapped scheduler steps from its own (unscaled) rates, so
            # chainable schedulers see what they set, never our scaling.
            unscaled = self._unscaled
            assert unscaled is not None  # kept whenever there is an lr_scheduler
            for group, lr in zip(self.optimizer.param_groups, unscaled):
                group["lr"] = lr
            self.lr_scheduler.step()
            self._unscaled = [g["lr"] for g in self.optimizer.param_groups]
        self.last_step += 1
        self._apply(self.batch_size(self.last_step))

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"format": "ductile.VariableBatchLRScheduler", "version": 1,
                "last_step": self.last_step, "base_lrs": list(self.base_lrs),
                "base_batch_size": self.base_batch_size, "rule": self.rule.name,
                "schedule": dict(self._schedule_args),
                "unscaled": None if self._unscaled is None else list(self._unscaled),
                "lr_scheduler": None if self.lr_scheduler is None
                else self.lr_scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any], *, replan: bool = False) -> None:
        """Restores a state_dict: the following steps get exactly the rates
        they would have had. Raises InvalidArgumentError for a state of
        another configuration.

        ``replan=True`` (a run whose steps were planned again on resume: at
        another world size, or trained longer) also takes a state whose
        ``warmup_steps`` and ``total_steps`` differ from this scheduler's:
        the steps go on from the state's last step, each at the rate this
        scheduler's schedule gives that global step (so a decay bends at the
        resume to end at the new last step). Every other setting must match."""
        if not isinstance(state, dict) or state.get("format") != "ductile.VariableBatchLRScheduler":
            raise InvalidArgumentError(
                "load_state_dict: not a VariableBatchLRScheduler state_dict")
        if state.get("version") != 1:
            raise InvalidArgumentError(
                f"load_state_dict: state version {state.get('version')!r} is not supported; "
                "this ductile reads version 1")
        mine = self.state_dict()
        check_state_keys(state, list(mine), 1, "VariableBatchLRScheduler.state_dict")
        last_step = state["last_step"]
        if isinstance(last_step, bool) or not isinstance(last_step, int) or last_step < 0:
            raise InvalidArgumentError(
                f"load_state_dict: last_step = {last_step!r} must be an integer >= 0: the "
                "state is damaged")
        # Before anything changes: the step's epoch, within what the
        # sampler can reach (InvalidArgumentError naming the step).
        self.sampler.epoch_of(last_step)
        unscaled = state["unscaled"]
        if self.lr_scheduler is not None and (
                not isinstance(unscaled, list) or len(unscaled) != len(self.base_lrs)
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(v) for v in unscaled)):
            raise InvalidArgumentError(
                f"load_state_dict: unscaled = {unscaled!r} must be {len(self.base_lrs)} finite "
                "rates, one per param group: the state is damaged")
        if not isinstance(state["schedule"], dict):
            raise InvalidArgumentError(
                f"load_state_dict: schedule = {state['schedule']!r} must be a dict of the "
                "schedule's settings: the state is damaged")
        replanned = ("warmup_steps", "total_steps") if replan else ()
        compared = {"schedule": {k: v for k, v in state["schedule"].items() if k not in replanned}}
        mine["schedule"] = {k: v for k, v in mine["schedule"].items() if k not in replanned}
        for key in ("base_batch_size", "rule", "schedule", "base_lrs"):
            if compared.get(key, state[key]) != mine[key]:
                steps_only = key == "schedule" and not replan and all(
                    state[key].get(k) == v for k, v in mine[key].items()
                    if k not in ("warmup_steps", "total_steps"))
                raise InvalidArgumentError(
                    f"load_state_dict: the state has {key} = {state[key]!r}, this scheduler "
                    f"{mine[key]!r}: " + (
                        "only the planned steps differ; load_state_dict(state, replan=True) "
                        "goes on with this scheduler's steps" if steps_only else
                        "it was saved with another configuration"))
        if (state["lr_scheduler"] is None) != (self.lr_scheduler is None):
            raise InvalidArgumentError("load_state_dict: the state was saved "
                                       + ("with" if state["lr_scheduler"] else "without")
                                       + " a wrapped lr_scheduler; this scheduler differs")
        batch = self.batch_size(last_step)
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            self._unscaled = list(state["unscaled"])
        self.last_step = last_step
        self._apply(batch)
