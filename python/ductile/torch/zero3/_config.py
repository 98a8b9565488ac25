"""zero3's configuration: a ductile TOML with [zero] and [accelerator]
sections, or a DeepSpeed JSON config.

A DeepSpeed config's ZeRO keys are mapped onto [zero] by the pipeline's one
mapping (``pipeline::deepspeed_sections``, also behind ``ductile config
check``): ``zero_optimization.stage3_*`` (the coordinator's limits),
``offload_param`` (device "nvme": nvme_path, buffer_count) and
``offload_optimizer`` (device, pin_memory, ratio: [zero] offload_optimizer,
offload_pin_memory, offload_ratio), with warnings for the keys accepted but
not acted on. Read here, because they configure torch objects: the
``bf16`` / ``fp16`` sections (MixedPrecision, _precision.py),
``gradient_clipping`` (engine.step() clips to it first) and ``optimizer``
(type Adam/AdamW and params, when no optimizer_factory is given). A value
"auto" (Hugging Face's placeholder) keeps ductile's default.
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
                 optimizer=None):
        self.loaded = loaded
        self.mixed_precision = mixed_precision
        self.gradient_clipping = gradient_clipping
        self.offload = offload or OffloadSettings()
        self.optimizer = optimizer  # a factory for a DeepSpeed "optimizer" section, or None


class OffloadSettings:
    """Optimizer offload as asked: ``optimizer`` (every group's optimizer on
    the host), ``ratio`` (only that share of the optimizer bytes), ``pin``
    (pinned host buffers on cuda)."""

    def __init__(self, optimizer=False, ratio=None, pin=True):
        self.optimizer = optimizer
        self.ratio = ratio
        self.pin = pin


_IGNORED_OPTIMIZER_KEYS = ("nvme_path", "buffer_count", "fast_init", "pipeline_read",
                           "pipeline_write", "pipeline")


def _offload_device(section, where, default, keys):
    """The ``device`` of an offload_optimizer / offload_param object."""
    if not isinstance(section, dict):
        raise ConfigError(f"{where} = {section!r}; valid: an object with {keys}")
    device = section.get("device", default)
    if device not in ("cpu", "nvme", "none", None):
        raise ConfigError(f"{where}.device = {device!r}; valid: \"cpu\", \"nvme\", \"none\"")
    return device


def _ignored(where, key, why):
    warnings.warn(f"{where}.{key} is accepted but ignored: {why}", UserWarning, stacklevel=4)


def offload_settings(value, where):
    """OffloadSettings from initialize(offload_optimizer=...) or DeepSpeed's
    zero_optimization.offload_optimizer: None/False/"none" (off), True or
    "cpu" (on), or a dict of DeepSpeed's keys."""
    if value is None or value is False:
        return OffloadSettings()
    if value is True:
        return OffloadSettings(True)
    if isinstance(value, str):
        value = {"device": value}
    device = _offload_device(value, where, "cpu", "device, pin_memory, ratio")
    if device in ("none", None):
        return OffloadSettings()
    if device == "nvme":
        _ignored(where, "device", "\"nvme\" keeps the optimizer state in host memory (as "
                 "\"cpu\"), not on NVMe")
    for key in _IGNORED_OPTIMIZER_KEYS:
        if value.get(key) not in (None, "auto"):
            _ignored(where, key, "it configures NVMe swapping, which zero3 does not do for the "
                     "optimizer state")
    pin = value.get("pin_memory", True)
    if pin == "auto":
        pin = True
    if not isinstance(pin, bool):
        raise ConfigError(f"{where}.pin_memory = {pin!r}; valid: true or false")
    ratio = value.get("ratio")
    if ratio == "auto":
        ratio = None
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                              or not 0.0 <= ratio <= 1.0):
        raise ConfigError(f"{where}.ratio = {ratio!r}; valid: a number in [0, 1]")
    known = {"device", "pin_memory", "ratio", *_IGNORED_OPTIMIZER_KEYS}
    unknown = sorted(set(value) - known)
    for key in unknown:
        _ignored(where, key, "zero3 does not know this key")
    return OffloadSettings(True, None if ratio in (None, 1, 1.0) else float(ratio), pin)


