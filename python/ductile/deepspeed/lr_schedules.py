"""DeepSpeed's learning-rate schedulers (``deepspeed.runtime.lr_schedules``):
``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and
``LRRangeTest``, with DeepSpeed's constructor arguments, stepping and
state_dict, their rates computed by ductile's C++ schedule
(``_ductile.lr_schedules``, pipeline/deepspeed_schedules.hpp).

Each class sets ``lr`` of every param group of the optimizer (and
OneCycle's ``betas`` when it cycles momentum) and touches nothing else, so
that it drives a torch optimizer over ZeRO-3 shards as well as any other.
Arguments not given keep DeepSpeed's defaults, held by the C++ spec; a bad
argument is an InvalidArgumentError naming it, its value and what is valid.
A state_dict is DeepSpeed's (``{"last_batch_iteration": n}``): one saved by
DeepSpeed loads here, and the reverse.
"""

import logging
from collections.abc import Mapping
from typing import Any

from .. import _ductile
from .._errors import IncompatibleError, InvalidArgumentError

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
           "scheduler_from_config", "VALID_LR_SCHEDULES"]

_log = logging.getLogger("ductile.deepspeed")
_schedules = _ductile.lr_schedules

VALID_LR_SCHEDULES = list(_schedules.TYPES)


class _Default:
    """An argument not given: the C++ spec keeps DeepSpeed's default."""

    def __repr__(self) -> str:
        return "<DeepSpeed's default>"


DEFAULT = _Default()


