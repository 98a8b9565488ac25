"""Whole parameters out of a zero3 engine: ``full_parameters``,
``state_dict``, ``save_consolidated`` (Hugging Face safetensors) and the
``GatheredParameters`` context (read or modify full parameters, DeepSpeed's
``deepspeed.zero.GatheredParameters``). Every call is collective: each
parameter is all-gathered from the optimizer's shards (the fp32 masters
with mixed precision) one at a time, so no rank holds more than one whole
parameter beyond what it keeps.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal, Self, TypeAlias

import torch

from ..._config import StrPath
from ..._errors import IncompatibleError, InvalidArgumentError, IoError
from ._precision import as_dtype

if TYPE_CHECKING:
    from ._engine import Zero3Engine

# The dtype of whole parameters: a torch dtype, "fp32"/"bf16"/"fp16" (and
# their long names), "param" (each parameter's own) or None (the optimizer
# shards': the fp32 masters with mixed precision).
DtypeArgument: TypeAlias = torch.dtype | str | None

_OWNER = "_ductile_zero3_owner"


def _gather(engine, zp, dtype=None):
    """zp's whole value (shape zp.shape, new memory), on the engine's device."""
    shard = zp.shard.detach()
    out = torch.empty(engine.world_size * zp.shard_numel, dtype=shard.dtype,
                      device=engine._memory.device)
    # An offloaded master is on the host: the collective takes a device copy.
    engine.comm.all_gather(out, shard.to(out.device).contiguous()).wait()
    full = out[:zp.numel].view(zp.shape)
    if dtype is not None and dtype != full.dtype:
        full = full.to(dtype)
    return full


def _dtype_of(zp, dtype):
    if dtype == "param":
        return zp.orig_dtype
    return as_dtype(dtype, "dtype")


def full_parameters(engine: Zero3Engine,
                    dtype: DtypeArgument = None) -> dict[str, torch.Tensor]:
    return {zp.name: _gather(engine, zp, _dtype_of(zp, dtype)) for zp in engine._params}


def _entries(engine):
    """(state_dict key, ZeroParam or buffer tensor) in model.state_dict() order."""
    by_param = {id(zp.param): zp for zp in engine._params}
    out = []
    for key, value in engine.module.state_dict(keep_vars=True).items():
        out.append((key, by_param.get(id(value), value)))
    return out


def state_dict(engine: Zero3Engine, dtype: DtypeArgument = None,
               rank0_only: bool = False) -> dict[str, torch.Tensor]:
    keep = not rank0_only or engine.rank == 0
    out, gathered = {}, {}
    for key, entry in _entries(engine):
        if not hasattr(entry, "shard"):
            if keep:
                out[key] = entry.detach().clone().cpu()
            continue
        if entry.id not in gathered:
            value = _gather(engine, entry, _dtype_of(entry, dtype)).cpu()
            gathered[entry.id] = value if keep else None
        if keep:
            out[key] = gathered[entry.id]
    return out


def _plan_files(items, max_shard_bytes):
    """Groups (key, nbytes) into files of at most max_shard_bytes each (a
    larger tensor alone); returns the list of key lists."""
    files: list[list] = []
    current: list = []
    size = 0
    for key, nbytes in items:
        if current and size + nbytes > max_shard_bytes:
            files.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes
    if current or not files:
        files.append(current)
    return files


def save_consolidated(engine: Zero3Engine, path: StrPath, dtype: DtypeArgument = None,
                      max_shard_bytes: int = 5 << 30) -> None:
    from safetensors.torch import save_file

    path = os.fspath(path)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InvalidArgumentError(
            f"zero3: save_consolidated max_shard_bytes = {max_shard_bytes!r}; a positive int")
    # One name per tensor: safetensors refuses shared storage, and
    # from_pretrained ties the others again (tie_word_embeddings).
    entries, seen = [], set()
    for key, entry in _entries(engine):
        ident = ("param", entry.id) if hasattr(entry, "shard") else ("buffer", id(entry))
        if ident in seen:
            continue
        seen.add(ident)
        entries.append((key, entry))

    def out_dtype(entry):
        if hasattr(entry, "shard"):
            return _dtype_of(entry, dtype) or entry.shard.dtype
        return entry.dtype

    def nbytes(entry):
        numel = entry.numel if hasattr(entry, "shard") else entry.numel()
        return numel * torch.empty((), dtype=out_dtype(entry)).element_size()

    sizes = {key: nbytes(entry) for key, entry in entries}
    files = _plan_files([(key, sizes[key]) for key, _ in entries], max_shard_bytes)
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    lookup = dict(entries)
    if engine.rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise IoError(f"{path}: cannot create the folder: {e.strerror}") from e
    for name, keys in zip(names, files):
        tensors = {}
        for key in keys:
            entry = lookup[key]
            if hasattr(entry, "shard"):
                value = _gather(engine, entry, out_dtype(entry))
            else:
                value = entry.detach()
            if engine.rank == 0:
                tensors[key] = value.contiguous().cpu()
        if engine.rank == 0:
            try:
                save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
            except OSError as e:
                raise IoError(f"{os.path.join(path, name)}: cannot write: {e.strerror}") from e
    if engine.rank == 0:
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {key: n for n, keys in zip(names, files) for key in keys}}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        config = getattr(engine.module, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(path)
    engine.comm.barrier()


def register_owner(engine, zp):
    setattr(zp.param, _OWNER, (weakref.ref(engine), zp))


def _owner(param):
    owner = getattr(param, _OWNER, None)
    if owner is None:
        return None, None
    engine = owner[0]()
    return engine, owner[1]


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=0): ...``: inside,
    each of `params` (parameters of a zero3 model, or a module: its
    parameters) holds its whole value (in the model's dtype, the fp32
    masters' values with mixed precision). On exit, with modifier_rank set,
    that rank's values (changes included) are broadcast and become the
    shards (and the optimizer's masters) everywhere; with modifier_rank None
    changes are dropped. Collective; use it between passes, not inside a
    forward."""

    def __init__(self,
                 params: torch.nn.Module | torch.nn.Parameter | Iterable[torch.nn.Parameter],
                 modifier_rank: int | None = None, enabled: bool = True) -> None:
        if isinstance(params, torch.nn.Module):
            params = list(params.parameters())
        elif isinstance(params, torch.nn.Parameter):
            params = [params]
        self.params = list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._held: list[tuple[Zero3Engine, Any]] = []  # (engine, its ZeroParam)

    def __enter__(self) -> Self:
        if not self.enabled:
            return self
        seen = set()
        for p in self.params:
            engine, zp = _owner(p)
            if engine is None:
                raise InvalidArgumentError(
                    "zero3.GatheredParameters: a parameter that no live zero3 engine manages")
            if id(p) in seen:
                continue
            seen.add(id(p))
            if engine._passes.pass_open:
                raise IncompatibleError(
                    "zero3.GatheredParameters: inside a pass (between a forward and the end of "
                    "its backward); use it between steps")
            if self.modifier_rank is not None and not 0 <= self.modifier_rank < engine.world_size:
                raise InvalidArgumentError(
                    f"zero3.GatheredParameters: modifier_rank {self.modifier_rank} is not a rank "
                    f"of the {engine.world_size}-rank world")
            self._held.append((engine, zp))
        for engine, zp in self._held:
            full = _gather(engine, zp, zp.orig_dtype)
            with torch.no_grad():
                zp.param.data = full
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        if not self.enabled:
            return False
        try:
            if self.modifier_rank is not None:
                for engine, zp in self._held:
                    with torch.no_grad():
                        flat = zp.param.data.reshape(-1).contiguous()
                        if engine.world_size > 1:
                            engine.comm.broadcast(flat, self.modifier_rank).wait()
                        lo, hi = zp.slice_of(engine.rank)
                        engine.shards_writable()
                        zp.shard.zero_()
                        zp.shard[:hi - lo].copy_(flat[lo:hi])
                    engine.shards_changed()
        finally:
            for engine, zp in self._held:
                with torch.no_grad():
                    zp.param.data = engine._passes.placeholders.get(zp.dtype)
            self._held = []
        return False
