"""Mixed precision of the zero3 engine: the dtypes parameters are gathered,
gradients reduced and the optimizer's shards kept in, and fp16 loss scalers.

``MixedPrecision(param_dtype, reduce_dtype, master_dtype)``:

- ``param_dtype``: the dtype parameters are gathered and computed in (the
  coordinator's shards are kept in it, so a gather moves 2 bytes an element
  in bf16/fp16); None: the model's own dtype;
- ``reduce_dtype``: the dtype gradients are reduce-scattered and summed in;
  fp32 by default;
- ``master_dtype``: the dtype of the shards the optimizer steps on (and of
  its state and of the gradient shards); fp32 by default. When it differs
  from ``param_dtype`` the optimizer's shards are a master copy, cast into
  the coordinator's shards after every optimizer step.

fp16 needs loss scaling: ``DynamicLossScaler`` (DeepSpeed's and
torch.amp.GradScaler's rule): the loss is multiplied by the scale before
backward; before the optimizer step the gradient shards are unscaled and
checked for inf/NaN on every rank (one all-reduce); a step with an overflow
is skipped and the scale halved (after ``hysteresis`` overflows in a row),
and after ``growth_interval`` steps without one it doubles.

``from_training(training)`` builds them from a DeepSpeed config's ``bf16``
/ ``fp16`` sections as the pipeline read them (``enabled``, ``loss_scale``
(0: dynamic), ``initial_scale_power``, ``loss_scale_window``,
``hysteresis``, ``min_loss_scale``).
"""

import math

import torch

from ..._errors import InvalidArgumentError

_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def as_dtype(value, what):
    if value is None or isinstance(value, torch.dtype):
        if value not in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise InvalidArgumentError(f"zero3: {what} = {value} is not a floating dtype; valid: "
                                       "torch.float32, torch.bfloat16, torch.float16")
        return value
    dtype = _NAMES.get(str(value).lower())
    if dtype is None:
        raise InvalidArgumentError(f"zero3: {what} = {value!r} is not valid; valid: 'fp32', "
                                   "'bf16', 'fp16' or a torch dtype")
    return dtype


class MixedPrecision:
    """See the module's docstring. ``loss_scale``: None (fp32/bf16: none;
    fp16: a DynamicLossScaler with its defaults), a number (static), or a
    DynamicLossScaler."""

    def __init__(self, param_dtype=None, reduce_dtype=torch.float32,
                 master_dtype=torch.float32, loss_scale=None):
        self.param_dtype = as_dtype(param_dtype, "param_dtype")
        self.reduce_dtype = as_dtype(reduce_dtype, "reduce_dtype")
        self.master_dtype = as_dtype(master_dtype, "master_dtype")
        if loss_scale is None and self.param_dtype == torch.float16:
            loss_scale = DynamicLossScaler()
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            if not math.isfinite(loss_scale) or loss_scale <= 0:
                raise InvalidArgumentError(
                    f"zero3: loss_scale = {loss_scale} must be a positive finite number")
            loss_scale = StaticLossScaler(float(loss_scale))
        self.loss_scaler = loss_scale

    def __repr__(self):
        return (f"MixedPrecision(param_dtype={self.param_dtype}, reduce_dtype="
                f"{self.reduce_dtype}, master_dtype={self.master_dtype}, "
                f"loss_scaler={self.loss_scaler!r})")


class StaticLossScaler:
    dynamic = False

    def __init__(self, scale):
        self.scale = scale
        self.skipped_steps = 0

    def update(self, overflow):
        if overflow:
            self.skipped_steps += 1

    def state_dict(self):
        return {"scale": self.scale, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self):
        return f"StaticLossScaler({self.scale})"


class DynamicLossScaler:
    """DeepSpeed's defaults: 2^16, window 1000, hysteresis 2, minimum 1."""

    dynamic = True

    def __init__(self, initial_scale=2.0 ** 16, growth_interval=1000, hysteresis=2,
                 min_scale=1.0, factor=2.0):
        for name, v in (("initial_scale", initial_scale), ("min_scale", min_scale),
                        ("factor", factor)):
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise InvalidArgumentError(f"zero3: loss scaler {name} = {v!r} must be positive")
        if int(growth_interval) < 1 or int(hysteresis) < 1:
            raise InvalidArgumentError("zero3: loss scaler growth_interval and hysteresis must "
                                       "be at least 1")
        self.scale = float(initial_scale)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.factor = float(factor)
        self._good_steps = 0
        self._hysteresis_left = self.hysteresis
        self.skipped_steps = 0

    def update(self, overflow):
        if overflow:
            self.skipped_steps += 1
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / self.factor, self.min_scale)
                self._hysteresis_left = self.hysteresis
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= self.factor
            self._hysteresis_left = self.hysteresis

    def state_dict(self):
        return {"scale": self.scale, "good_steps": self._good_steps,
                "hysteresis_left": self._hysteresis_left, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self):
        return f"DynamicLossScaler(scale={self.scale})"


def from_training(training):
    """A MixedPrecision from a DeepSpeed config's precision settings, as the
    pipeline read and checked them (``_ductile.Runtime.from_deepspeed``'s
    training dict), or None (fp32)."""
    if training["precision"] == "bf16":
        return MixedPrecision(torch.bfloat16)
    if training["precision"] != "fp16":
        return None
    if training["loss_scale"]:
        return MixedPrecision(torch.float16, loss_scale=training["loss_scale"])
    scaler = DynamicLossScaler(initial_scale=2.0 ** training["initial_scale_power"],
                               growth_interval=training["loss_scale_window"],
                               hysteresis=training["hysteresis"],
                               min_scale=training["min_loss_scale"])
    return MixedPrecision(torch.float16, loss_scale=scaler)
