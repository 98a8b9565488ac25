"""Elasticity, DeepSpeed-compatible.

Swap ``from deepspeed.elasticity import ...`` for ``from ductile.elasticity
import ...``: ``compute_elastic_config``, ``elasticity_enabled``,
``ensure_immutable_elastic_config`` and the exception classes behave as
DeepSpeed's (same arguments, return shapes and exception classes), with the
documented deviations of plugins/elasticity/README.md: where DeepSpeed
crashes (ValueError, TypeError, ZeroDivisionError, AssertionError) ductile
raises ElasticityConfigError or ElasticityError with a clear message, and
v0.2 never answers a batch size of 0.

The computation runs in the policy plugins (C++). Any policy plugin is
reachable by name: ``"policy": "optimal"`` (or an out-of-tree one, found
through ``plugin_path=[...]`` or DUCTILE_PLUGIN_PATH) in the elasticity block.
"""

import dataclasses
import json
import logging
import os
import re
import threading

from . import _ductile
from ._config import load_config
from ._errors import ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize

__all__ = [
    "compute_elastic_config", "elasticity_enabled", "ensure_immutable_elastic_config",
    "ElasticityError", "ElasticityConfigError", "ElasticityIncompatibleWorldSize",
    "ElasticityResult", "ElasticPolicy", "load", "MINIMUM_DEEPSPEED_VERSION",
    "LATEST_ELASTICITY_VERSION", "DEEPSPEED_ELASTICITY_CONFIG", "deepspeed_config_plan",
]

_log = logging.getLogger("ductile.elasticity")

# DeepSpeed's constants (deepspeed/elasticity/constants.py).
MINIMUM_DEEPSPEED_VERSION = "0.3.8"
LATEST_ELASTICITY_VERSION = 0.2
DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"
ELASTICITY = "elasticity"
ENABLED = "enabled"
ENABLED_DEFAULT = False


@dataclasses.dataclass(frozen=True)
class ElasticityResult:
    """Everything a policy answers (see sdk/include/ductile/elasticity_policy.hpp)."""

    final_batch_size: int
    valid_gpus: list
    valid_dp_sizes: list
    model_parallel_size: int
    num_gpus_per_node: int
    world_size: "int | None"
    data_parallel_size: "int | None"
    micro_batch_size: "int | None"
    gradient_accumulation_steps: "int | None"
    fallback: bool
    warnings: list


class ElasticPolicy:
    """An elasticity policy plugin with its settings (from :func:`load`)."""

    def __init__(self, handle):
        self._handle = handle

    name = property(lambda self: self._handle.name, doc="the policy plugin's name")
    params = property(lambda self: self._handle.params, doc="effective parameters")
    origin = property(lambda self: self._handle.origin)
    warnings = property(lambda self: self._handle.warnings)

    def compute(self, world_size=0, require_micro_batch=False):
        """The elastic plan; with a world size (total GPUs) also the micro
        batch and gradient accumulation steps. Raises ElasticityConfigError,
        ElasticityIncompatibleWorldSize, ElasticityError."""
        return ElasticityResult(**self._handle.compute(
            _ductile.int_argument(world_size, "world_size"), bool(require_micro_batch)))

    def check_scheduler(self):
        """The scheduler contract: compares the settings with
        DEEPSPEED_ELASTICITY_CONFIG / DUCTILE_ELASTICITY_CONFIG (every field
        that changes the plan); raises ElasticityConfigError naming each
        difference; returns False (with a warning) when neither is set."""
        return self._handle.check_scheduler()

    def __repr__(self):
        return f"ductile.elasticity.ElasticPolicy({self.name!r}, {self.params!r})"


