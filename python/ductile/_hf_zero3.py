"""transformers' ZeRO-3 model creation and loading on ductile's partitions.

Under a DeepSpeed config with ZeRO stage 3 (``TrainingArguments(deepspeed=...)``,
Accelerate's DeepSpeed plugin, ``HfDeepSpeedConfig``), transformers builds a
model (``from_config``, ``from_pretrained``) inside ``deepspeed.zero.Init``,
initialises and loads it through ``deepspeed.zero.GatheredParameters``, and
resizes embeddings the same way. ``use_ductile_zero3()``, which importing
``ductile.hf``, ``ductile.trl``, ``ductile.accelerate`` or (once transformers
is imported) ``ductile.deepspeed`` calls, makes those
two ductile's in this process (``ductile.deepspeed.zero``), so the model is
partitioned by ductile from its first parameter and ``initialize`` adopts it
as it is. A safetensors checkpoint is then loaded slice by slice: each rank
reads only the bytes of its own slices (transformers' own ZeRO-3 load
reads every tensor whole on rank 0 and broadcasts it). docs/deepspeed.md,
"Models made by transformers".
"""

import contextlib
import importlib.abc
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

_installed: list[bool] = []  # [True] once installed
_loading = threading.local()  # .slices: a from_pretrained that loads slice by slice

# The attribute a tensor from a checkpoint's keys (a meta tensor: shape and
# dtype only) carries while a load is slice by slice: (file, key).
_SOURCE = "_ductile_safetensors_source"


# The transformers releases whose private functions this module and
# ductile.hf replace or override, as tested.
TESTED_TRANSFORMERS = "5.23"


def warn_if_untested(package: str, tested: str, what: str) -> None:
    """Warns, naming the supported releases, when the installed `package`
    is not a `tested` release (a "major.minor" prefix): `what` (ductile's
    part) overrides its private methods, which may have changed. It keeps
    working wherever they have not."""
    import importlib.metadata
    import warnings

    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return
    if installed != tested and not installed.startswith(tested + "."):
        warnings.warn(
            f"{what} is tested with {package} {tested}.x, and {installed} is installed: it "
            f"overrides private parts of {package} that may differ in this release; "
            f"supported: {package} {tested}.x", UserWarning, stacklevel=3)


def use_ductile_zero3() -> None:
    """Makes transformers' ZeRO-3 model creation, initialisation and
    loading ductile's, in this process (idempotent). Without DeepSpeed
    installed transformers never takes its ZeRO-3 path: nothing to do."""
    if _installed:
        return
    try:
        import deepspeed
    except ImportError:
        return
    import transformers.modeling_utils as modeling_utils

    warn_if_untested("transformers", TESTED_TRANSFORMERS, "ductile's ZeRO-3 for transformers")
    # Marked first: importing ductile.deepspeed below comes back here.
    _installed.append(True)

    from .deepspeed import zero
    from .torch.zero3._param import parameters_of

    class Init(zero.Init):
        """ductile's zero.Init as transformers calls it. transformers also asks
        ``deepspeed.comm`` for the rank (``initialize_weights_zero3``), which
        DeepSpeed's Init sets up: so does this one, over torch.distributed's
        default group (made from the launcher's environment first if need be,
        as ``ductile.deepspeed.init_distributed`` does)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if not torch.distributed.is_initialized():
                from .deepspeed import init_distributed
                init_distributed()
            if not deepspeed.comm.is_initialized():
                deepspeed.comm.init_distributed(dist_backend=torch.distributed.get_backend(),
                                                dist_init_required=False)
            super().__init__(*args, **kwargs)

    deepspeed.zero.Init = Init
    deepspeed_gathered = deepspeed.zero.GatheredParameters

    def gathered_parameters(params: Any, *args: Any, **kwargs: Any) -> Any:
        """ductile's GatheredParameters; DeepSpeed's own for parameters its
        zero.Init partitioned (a DeepSpeed engine in the same process)."""
        listed = parameters_of(params)
        if any(hasattr(p, "ds_id") for p in listed):
            return deepspeed_gathered(listed, *args, **kwargs)
        return zero.GatheredParameters(listed, *args, **kwargs)

    deepspeed.zero.GatheredParameters = gathered_parameters

    read_state_dict = modeling_utils.load_state_dict
    load_pretrained = modeling_utils.PreTrainedModel._load_pretrained_model
    load_into_zero3 = modeling_utils._load_state_dict_into_zero3_model

    def load_state_dict(checkpoint_file, map_location="cpu", weights_only=True,
                        disable_mmap=None):
        if getattr(_loading, "slices", False):
            path = os.fspath(checkpoint_file)
            tensors = read_state_dict(path, map_location="meta", weights_only=weights_only,
                                      disable_mmap=disable_mmap)
            for key, tensor in tensors.items():
                setattr(tensor, _SOURCE, (path, key))
            return tensors
        return read_state_dict(checkpoint_file, map_location=map_location,
                               weights_only=weights_only, disable_mmap=disable_mmap)

    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config,
                               expected_keys=None):
        _loading.slices = _loads_slices(state_dict, checkpoint_files, load_config)
        try:
            return load_pretrained(model, state_dict, checkpoint_files, load_config,
                                   expected_keys)
        finally:
            _loading.slices = False

    def _load_state_dict_into_zero3_model(model_to_load, state_dict, load_config=None):
        if state_dict and all(hasattr(v, _SOURCE) for v in state_dict.values()):
            return _load_slices(model_to_load, state_dict, load_config)
        return load_into_zero3(model_to_load, state_dict, load_config)

    modeling_utils.load_state_dict = load_state_dict
    modeling_utils.PreTrainedModel._load_pretrained_model = (  # type: ignore[method-assign]
        staticmethod(_load_pretrained_model))
    modeling_utils._load_state_dict_into_zero3_model = _load_state_dict_into_zero3_model


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `then` right after the module `name` is first imported (a
    finder ahead of the others for that one name; it steps aside once)."""

    def __init__(self, name, then):
        self.name = name
        self.then = then
        self.loader: Any = None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.then()