def _backend(world):
    if world is not None:
        return "cuda" if world.device.type == "cuda" else "cpu"
    return "cpu"


def _offload_of(runtime):
    """OffloadSettings of a validated [zero] section (TOML, or mapped from
    DeepSpeed's offload_optimizer)."""
    section = runtime.section("zero")
    if section is None:
        return OffloadSettings()
    keys = section["host_params"]
    if keys["offload_optimizer"] != "cpu":
        return OffloadSettings()
    ratio = keys["offload_ratio"]
    return OffloadSettings(True, None if ratio == 1.0 else ratio, keys["offload_pin_memory"])


def resolve(config, plugin_path, mixed_precision, world):
    """Loads `config` (TOML path/text/dict, or a DeepSpeed JSON path/text);
    returns Settings. `mixed_precision` (given to initialize) wins over the
    config's bf16/fp16 sections."""
    loaded = load_config(config, format="toml" if isinstance(config, dict) else None,
                         plugin_path=plugin_path)
    clipping = None
    precision = None
    optimizer = None
    if loaded.format == "deepspeed":
        runtime, warns = _ductile.Runtime.from_deepspeed(
            loaded.deepspeed, loaded.origin, plugin_path, loaded.base_dir,
            require_zero_stage3=True, accelerator_backend=_backend(world))
        for message in warns:
            warnings.warn(message, UserWarning, stacklevel=4)
        ds = json.loads(loaded.deepspeed)  # valid JSON: the mapping parsed it
        precision = _precision.from_deepspeed(ds, loaded.origin)
        clip = ds.get("gradient_clipping")
        if clip not in (None, "auto", 0, 0.0):
            if not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip < 0:
                raise ConfigError(f"{loaded.origin}: gradient_clipping = {clip!r}; a number >= 0")
            clipping = float(clip)
        section = ds.get("optimizer")
        if section is not None:
            if not isinstance(section, dict):
                raise ConfigError(f"{loaded.origin}: optimizer = {section!r}; valid: an object "
                                  "with type and params")
            optimizer = optimizer_factory(section, loaded.origin)
        loaded = Config("deepspeed", loaded.origin, runtime, loaded.deepspeed, loaded.base_dir)
    if mixed_precision is not None:
        if not isinstance(mixed_precision, _precision.MixedPrecision):
            mixed_precision = _precision.MixedPrecision(mixed_precision)
        precision = mixed_precision
    return Settings(loaded, precision, clipping, _offload_of(loaded.runtime), optimizer)


def torch_world(group):
    """The host's world when torch.distributed is initialised, else None."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    from ._torch_world import TorchWorld
    return TorchWorld(group)


def optimizer_factory(section, origin):
    """An optimizer_factory for a DeepSpeed config's ``optimizer`` section
    (type Adam or AdamW; DeepSpeed's Adam is AdamW unless adam_w_mode is
    false, as DeepSpeed builds it)."""
    where = f"{origin}: optimizer"
    kind = str(section.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise ConfigError(f"{where}.type = {section.get('type')!r}; valid: \"Adam\", \"AdamW\" "
                          "(or pass optimizer_factory to zero3.initialize)")
    params = section.get("params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}.params = {params!r}; valid: an object")
    decoupled = kind == "adamw" or params.get("adam_w_mode", True) is not False
    known = {"lr", "betas", "eps", "weight_decay"}
    kwargs = {k: (tuple(v) if k == "betas" else v) for k, v in params.items()
              if k in known and v != "auto"}
    for key in sorted(set(params) - known - {"adam_w_mode", "torch_adam"}):
        _ignored(where + ".params", key, "torch's Adam/AdamW has no such setting")
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam

    def factory(shards):
        try:
            return cls(shards, **kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}.params: {e}") from e
    return factory
