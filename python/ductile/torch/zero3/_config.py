"""zero3's configuration: a ductile TOML with [zero] and [accelerator]
sections, or a DeepSpeed JSON config (a dict is one, as for
``deepspeed.initialize(config=...)``).

A DeepSpeed config's ZeRO keys are mapped onto [zero] by the pipeline's one
mapping (``pipeline::deepspeed_sections``, also behind ``ductile config
check``): ``zero_optimization.stage3_*`` (the coordinator's limits),
``offload_param`` (device "nvme": nvme_path, buffer_count) and
``offload_optimizer`` (device, pin_memory, ratio: [zero] offload_optimizer,
offload_pin_memory, offload_ratio), with warnings for the keys accepted but
not acted on. The same pass reads, into a typed dict, what configures torch
objects here: the ``bf16`` / ``fp16`` sections (MixedPrecision,
_precision.py), ``gradient_clipping`` (engine.step() clips to it first) and
``optimizer`` (type Adam/AdamW and params, when no optimizer_factory is
given). A value "auto" (Hugging Face's placeholder) keeps ductile's default.
"""

import json
import warnings

import torch

from ... import _ductile
from ..._config import Config, load_config
from ..._errors import ConfigError
from . import _precision


class Settings:
    """What zero3 takes from its configuration."""

    def __init__(self, loaded, mixed_precision, gradient_clipping, offload=None,
                 optimizer=None, training=None):
        self.loaded = loaded
        # What a DeepSpeed config sets for the training framework, as the
        # mapping read it (pipeline::DeepSpeedTraining); None for a TOML.
        self.training = training
        self.mixed_precision = mixed_precision
        self.gradient_clipping = gradient_clipping
        self.offload = offload or OffloadSettings()
        self.optimizer = optimizer  # a factory for a DeepSpeed "optimizer" section, or None


class OffloadSettings:
    """Offload as asked: ``optimizer`` (every group's optimizer on the
    host), ``ratio`` (only that share of the optimizer bytes), ``pin``
    (pinned host buffers on cuda), ``param`` (every group's parameter shard
    in host memory, and its optimizer with it)."""

    def __init__(self, optimizer=False, ratio=None, pin=True, param=False):
        self.optimizer = optimizer
        self.ratio = ratio
        self.pin = pin
        self.param = param


def offload_argument(value, runtime):
    """OffloadSettings from initialize(offload_optimizer=...): None, False or
    "none" (off), True or "cpu" (on), or a dict of DeepSpeed's
    offload_optimizer keys, mapped and checked by the pipeline as the same
    object inside a DeepSpeed config (``pipeline::deepspeed_offload_optimizer``)."""
    where = "zero3.initialize"
    if value is None or value is False:
        return OffloadSettings()
    if value is True or isinstance(value, str):
        value = {"device": "cpu" if value is True else value}
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: offload_optimizer = {value!r}; valid: None, True, False, "
                          f"\"cpu\", \"none\" or a dict of DeepSpeed's offload_optimizer "
                          f"keys ({e})") from e
    keys, warns = runtime.offload_optimizer(text, where)
    for message in warns:
        warnings.warn(message, UserWarning, stacklevel=4)
    return _offload_of_keys(keys)


def _backend(world):
    if world is not None:
        return "cuda" if world.device.type == "cuda" else "cpu"
    return "cpu"


def _offload_of_keys(keys):
    """OffloadSettings of [zero]'s validated offload keys."""
    param = keys.get("offload_param") == "cpu"
    if keys["offload_optimizer"] != "cpu":
        return OffloadSettings(pin=keys["offload_pin_memory"], param=param)
    ratio = keys["offload_ratio"]
    return OffloadSettings(True, None if ratio == 1.0 else ratio, keys["offload_pin_memory"],
                           param)


def _offload_of(runtime):
    """OffloadSettings of a validated [zero] section (TOML, or mapped from
    DeepSpeed's offload_optimizer)."""
    section = runtime.section("zero")
    return OffloadSettings() if section is None else _offload_of_keys(section["host_params"])