def use_ductile_zero3_with_transformers() -> None:
    """``use_ductile_zero3()`` as soon as transformers' modeling code is
    loaded (now, if it is): ``import ductile.deepspeed`` does not import
    transformers, which a script without it would pay for at start."""
    if "transformers.modeling_utils" in sys.modules:
        use_ductile_zero3()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("transformers.modeling_utils", use_ductile_zero3))


@contextlib.contextmanager
def ductile_engine(enabled: bool = True) -> Iterator[None]:
    """While it lasts, ``deepspeed.initialize`` (which the Trainer's and
    Accelerate's DeepSpeed integrations call) is ductile's."""
    if not enabled:
        yield
        return
    import deepspeed

    from . import deepspeed as ductile_deepspeed
    original = deepspeed.initialize
    deepspeed.initialize = ductile_deepspeed.initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def _loads_slices(state_dict, checkpoint_files, load_config):
    """Whether a from_pretrained can load slice by slice: ZeRO-3, safetensors
    files, no quantisation, and no weight conversion that merges or splits
    tensors (renamings are fine)."""
    from transformers.core_model_loading import WeightConverter
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled() and state_dict is None and checkpoint_files
                and all(os.fspath(f).endswith(".safetensors") for f in checkpoint_files)
                and not getattr(load_config, "is_quantized", False)
                and not any(isinstance(entry, WeightConverter)
                            for entry in getattr(load_config, "weight_mapping", None) or ()))


def _load_slices(model, state_dict, load_config):
    """transformers' ``_load_state_dict_into_zero3_model`` for a state dict of
    checkpoint keys: every rank reads, for each parameter, only its slice's
    bytes into its shard, and each buffer whole. Returns (error messages,
    missing keys) as transformers' does."""
    from transformers.integrations.deepspeed import _apply_weight_conversions_to_state_dict

    from .torch.zero3._param import full_shape, shard_of
    from .torch.zero3._safetensors import SafetensorsSource

    state_dicts: Any = [state_dict]
    weight_mapping = getattr(load_config, "weight_mapping", None)
    if weight_mapping:
        state_dicts = _apply_weight_conversions_to_state_dict(model, state_dict, weight_mapping)
        model._weight_conversions = weight_mapping
    expected = model.state_dict(keep_vars=True)
    missing = set(expected)
    prefix = getattr(model, "base_model_prefix", None)
    readers: dict[str, SafetensorsSource] = {}
    errors: list[str] = []
    loaded: set[int] = set()  # tied parameters appear under each name: read once
    try:
        for converted in state_dicts:
            by_key = {(f"{prefix}.{k}" if f"{prefix}.{k}" in expected else k): v
                      for k, v in converted.items()}
            for key, target in expected.items():
                value = by_key.get(key)
                if value is None:
                    continue
                missing.discard(key)
                if id(target) in loaded:
                    continue
                shape = full_shape(target)
                if tuple(value.shape) != tuple(shape):
                    errors.append(
                        f"size mismatch for {key}: copying a param with shape "
                        f"{torch.Size(value.shape)} from checkpoint, the shape in current model "
                        f"is {torch.Size(shape)}.")
                    continue
                path, name = getattr(value, _SOURCE)
                reader = readers.get(path)
                if reader is None:
                    reader = readers[path] = SafetensorsSource(path)
                shard = shard_of(target)
                with torch.no_grad():
                    if shard is not None:
                        shard.values[:shard.hi - shard.lo].copy_(
                            reader.read(name, shape, shard.lo, shard.hi))
                    else:
                        target.copy_(reader.read(name, shape, 0, target.numel()).view(shape))
                target._is_hf_initialized = True
                loaded.add(id(target))
    finally:
        for reader in readers.values():
            reader.close()
    return errors, missing