def _param_group_owner(optimizer):
    """The object whose ``param_groups`` the scheduler sets: the optimizer,
    or the torch optimizer a wrapper holds as ``.optimizer`` (as DeepSpeed's
    get_torch_optimizer finds it)."""
    if hasattr(optimizer, "param_groups"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups"):
        return inner
    raise InvalidArgumentError(
        f"optimizer = {type(optimizer).__name__} object has no param_groups; valid: a "
        "torch.optim.Optimizer, or a wrapper whose .optimizer is one")


def _has_betas(optimizer):
    defaults = getattr(optimizer, "defaults", None)
    if isinstance(defaults, dict):
        return "betas" in defaults
    return all("betas" in group for group in optimizer.param_groups)


def _set_lrs(param_groups, lrs):
    """Sets each group's lr (a tensor lr is filled in place, as DeepSpeed's
    update_lr does) and returns the groups' lrs."""
    for group, lr in zip(param_groups, lrs):
        current = group["lr"]
        if not isinstance(current, (int, float)) and callable(getattr(current, "fill_", None)):
            current.fill_(lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _last_batch_iteration(value, where):
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise InvalidArgumentError(
            f"{where} = {value!r}; valid: an integer >= -1 (-1: from the beginning)")
    return value


class _DeepSpeedScheduler:
    """What the five schedulers share: the C++ schedule made from the
    arguments given, DeepSpeed's stepping and state."""

    _type = ""

    # optimizer: a torch optimizer, or a wrapper whose .optimizer is one.
    def __init__(self, optimizer: Any, arguments: Mapping[str, Any]) -> None:
        self.optimizer = _param_group_owner(optimizer)
        groups = self.optimizer.param_groups
        given = {key: value for key, value in arguments.items() if value is not DEFAULT}
        self._schedule = _schedules.DeepSpeedSchedule(
            self._type, given, [float(group["lr"]) for group in groups],
            _has_betas(self.optimizer))
        self.last_batch_iteration = self._schedule.last_batch_iteration
        if self.last_batch_iteration == -1:
            last = _set_lrs(groups, self._schedule.initial_lrs())
            if self._sets_last_lr_when_made:
                self._last_lr = last

    # DeepSpeed's OneCycle sets the rates when made but not _last_lr.
    _sets_last_lr_when_made = True

    @property
    def params(self) -> dict[str, Any]:
        """Every parameter with its value, DeepSpeed's defaults filled in."""
        return self._schedule.params

    def get_lr(self) -> list[float]:
        """The rates at the current last_batch_iteration."""
        return self._schedule.lrs(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The rates last set on the param groups."""
        if getattr(self, "_last_lr", None) is None:
            raise IncompatibleError(
                f"{type(self).__name__}.get_last_lr: no rate has been set yet; call step() "
                "first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Moves to the next batch index (or the one given) and sets its
        rates."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        lrs = self._schedule.lrs(last_batch_iteration)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(self.optimizer.param_groups, lrs)

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restores the batch index (the rates are set by the next step(),
        as DeepSpeed's do)."""
        if not isinstance(sd, dict) or "last_batch_iteration" not in sd:
            raise InvalidArgumentError(
                f"load_state_dict: sd = {type(sd).__name__} without last_batch_iteration; "
                "valid: a dict from state_dict()")
        self.last_batch_iteration = _last_batch_iteration(
            sd["last_batch_iteration"], "load_state_dict: last_batch_iteration")


class WarmupLR(_DeepSpeedScheduler):
    """Raises each group's rate from warmup_min_lr to warmup_max_lr (default:
    the group's lr) over warmup_num_steps steps ("log" or "linear"), then
    keeps it."""

    _type = "WarmupLR"

    def __init__(self, optimizer: Any, warmup_min_lr: float | _Default = DEFAULT,
                 warmup_max_lr: float | _Default = DEFAULT,
                 warmup_num_steps: int | _Default = DEFAULT, warmup_type: str | _Default = DEFAULT,
                 last_batch_iteration: int | _Default = DEFAULT) -> None:
        super().__init__(optimizer, dict(
            warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
            warmup_num_steps=warmup_num_steps, warmup_type=warmup_type,
            last_batch_iteration=last_batch_iteration))


class WarmupDecayLR(_DeepSpeedScheduler):
    """WarmupLR's warm-up (warmup_max_lr default 0.001; None: each group's
    lr), then a linear decay to warmup_min_lr at total_num_steps."""

    _type = "WarmupDecayLR"

    def __init__(self, optimizer: Any, total_num_steps: int,
                 warmup_min_lr: float | _Default = DEFAULT,
                 warmup_max_lr: float | _Default | None = DEFAULT,
                 warmup_num_steps: int | _Default = DEFAULT, warmup_type: str | _Default = DEFAULT,
                 last_batch_iteration: int | _Default = DEFAULT) -> None:
        super().__init__(optimizer, dict(
            total_num_steps=total_num_steps, warmup_min_lr=warmup_min_lr,
            warmup_max_lr=warmup_max_lr, warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type, last_batch_iteration=last_batch_iteration))


class WarmupCosineLR(_DeepSpeedScheduler):
    """Each group's lr when made times a ratio: from warmup_min_ratio up to 1
    over warmup_num_steps, then a cosine decay to cos_min_ratio at
    total_num_steps."""

    _type = "WarmupCosineLR"

    def __init__(self, optimizer: Any, total_num_steps: int,
                 warmup_min_ratio: float | _Default = DEFAULT,
                 warmup_num_steps: int | _Default = DEFAULT,
                 cos_min_ratio: float | _Default = DEFAULT, warmup_type: str | _Default = DEFAULT,
                 last_batch_iteration: int | _Default = DEFAULT) -> None:
        super().__init__(optimizer, dict(
            total_num_steps=total_num_steps, warmup_min_ratio=warmup_min_ratio,
            warmup_num_steps=warmup_num_steps, cos_min_ratio=cos_min_ratio,
            warmup_type=warmup_type, last_batch_iteration=last_batch_iteration))


class OneCycle(_DeepSpeedScheduler):
    """One cycle of the rate cycle_min_lr -> cycle_max_lr -> cycle_min_lr
    (optionally in stairs), then a decay; with cycle_momentum, the first beta
    of an optimizer with betas cycles inversely (the second is set to 0.99,
    as DeepSpeed does)."""

    _type = "OneCycle"
    _sets_last_lr_when_made = False

    def __init__(self, optimizer: Any, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float | _Default = DEFAULT,
                 cycle_first_step_size: int | _Default = DEFAULT,
                 cycle_second_step_size: int | _Default | None = DEFAULT,
                 cycle_first_stair_count: int | _Default = DEFAULT,
                 cycle_second_stair_count: int | _Default | None = DEFAULT,
                 decay_step_size: int | _Default = DEFAULT,
                 cycle_momentum: bool | _Default = DEFAULT,
                 cycle_min_mom: float | _Default = DEFAULT,
                 cycle_max_mom: float | _Default = DEFAULT,
                 decay_mom_rate: float | _Default = DEFAULT,
                 last_batch_iteration: int | _Default = DEFAULT) -> None:
        super().__init__(optimizer, dict(
            cycle_min_lr=cycle_min_lr, cycle_max_lr=cycle_max_lr, decay_lr_rate=decay_lr_rate,
            cycle_first_step_size=cycle_first_step_size,
            cycle_second_step_size=cycle_second_step_size,
            cycle_first_stair_count=cycle_first_stair_count,
            cycle_second_stair_count=cycle_second_stair_count, decay_step_size=decay_step_size,
            cycle_momentum=cycle_momentum, cycle_min_mom=cycle_min_mom,
            cycle_max_mom=cycle_max_mom, decay_mom_rate=decay_mom_rate,
            last_batch_iteration=last_batch_iteration))
        self.cycle_momentum = self._schedule.cycles_momentum
        if self.params["cycle_momentum"] and not self.cycle_momentum:
            _log.warning("cycle_momentum is disabled because optimizer %s has no betas",
                         type(self.optimizer).__name__)
        if self.cycle_momentum and self.last_batch_iteration == -1:
            self._set_betas(self._schedule.initial_betas())

    def _set_betas(self, first_betas):
        second = self._schedule.second_beta
        for group, beta in zip(self.optimizer.param_groups, first_betas):
            group["betas"] = (beta, second)

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The (beta1, beta2) of every group at the current index, or None
        without cycle_momentum."""
        if not self.cycle_momentum:
            return None
        second = self._schedule.second_beta
        return [(beta, second) for beta in self._schedule.betas(self.last_batch_iteration)]

    def step(self, batch_iteration: int | None = None) -> None:
        super().step(batch_iteration)
        if self.cycle_momentum:
            self._set_betas(self._schedule.betas(self.last_batch_iteration))


class LRRangeTest(_DeepSpeedScheduler):
    """Raises each group's rate from lr_range_test_min_lr by
    lr_range_test_step_rate every lr_range_test_step_size steps
    (continuously, or in stairs)."""

    _type = "LRRangeTest"

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | _Default = DEFAULT,
                 lr_range_test_step_size: int | _Default = DEFAULT,
                 lr_range_test_step_rate: float | _Default = DEFAULT,
                 lr_range_test_staircase: bool | _Default = DEFAULT,
                 last_batch_iteration: int | _Default = DEFAULT) -> None:
        super().__init__(optimizer, dict(
            lr_range_test_min_lr=lr_range_test_min_lr,
            lr_range_test_step_size=lr_range_test_step_size,
            lr_range_test_step_rate=lr_range_test_step_rate,
            lr_range_test_staircase=lr_range_test_staircase,
            last_batch_iteration=last_batch_iteration))

    def step(self, batch_iteration: int | None = None) -> None:
        super().step(batch_iteration)


_CLASSES = {cls._type: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
                                       LRRangeTest)}


def scheduler_from_config(scheduler: dict[str, Any] | None,
                          optimizer: Any) -> _DeepSpeedScheduler | None:
    """The scheduler a DeepSpeed config's block describes, on ``optimizer``:
    ``scheduler`` is the "scheduler" entry of the training dict
    ``_ductile.Runtime.from_deepspeed(..., read_training=True)`` returns
    (``{"type", "params"}``, typed and checked), or None (no scheduler:
    returns None)."""
    if scheduler is None:
        return None
    if not isinstance(scheduler, dict) or scheduler.get("type") not in _CLASSES:
        raise InvalidArgumentError(
            f"scheduler = {scheduler!r}; valid: None or the training dict's scheduler entry, "
            f"{{'type': one of {', '.join(_CLASSES)}, 'params': {{...}}}}")
    return _CLASSES[scheduler["type"]](optimizer, **scheduler.get("params", {}))
