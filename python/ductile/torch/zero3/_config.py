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
bf16.enabled, fp16.* (loss scaling)                    MixedPrecision (_precision.py)
gradient_clipping                                      engine.step() clips to it first
=====================================================  ===============================

A value "auto" (Hugging Face's placeholder) keeps ductile's default.
"""

import json

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

    def __init__(self, loaded, mixed_precision, gradient_clipping):
        self.loaded = loaded
        self.mixed_precision = mixed_precision
        self.gradient_clipping = gradient_clipping


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
    if isinstance(offload, dict) and offload.get("device") == "nvme":
        if not offload.get("nvme_path"):
            raise ConfigError(f"{origin}: zero_optimization.offload_param.device = \"nvme\" "
                              "needs nvme_path")
        section["nvme_path"] = str(offload["nvme_path"])
        if offload.get("buffer_count") not in (None, "auto"):
            section["nvme_buffer_count"] = offload["buffer_count"]
    return {"accelerator": {"backend": _backend(world), "communicator": "auto"}, "zero": section}


def resolve(config, plugin_path, mixed_precision, world):
    """Loads `config` (TOML path/text/dict, or a DeepSpeed JSON path/text);
    returns Settings. `mixed_precision` (given to initialize) wins over the
    config's bf16/fp16 sections."""
    loaded = load_config(config, format="toml" if isinstance(config, dict) else None,
                         plugin_path=plugin_path)
    clipping = None
    precision = None
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
        loaded = load_config(sections, format="toml", plugin_path=plugin_path)
    if mixed_precision is not None:
        if not isinstance(mixed_precision, _precision.MixedPrecision):
            mixed_precision = _precision.MixedPrecision(mixed_precision)
        precision = mixed_precision
    return Settings(loaded, precision, clipping)


def torch_world(group):
    """The host's world when torch.distributed is initialised, else None."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    from ._torch_world import TorchWorld
    return TorchWorld(group)
