"""Parameter state of the zero3 engine (FSDP2's ``FSDPParam`` /
``FSDPParamGroup`` seam): parameters are partitioned, gathered,
materialised, released and reduced by group.

A ``ParamGroup`` is the unit of all of that: the parameters one hooked
module (a unit, see _units.py) owns. The coordinator knows it as one
parameter (``ParameterGroups`` in the SDK): each member is sharded on its
own (``ceil(numel / world)`` elements a rank, zero-padded, as a parameter
alone would be), this rank's slices lie back to back in one flat shard, and
the gathered copy holds each member whole, back to back. So one collective
moves a group, and every member of the gathered copy is a contiguous view
of it.

Per group, up to three flat tensors:

- ``store``: this rank's flat shard as the coordinator keeps it, in the
  compute dtype (what is gathered): the coordinator's own memory
  (``direct``), or a copy written back with ``set_shard`` (a coordinator
  without ShardStorage, or a shard kept in a file under nvme_path);
- ``master``: the optimizer's flat shard, ``store`` itself when the master
  dtype is the compute dtype, else an fp32 copy (mixed precision);
- ``full``: the gathered copy while a module using the group runs.

Per parameter (``ZeroParam``): ``shard`` (a ``torch.nn.Parameter`` over its
slice of the group's ``master``: what the optimizer steps on; its ``.grad``
is a view of the group's flat gradient shard) and ``store`` (its slice of
the group's store). ``param.data`` is a view of the gathered copy while a
module using it runs, an empty placeholder otherwise.

What the step path in C++ (python/src/unit_passes.cpp, group_gradients.cpp,
saved_views.cpp) reads or writes on every use is owned by C++: a
``ParamGroup`` is a ``_ductile.zero.GroupState`` (python/src/group_state.hpp)
and a ``ZeroParam`` a ``_ductile.zero.MemberState``, whose fields (``users``,
``full``, ``full_address``, ``params``, ``grad_flat``, ``shard``, ...) are
typed properties here. Materialising a group (pointing its parameters at
views of the gathered copy) and releasing it are done by that step path.

The live copies (``_ductile.zero.LiveCopies``, C++) map addresses to
materialised groups, so that a tensor autograd saves for backward that lies
in a gathered copy (a weight, ``weight.t()``) is saved as "this view of
group g" and rebuilt over the copy gathered again for backward: a release
in between never leaves autograd reading freed memory.
"""

from typing import Any

import torch

from ... import _ductile
from ._memory import type_name


class ZeroParam(_ductile.zero.MemberState):
    """One unique parameter of the model and what the engine knows of it;
    ``shard`` and ``requires_grad`` are C++ (MemberState)."""

    def __init__(self, pid, name, param, dtype):
        super().__init__()
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
        self.store = None   # its slice of the group's store (compute dtype)
        self.shard = None   # the optimizer's parameter (master dtype)
        self.group: Any = None  # the ParamGroup it belongs to, set by that group
        self.offset = 0     # of its slice in the group's flat shard

    @property
    def direct(self):
        return self.group.direct

    @property
    def persistent(self):
        return self.group.persistent

    def slice_of(self, rank):
        """[lo, hi) of the flattened parameter held by `rank` (hi may be
        below lo + shard_numel for the last ranks: the rest is padding)."""
        lo = min(rank * self.shard_numel, self.numel)
        return lo, min(lo + self.shard_numel, self.numel)


class ParamGroup(_ductile.zero.GroupState):
    """Parameters gathered, materialised, released and reduced together.
    What the step path uses (``id``, ``name``, ``members``, ``params``,
    ``trained``, ``dtype``, ``sizes``, ``numels``, ``shard_numel``,
    ``full_bytes``, ``users``, ``full``, ``full_address``, ``placeholder``,
    ``views_cache``, ``grad_flat``, ``grad_views``, ``host_grad_views``) is
    C++ (GroupState)."""

    def __init__(self, gid, name, members, world):
        super().__init__()
        self.id = gid
        self.name = name
        self.members = members
        self.params = [zp.param for zp in members]
        first = members[0]
        self.dtype = first.dtype
        self.type = first.type
        self.element_size = first.element_size
        self.world = world
        offset = 0
        for zp in members:
            zp.group = self
            zp.shard_numel = -(-zp.numel // world)
            zp.offset = offset
            offset += zp.shard_numel
        self.shard_numel = offset
        self.numel = sum(zp.numel for zp in members)
        self.sizes = [zp.shard_numel for zp in members]
        self.numels = [zp.numel for zp in members]
        self.trained = [zp for zp in members if zp.requires_grad]
        self.store = None
        self.master = None
        self.direct = False
        self.persistent = False
        self.full_bytes = world * self.shard_numel * self.element_size
        self.accumulated = None  # gradients summed without sync, rank-major (reduce dtype)
        self.accumulated_mask = None
        self.host = None  # its optimizer offload (_offload.HostShard), or None
        self.shard_on_host = False  # the coordinator keeps its shard in host memory

    def views_at(self, memory, address):
        """(full, member views) over the gathered copy at `address` (the step
        path keeps a few, in ``views_cache``)."""
        full = memory.tensor(address, self.world * self.shard_numel, self.dtype)
        pieces = full.split([self.world * s for s in self.sizes])
        views = [piece[:zp.numel].view(zp.shape) for piece, zp in zip(pieces, self.members)]
        return full, views


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

