"""Partitioned construction: no rank ever holds the whole model.

``with zero3.init(): model = Model(...)`` builds the model with each
parameter initialised directly into this rank's shard, with the values the
unsharded model gets from the same seed:

- when a module registers a parameter, the parameter is replaced by one on
  the meta device (full shape, no memory) and this rank keeps only its
  slice of the values the parameter was created with (``ceil(numel /
  world)`` elements, as the coordinator partitions it);
- an in-place write to such a parameter or a view of it (``uniform_`` of
  ``reset_parameters``, ``normal_``/``zeros_`` of Hugging Face's
  ``_init_weights``, ``fill_``, ``copy_`` from a real tensor, ``mul_``) runs
  on a transient full tensor holding this rank's slice, so it draws exactly
  the random numbers the eager model draws, and the rank keeps its slice of
  the result. At most one parameter is whole at a time.

Limits: an init that reads elements outside the element it writes
(``orthogonal_``) or that skips meta tensors (``trunc_normal_``) does not
give the eager values; out-of-place reads of a parameter during
construction give meta tensors. The world size and rank come from
torch.distributed when it is initialised, else from the launcher's
environment (mpirun, torchrun), and must be the engine's.

``zero3.initialize(model, ..., load_from=path)`` fills the shards of a
model built on the meta device (or under ``zero3.init``) from Hugging Face
safetensors files (one file, a folder with ``model.safetensors`` or a
sharded ``model.safetensors.index.json``): each rank reads only the rows
holding its slice of each parameter.
"""

import json
import os
import weakref
from typing import Any, Literal, Self

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..._errors import IncompatibleError, InvalidArgumentError, IoError

_INIT = "_ductile_zero3_init"


class InitShard:
    """This rank's slice of a parameter built under zero3.init."""

    __slots__ = ("values", "numel", "world", "rank", "lo", "hi", "dtype", "__weakref__")

    def __init__(self, numel, dtype, world, rank):
        self.numel = numel
        self.world = world
        self.rank = rank
        self.dtype = dtype
        shard = -(-numel // world)
        self.lo = min(rank * shard, numel)
        self.hi = min(self.lo + shard, numel)
        self.values = torch.zeros(shard, dtype=dtype)

    def take(self, full):
        self.values[:self.hi - self.lo].copy_(full.reshape(-1)[self.lo:self.hi])

    def whole(self):
        """A transient full tensor holding this rank's slice (zeros elsewhere)."""
        full = torch.zeros(self.numel, dtype=self.dtype)
        full[self.lo:self.hi] = self.values[:self.hi - self.lo]
        return full


def shard_of(param):
    return getattr(param, _INIT, None)


def launch_world():
    """(world size, rank) of this process: torch.distributed, else the launcher."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    for size, rank in (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("PMI_SIZE", "PMI_RANK"),
                       ("WORLD_SIZE", "RANK")):
        if os.environ.get(size) and os.environ.get(rank):
            return int(os.environ[size]), int(os.environ[rank])
    return 1, 0


def _writes_first_argument(func):
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


class _Mode(TorchDispatchMode):
    """Runs in-place writes to partitioned parameters on transient full tensors."""

    def __init__(self, owners):
        super().__init__()
        self._owners = owners  # meta storage id -> InitShard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if (isinstance(target, torch.Tensor) and target.is_meta and self._owners
                and _writes_first_argument(func)):
            shard = self._owners.get(target.untyped_storage()._cdata)
            if shard is not None:
                return self._write(func, target, shard, args, kwargs)
        return func(*args, **kwargs)

    def _write(self, func, target, shard, args, kwargs):
        for a in list(args[1:]) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a.is_meta:
                raise IncompatibleError(
                    f"zero3.init: {func} writes a partitioned parameter from another meta "
                    "tensor (a partitioned parameter's values are not available during "
                    "construction); initialise it from real values")
        full = shard.whole()
        real = full.as_strided(target.size(), target.stride(), target.storage_offset())
        func(real, *args[1:], **kwargs)
        shard.take(full)
        return target


class init:  # noqa: N801 - used as a context manager, like torch.no_grad
    """``with zero3.init(): model = Model(...)``: see the module's docstring."""

    def __init__(self, world_size: int | None = None, rank: int | None = None) -> None:
        detected = launch_world()
        self.world_size = detected[0] if world_size is None else world_size
        self.rank = detected[1] if rank is None else rank
        if not (isinstance(self.world_size, int) and isinstance(self.rank, int)
                and 0 <= self.rank < self.world_size):
            raise InvalidArgumentError(
                f"zero3.init: rank {self.rank!r} of world size {self.world_size!r} is not valid")
        self._owners: dict[int, InitShard] = {}  # meta storage id -> this rank's slice
        # torch's hook handle and dispatch mode, set by __enter__
        self._handle: Any = None
        self._mode: Any = None

    def _register(self, module, name, param):
        if param is None or shard_of(param) is not None or param.is_meta:
            return None
        shard = InitShard(param.numel(), param.dtype, self.world_size, self.rank)
        with torch.no_grad():
            shard.take(param.detach())
        meta = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                  requires_grad=param.requires_grad)
        setattr(meta, _INIT, shard)
        self._owners[meta.untyped_storage()._cdata] = shard
        # The storage id may be reused once the parameter dies: forget it then.
        owners, key = self._owners, meta.untyped_storage()._cdata
        weakref.finalize(meta, owners.pop, key, None)
        return meta

    def __enter__(self) -> Self:
        self._handle = torch.nn.modules.module.register_module_parameter_registration_hook(
            self._register)
        self._mode = _Mode(self._owners)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self._mode.__exit__(*exc)
        self._handle.remove()
        self._owners.clear()
        return False


# --- safetensors --------------------------------------------------------------------


def _safetensors_files(path):
    """{tensor name: file} of a safetensors file or folder."""
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise IoError(f"{index}: not a safetensors index: {e}") from e
            return {k: os.path.join(path, v) for k, v in weight_map.items()}
        single = os.path.join(path, "model.safetensors")
        if not os.path.isfile(single):
            raise IoError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
        path = single
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt") as f:
            return {k: path for k in f.keys()}
    except (OSError, ValueError, RuntimeError) as e:
        raise IoError(f"{path}: not a safetensors file: {e}") from e


class SafetensorsSource:
    """Reads each parameter's slice [lo, hi) of the flattened tensor, row by row."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.files = _safetensors_files(path)
        self._open = {}

    def _handle(self, file):
        from safetensors import safe_open
        f = self._open.get(file)
        if f is None:
            f = self._open[file] = safe_open(file, framework="pt")
        return f

    def close(self):
        self._open.clear()

    def key_for(self, names):
        for name in names:
            if name in self.files:
                return name
        return None

    def read(self, key, shape, lo, hi):
        f = self._handle(self.files[key])
        sl = f.get_slice(key)
        stored = tuple(sl.get_shape())
        if stored != tuple(shape):
            raise IncompatibleError(
                f"{self.files[key]}: '{key}' has shape {list(stored)}, the model's parameter "
                f"{list(shape)}")
        if hi <= lo:
            return torch.empty(0)
        if len(stored) <= 1:
            return sl[lo:hi].reshape(-1)
        row = 1
        for d in stored[1:]:
            row *= d
        r0, r1 = lo // row, (hi - 1) // row + 1
        rows = sl[r0:r1].reshape(-1)
        return rows[lo - r0 * row:hi - r0 * row]