def load(config, *, plugin_path=None, allow_config_plugins=False):
    """The elasticity policy of a configuration: a ductile TOML ([elasticity]
    section) or a DeepSpeed config with an "elasticity" block (file, string
    or dict; see ductile.load_config, also for ``allow_config_plugins``)."""
    config = load_config(config, plugin_path=plugin_path,
                         allow_config_plugins=allow_config_plugins)
    if config.format == "deepspeed":
        mode = _ductile.elasticity.deepspeed_mode(config.deepspeed, config.origin)
        if mode["has_block"] and not mode["elastic"]:
            raise ElasticityConfigError(
                f"{config.origin}: elasticity is disabled (elasticity.enabled is not true): "
                "DeepSpeed trains this config as a non-elastic job, which has no elasticity "
                "policy; deepspeed_config_plan() gives its batch, or set elasticity.enabled = "
                "true for an elastic plan")
        for warning in mode["warnings"]:
            _log.warning("%s", warning)
        return ElasticPolicy(_policy_from_json(config.deepspeed, config.origin, plugin_path))
    return ElasticPolicy(_ductile.elasticity.from_runtime(config.runtime))


def deepspeed_config_plan(config, world_size=0, *, plugin_path=None):
    """What DeepSpeed's ``DeepSpeedConfig`` makes of a DeepSpeed config's batch
    for ``world_size`` data-parallel ranks (0: none), with its elasticity
    rules: an enabled block beside train_batch_size,
    train_micro_batch_size_per_gpu or gradient_accumulation_steps is refused
    unless ``ignore_non_elastic_batch_info`` is true; the scheduler's copy
    (DEEPSPEED_ELASTICITY_CONFIG) must match; a disabled block is a
    non-elastic job whose batch comes from those keys.

    Returns the dict ``ductile elastic --config FILE --json`` prints:
    ``elastic`` (bool), ``final_batch_size``, ``micro_batch_size``,
    ``gradient_accumulation_steps``, ``world_size``, ``valid_gpus`` (None for
    a non-elastic job), ``warnings``. Raises ElasticityConfigError,
    ElasticityIncompatibleWorldSize, ElasticityError."""
    config = load_config(config, format="deepspeed", plugin_path=plugin_path)
    world_size = _ductile.int_argument(world_size, "world_size")
    mode = _ductile.elasticity.deepspeed_mode(config.deepspeed, config.origin)
    if mode["has_block"] and not mode["elastic"]:
        return _ductile.elasticity.non_elastic_plan(config.deepspeed, config.origin, world_size)
    handle = _policy_from_json(config.deepspeed, config.origin, plugin_path)
    handle.check_scheduler()
    plan = handle.compute(world_size, False)
    plan.update(elastic=True, policy=handle.name, source=config.origin,
                warnings=mode["warnings"] + plan["warnings"])
    return plan


# Policies created from DeepSpeed configs, by (JSON text, plugin path):
# creating one loads nothing new but validates parameters, and
# compute_elastic_config is called often by schedulers.
_cache: dict[tuple, object] = {}
_cache_lock = threading.Lock()
_CACHE_SIZE = 256


def _policy_from_json(text, origin, plugin_path):
    key = (text, origin, tuple(os.fspath(p) for p in plugin_path or ()),
           os.environ.get("DUCTILE_PLUGIN_PATH", ""))
    with _cache_lock:
        handle = _cache.get(key)
    if handle is None:
        handle = _ductile.elasticity.from_deepspeed(text, origin, plugin_path)
        for warning in handle.warnings:
            _log.warning("%s", warning)
        with _cache_lock:
            if len(_cache) >= _CACHE_SIZE:
                _cache.clear()
            _cache[key] = handle
    return handle