def resolve(config, plugin_path, mixed_precision, world):
    """Loads `config` (TOML path/text, DeepSpeed JSON path/text/dict, or a
    loaded ductile.Config, or Settings resolved already); returns Settings.
    `mixed_precision` (given to initialize) wins over the config's
    bf16/fp16 sections."""
    if isinstance(config, Settings):
        return config
    loaded = load_config(config, plugin_path=plugin_path)
    training = None
    clipping = None
    precision = None
    optimizer = None
    if loaded.format == "deepspeed":
        runtime, warns, training = _ductile.Runtime.from_deepspeed(
            loaded.deepspeed, loaded.origin, plugin_path, loaded.base_dir,
            require_zero_stage3=True, accelerator_backend=_backend(world), read_training=True)
        for message in warns:
            warnings.warn(message, UserWarning, stacklevel=4)
        precision = _precision.from_training(training)
        clipping = training["gradient_clipping"]
        if training["optimizer"] is not None:
            optimizer = optimizer_factory(training["optimizer"], loaded.origin)
        loaded = Config("deepspeed", loaded.origin, runtime, loaded.deepspeed, loaded.base_dir)
    if mixed_precision is not None:
        if not isinstance(mixed_precision, _precision.MixedPrecision):
            mixed_precision = _precision.MixedPrecision(mixed_precision)
        if precision is not None:
            _warn_replaced("mixed_precision", "bf16/fp16 section", loaded.origin)
        precision = mixed_precision
    return Settings(loaded, precision, clipping, _offload_of(loaded.runtime), optimizer,
                    training)


def _warn_replaced(argument, key, origin):
    warnings.warn(f"zero3.initialize: the {argument} argument replaces {origin}'s {key} "
                  "(an argument given to initialize wins over the config)", UserWarning,
                  stacklevel=5)


def warn_overridden(settings, optimizer_factory, offload_optimizer):
    """Warns for each of initialize's arguments that replaces what the
    config set (the rule: the argument wins); mixed_precision is resolve's."""
    origin = settings.loaded.origin
    if optimizer_factory is not None and settings.optimizer is not None:
        _warn_replaced("optimizer_factory", "optimizer section", origin)
    if offload_optimizer is not None and settings.offload.optimizer:
        key = ("zero_optimization.offload_optimizer" if settings.loaded.format == "deepspeed"
               else "[zero] offload_optimizer")
        _warn_replaced("offload_optimizer", key, origin)


def log_interval(settings):
    """The steps between the engine's progress lines: [zero] log_interval
    (validated by the schema, 0 by default), else a DeepSpeed config's
    steps_per_print, else 0 (none)."""
    section = settings.loaded.runtime.section("zero")
    interval = 0 if section is None else section["host_params"]["log_interval"]
    if not interval and settings.training is not None:
        interval = settings.training["steps_per_print"] or 0
    return interval


def snapshot_keys(settings):
    """([zero] snapshot_interval, snapshot_replicas), validated by the
    schema (a DeepSpeed config's "snapshot" object is mapped onto them)."""
    section = settings.loaded.runtime.section("zero")
    keys = {} if section is None else section["host_params"]
    return keys.get("snapshot_interval", 1), keys.get("snapshot_replicas", 1)


def torch_world(group):
    """The host's world when torch.distributed is initialised, else None."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    from ._torch_world import TorchWorld
    return TorchWorld(group)


def optimizer_factory(optimizer, origin):
    """An optimizer_factory for a DeepSpeed config's ``optimizer`` section, as
    the pipeline read and checked it: torch's AdamW, or Adam when the weight
    decay is not decoupled (``adam_w_mode`` false), with the parameters given."""
    cls = torch.optim.AdamW if optimizer["decoupled_weight_decay"] else torch.optim.Adam
    kwargs = {k: optimizer[k] for k in ("lr", "betas", "eps", "weight_decay")
              if optimizer[k] is not None}

    def factory(shards):
        try:
            return cls(shards, **kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{origin}: optimizer.params: {e}") from e
    return factory
