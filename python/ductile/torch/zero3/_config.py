"""zero3's configuration: a ductile TOML with [zero] and [accelerator]
sections, or a DeepSpeed JSON config whose ZeRO stage-3 keys, ``bf16`` /
``fp16`` sections and ``gradient_clipping`` are honoured.

DeepSpeed keys and their ductile equivalents:

=====================================================  ===============================
zero_optimization.stage3_prefetch_bucket_size          [zero] prefetch_bucket_size
zero_optimization.stage3_max_live_parameters           [zero] max_live_parameters
zero_optimization.stage3_max_reuse_distance            [zero] max_reuse_distance
zero_optimization.stage3_param_persistence_threshold   [zero] param_persistence_threshold
zero_optimization.offload_param (device "nvme")        [zero] nvme_path, nvme_buffer_count
zero_optimization.offload_optimizer.device "cpu"       initialize(offload_optimizer="cpu")
zero_optimization.offload_optimizer.pin_memory         pinned host buffers (cuda)
zero_optimization.offload_optimizer.ratio              that share of the optimizer offloaded
optimizer (type Adam/AdamW, params)                    the optimizer, without optimizer_factory
bf16.enabled, fp16.* (loss scaling)                    MixedPrecision (_precision.py)
gradient_clipping                                      engine.step() clips to it first
=====================================================  ===============================

A value "auto" (Hugging Face's placeholder) keeps ductile's default.
Accepted but ignored, each with a warning saying so: offload_optimizer's
NVMe settings (device "nvme" keeps the state in host memory; nvme_path,
buffer_count, fast_init, pipeline_read, pipeline_write), offload_param's
pin_memory, buffer_size and max_in_cpu, and offload_param device "cpu"
(parameters stay on the device: use max_device_memory, which offloads the
optimizer as far as needed).
"""

import json
import warnings

import torch

from ..._config import load_config
from ..._errors import ConfigError
from . import _precision

_STAGE3_KEYS = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
}


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


def from_deepspeed(ds, origin, world):
    """The TOML sections (a dict) of a DeepSpeed config's stage-3 keys."""
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ConfigError(f"{origin}: 'zero_optimization' must be an object")
    stage = zero.get("stage", 0)
    if stage != 3:
        raise ConfigError(f"{origin}: zero_optimization.stage = {stage!r}; ductile.torch.zero3 "
                          "is ZeRO stage 3: set it to 3")
    section = {"coordinator": "partitioned"}
    for key, ours in _STAGE3_KEYS.items():
        value = zero.get(key)
        if value is not None and value != "auto":
            section[ours] = value
    offload = zero.get("offload_param") or {}
    where = f"{origin}: zero_optimization.offload_param"
    device = _offload_device(offload, where, "none", "device, nvme_path, buffer_count")
    if device == "nvme":
        if not offload.get("nvme_path"):
            raise ConfigError(f"{where}.device = \"nvme\" needs nvme_path")
        section["nvme_path"] = str(offload["nvme_path"])
        if offload.get("buffer_count") not in (None, "auto"):
            section["nvme_buffer_count"] = offload["buffer_count"]
    elif device == "cpu":
        _ignored(where, "device", "\"cpu\" keeps the parameter shards on the device; "
                 "max_device_memory offloads the optimizer state and master weights as far as "
                 "needed, \"nvme\" keeps the shards in files")
    if device in ("cpu", "nvme"):
        for key in ("pin_memory", "buffer_size", "max_in_cpu"):
            if offload.get(key) not in (None, "auto"):
                _ignored(where, key, "zero3 sizes its own buffers")
    return {"accelerator": {"backend": _backend(world), "communicator": "auto"}, "zero": section}


def resolve(config, plugin_path, mixed_precision, world):
    """Loads `config` (TOML path/text/dict, or a DeepSpeed JSON path/text);
    returns Settings. `mixed_precision` (given to initialize) wins over the
    config's bf16/fp16 sections."""
    loaded = load_config(config, format="toml" if isinstance(config, dict) else None,
                         plugin_path=plugin_path)
    clipping = None
    precision = None
    offload = None
    optimizer = None
    if loaded.format == "deepspeed":
        try:
            ds = json.loads(loaded.deepspeed) if isinstance(loaded.deepspeed, str) \
                else dict(loaded.deepspeed)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{loaded.origin}: not a JSON object: {e}") from e
        sections = from_deepspeed(ds, loaded.origin, world)
        precision = _precision.from_deepspeed(ds, loaded.origin)
        clip = ds.get("gradient_clipping")
        if clip not in (None, "auto", 0, 0.0):
            if not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip < 0:
                raise ConfigError(f"{loaded.origin}: gradient_clipping = {clip!r}; a number >= 0")
            clipping = float(clip)
        zero = ds.get("zero_optimization") or {}
        offload = offload_settings(zero.get("offload_optimizer"),
                                   f"{loaded.origin}: zero_optimization.offload_optimizer")
        section = ds.get("optimizer")
        if section is not None:
            if not isinstance(section, dict):
                raise ConfigError(f"{loaded.origin}: optimizer = {section!r}; valid: an object "
                                  "with type and params")
            optimizer = optimizer_factory(section, loaded.origin)
        loaded = load_config(sections, format="toml", plugin_path=plugin_path)
    if mixed_precision is not None:
        if not isinstance(mixed_precision, _precision.MixedPrecision):
            mixed_precision = _precision.MixedPrecision(mixed_precision)
        precision = mixed_precision
    return Settings(loaded, precision, clipping, offload, optimizer)


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
