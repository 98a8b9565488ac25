"""Per-parameter state of the zero3 engine (FSDP2's ``FSDPParam`` seam):
where a parameter's shard lives, what the optimizer steps on, the gathered
copy while a module using it runs, and how autograd's saved tensors refer to
that copy.

Three tensors per parameter, one to three distinct memories:

- ``store``: this rank's shard as the coordinator keeps it, in the compute
  dtype (what is gathered): the coordinator's own memory (``direct``), or a
  copy written back with ``set_shard`` (a coordinator without ShardStorage,
  or a shard kept in a file under nvme_path);
- ``shard``: the optimizer's parameter (a ``torch.nn.Parameter``): ``store``
  itself when the master dtype is the compute dtype, else an fp32 master
  copy (mixed precision); its ``.grad`` is the gradient shard;
- ``param.data``: the user's parameter object points at a view of the
  gathered copy while a module using it runs, at an empty placeholder
  otherwise (``materialize``/``dematerialize``).

``Live`` maps addresses to materialised parameters, so that a tensor autograd
saves for backward that lies in a gathered copy (a weight, ``weight.t()``)
is saved as "this view of parameter p" (``SavedView``) and rebuilt over the
copy gathered again for backward: a release in between never leaves autograd
reading freed memory.
"""

import bisect

import torch

from ._memory import type_name


class ZeroParam:
    """One unique parameter of the model and what the engine knows of it."""

    __slots__ = ("id", "name", "param", "shape", "numel", "dtype", "type", "element_size",
                 "shard_numel", "store", "shard", "direct", "full", "full_address", "full_bytes",
                 "view", "users", "persistent", "requires_grad", "accumulated", "orig_dtype")

    def __init__(self, pid, name, param, dtype):
        self.id = pid
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.dtype = dtype  # the compute dtype: of the store and the gathered copy
        self.orig_dtype = param.dtype  # the model's own
        self.type = type_name(dtype, f"parameter '{name}'")
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.requires_grad = param.requires_grad
        self.shard_numel = 0
        self.store = None         # the coordinator's shard (compute dtype)
        self.shard = None         # the optimizer's parameter (master dtype)
        self.direct = False       # store is the coordinator's memory (else a copy)
        self.full = None          # flat tensor over the gathered copy (while materialized)
        self.full_address = 0
        self.full_bytes = 0
        self.view = None          # full[:numel].view(shape)
        self.users = 0            # fetched modules (engine-side) materializing it
        self.persistent = False
        self.accumulated = None   # full gradient summed over micro-batches without sync

    def slice_of(self, rank):
        """[lo, hi) of the flattened parameter held by `rank` (hi may be
        below lo + shard_numel for the last ranks: the rest is padding)."""
        lo = min(rank * self.shard_numel, self.numel)
        return lo, min(lo + self.shard_numel, self.numel)


class SavedView:
    """What the pack hook keeps instead of a view of a gathered copy."""

    __slots__ = ("param", "offset", "size", "stride")

    def __init__(self, param, offset, size, stride):
        self.param = param
        self.offset = offset
        self.size = size
        self.stride = stride


class Live:
    """The materialised parameters, sorted by the address of their copy."""

    def __init__(self):
        self._starts = []
        self._params = []

    def add(self, zp):
        i = bisect.bisect_left(self._starts, zp.full_address)
        self._starts.insert(i, zp.full_address)
        self._params.insert(i, zp)

    def remove(self, zp):
        i = bisect.bisect_left(self._starts, zp.full_address)
        del self._starts[i]
        del self._params[i]

    def owner(self, tensor):
        """The materialised parameter whose gathered copy holds `tensor`'s data."""
        if not self._starts or tensor.numel() == 0:
            return None
        address = tensor.data_ptr()
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        zp = self._params[i]
        return zp if address < zp.full_address + zp.full_bytes else None

    def __len__(self):
        return len(self._starts)


class Placeholders:
    """One empty tensor per dtype: ``param.data`` between uses."""

    def __init__(self, device):
        self._device = device
        self._by_dtype = {}

    def get(self, dtype):
        t = self._by_dtype.get(dtype)
        if t is None:
            t = self._by_dtype[dtype] = torch.empty(0, dtype=dtype, device=self._device)
        return t


def materialize(zp, session, memory, world, live):
    """Points the parameter at its gathered copy (one more user)."""
    if zp.users == 0:
        address = session.full_data(zp.id)
        if address != zp.full_address or zp.full is None:
            numel = world * zp.shard_numel
            zp.full = memory.tensor(address, numel, zp.dtype)
            zp.full_address = address
            zp.full_bytes = numel * zp.element_size
            zp.view = zp.full[:zp.numel].view(zp.shape)
        zp.param.data = zp.view
        live.add(zp)
    zp.users += 1


def dematerialize(zp, placeholders, live):
    """One user fewer; the last one gives the placeholder back."""
    zp.users -= 1
    if zp.users == 0:
        zp.param.data = placeholders.get(zp.dtype)
        live.remove(zp)
        # The copy may be freed now: never touch it again.
        zp.full = None
        zp.view = None
        zp.full_address = 0
