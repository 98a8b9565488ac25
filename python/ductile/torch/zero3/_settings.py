"""zero3's configuration as the engine takes it: a ductile TOML or a DeepSpeed JSON config
resolved into Settings once (the offload, the build's arguments, the snapshot and log keys), and
the torch world and optimizer factory it names."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from ... import _ductile
from ..._config import Config, load_config
from ..._errors import ConfigError
from . import _gradients
from ._gradients import MixedPrecision

# Builds the optimizer over the shard parameters it is given (None: no
# optimizer).
OptimizerFactory: TypeAlias = Callable[[list[torch.Tensor]], torch.optim.Optimizer | None]

# zero3's configuration: a ductile TOML with [zero] and [accelerator] sections, or a DeepSpeed
# JSON config (a dict is one), whose ZeRO keys the pipeline's one mapping
# (``pipeline::deepspeed_sections``, also behind ``ductile config check``) maps onto [zero]; the
# same pass reads what configures torch objects here (bf16/fp16, gradient_clipping, optimizer).
# A value "auto" (Hugging Face's placeholder) keeps ductile's default.


@dataclasses.dataclass
class OffloadSettings:
    """Offload as asked: ``optimizer`` (every group's optimizer on the
    host), ``ratio`` (only that share of the optimizer bytes), ``pin``
    (pinned host buffers on cuda), ``param`` (every group's parameter shard
    in host memory, and its optimizer with it)."""

    optimizer: bool = False
    ratio: float | None = None
    pin: bool = True
    param: bool = False
    pipeline: bool = False  # [zero] offload_pipeline (_offload.py)


@dataclasses.dataclass
class Build:
    """What an engine's parts are built from, kept for rejoin(): the
    configuration (its runtime made anew), initialize's groups, offload
    and max_device_memory, and the optimizer factory."""

    config: Config
    groups: Any
    offload: OffloadSettings
    max_device_memory: int | float | None
    optimizer_factory: Any


@dataclasses.dataclass
class Settings:
    """What zero3 takes from its configuration. ``training``: what a
    DeepSpeed config sets for the training framework, as the mapping read it
    (pipeline::DeepSpeedTraining), None for a TOML; ``optimizer``: a factory
    for a DeepSpeed "optimizer" section, or None."""

    loaded: Config
    mixed_precision: MixedPrecision | None
    gradient_clipping: float | None
    offload: OffloadSettings
    optimizer: OptimizerFactory | None
    training: dict[str, Any] | None


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
    return "cuda" if world is not None and world.device.type == "cuda" else "cpu"


def _offload_of_keys(keys):
    """OffloadSettings of [zero]'s validated offload keys."""
    param = keys.get("offload_param") == "cpu"
    pipeline = bool(keys.get("offload_pipeline", False))
    if keys["offload_optimizer"] != "cpu":
        return OffloadSettings(pin=keys["offload_pin_memory"], param=param, pipeline=pipeline)
    ratio = keys["offload_ratio"]
    return OffloadSettings(True, None if ratio == 1.0 else ratio, keys["offload_pin_memory"],
                           param, pipeline)


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
        precision = _gradients.from_training(training)
        clipping = training["gradient_clipping"]
        if training["optimizer"] is not None:
            optimizer = optimizer_factory(training["optimizer"], loaded.origin)
        source = loaded

        def fresh_runtime():
            return _ductile.Runtime.from_deepspeed(
                source.deepspeed, source.origin, plugin_path, source.base_dir,
                require_zero_stage3=True, accelerator_backend=_backend(world),
                read_training=True)[0]
        loaded = Config("deepspeed", loaded.origin, runtime, loaded.deepspeed, loaded.base_dir)
        loaded.fresh_runtime = fresh_runtime
    if mixed_precision is not None:
        if not isinstance(mixed_precision, _gradients.MixedPrecision):
            mixed_precision = _gradients.MixedPrecision(mixed_precision)
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


def _zero_keys(settings):
    """The [zero] section's keys, validated by the schema ({} without one)."""
    section = settings.loaded.runtime.section("zero")
    return {} if section is None else section["host_params"]


def log_interval(settings):
    """The steps between the engine's progress lines: [zero] log_interval
    (0 by default), else a DeepSpeed config's steps_per_print, else 0
    (none)."""
    interval = _zero_keys(settings).get("log_interval", 0)
    if not interval and settings.training is not None:
        interval = settings.training["steps_per_print"] or 0
    return interval


def snapshot_keys(settings):
    """([zero] snapshot_interval, snapshot_replicas) (a DeepSpeed config's
    "snapshot" object is mapped onto them)."""
    keys = _zero_keys(settings)
    return keys.get("snapshot_interval", 1), keys.get("snapshot_replicas", 1)


def torch_world(group):
    """The host's world when torch.distributed is initialised, else None."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    from ._world import TorchWorld
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