def _release(text):
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    if not match:
        return None
    parts = [int(p) for p in match.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _check_target_version(target_deepspeed_version):
    target = _release(str(target_deepspeed_version))
    if target is None:
        raise ElasticityError(
            f"target_deepspeed_version {target_deepspeed_version!r} is not a version such as "
            f"'0.9.0' (elasticity needs at least {MINIMUM_DEEPSPEED_VERSION})")
    if target < _release(MINIMUM_DEEPSPEED_VERSION):
        raise ElasticityError(
            f"Target deepspeed version of {target_deepspeed_version} is not compatible with "
            f"minimum version {MINIMUM_DEEPSPEED_VERSION} supporting elasticity.")


def compute_elastic_config(ds_config, target_deepspeed_version, world_size=0,
                           return_microbatch=False, *, plugin_path=None):
    """DeepSpeed's core elasticity API.

    Returns ``(final_batch_size, valid_gpus)``; with ``world_size > 0`` or
    ``return_microbatch``: ``(final_batch_size, valid_gpus, micro_batch_size)``.
    ``world_size`` is the total GPU count; for v0.2 without it, and for a
    micro batch asked for without it, the WORLD_SIZE environment variable is
    used as DeepSpeed does.

    Raises ElasticityConfigError (missing, disabled or invalid elasticity
    block), ElasticityIncompatibleWorldSize (world size not valid),
    ElasticityError (target version too old, no usable answer), ValueError
    (``ds_config`` not a dict).

    Plugins come from ``plugin_path``, DUCTILE_PLUGIN_PATH and the built-in
    directory only: a DeepSpeed config names no plugin directory (a
    ``plugins`` block in it is not read), so nothing it brings is run.
    """
    if not isinstance(ds_config, dict):
        raise ValueError("Expected ds_config to be a dictionary but received "
                         f"a {type(ds_config)}, containing: {ds_config}")
    if ELASTICITY not in ds_config:
        raise ElasticityConfigError(f"'{ELASTICITY}' is missing from config json, please add it "
                                    "if running an elastic training job.")
    try:
        text = json.dumps(ds_config)
    except (TypeError, ValueError) as e:
        raise ElasticityConfigError(f"ds_config cannot be read as JSON: {e}") from e
    handle = _policy_from_json(text, "ds_config", plugin_path)
    _check_target_version(target_deepspeed_version)
    world_size = _ductile.int_argument(world_size, "world_size")
    requested = world_size
    if requested == 0 and (handle.name == "v0.2" or return_microbatch):
        # DeepSpeed reads WORLD_SIZE for v0.2, and (since 0.19.7) for a
        # micro batch asked for without a world size.
        env = os.environ.get("WORLD_SIZE")
        if env is not None and env.isnumeric():
            requested = int(env)
        elif return_microbatch:
            raise ElasticityConfigError(
                f"Elasticity {handle.name} needs WORLD_SIZE to compute a micro batch size: give "
                "it as the argument world_size of compute_elastic_config or in the environment "
                f"variable WORLD_SIZE (an integer; it is {env!r})")
    result = handle.compute(requested, bool(return_microbatch))
    final_batch_size, valid_gpus = result["final_batch_size"], result["valid_gpus"]
    if world_size > 0 or return_microbatch:
        return final_batch_size, valid_gpus, result["micro_batch_size"]
    return final_batch_size, valid_gpus


def elasticity_enabled(ds_config):
    """True when the DeepSpeed config has an elasticity block with
    "enabled": true (DeepSpeed's default is false)."""
    if ELASTICITY not in ds_config:
        return False
    return ds_config[ELASTICITY].get(ENABLED, ENABLED_DEFAULT)


def ensure_immutable_elastic_config(runtime_elastic_config_dict):
    """Checks that the resource scheduler (DEEPSPEED_ELASTICITY_CONFIG, or
    ductile's DUCTILE_ELASTICITY_CONFIG) saw the elastic configuration used
    at run time: every field that changes the plan must match, else
    ElasticityConfigError naming each difference. Logs a warning (C++
    logger) when neither variable is set."""
    if not isinstance(runtime_elastic_config_dict, dict):
        raise ValueError("Expected runtime_elastic_config_dict to be a dictionary but received "
                         f"a {type(runtime_elastic_config_dict)}")
    _ductile.elasticity.check_scheduler_deepspeed(json.dumps(runtime_elastic_config_dict),
                                                  "runtime elastic config")
