"""torch.distributed's process group as zero3's world communicator: the
host framework supplies the communication (issue 22, item 4), so a job
started by torchrun (gloo on cpu, NCCL on cuda) needs no MPI.

``TorchWorld`` serves two callers:

- the C++ coordinator, through the accelerator's host world
  (``HostWorld::offer_world``; python/src/host_world.cpp): its collectives
  arrive as addresses, byte counts and element type names (``*_at`` calls),
  wrapped here into tensors over that memory without copying;
- the engine (gradients, checkpoints, all_reduce), on tensors (the calls of
  _collectives.py).

Each call issues the collective at once, asynchronously, on the calling
thread, and returns a ``Work`` with ``query()`` and ``wait()``. A coalesced
gather packs the inputs into one byte buffer, runs one all-gather and
unpacks the result into each output when the work completes (``query()``
seeing it done, or ``wait()``), as the accelerators' own communicators do.
Packing buffers come from a free list keyed by size, so a trace of gathers
reuses the same memory every pass.

Stream semantics (cpu): the collective runs on gloo's threads; its output
is complete when the work is. (cuda): torch's NCCL process group orders
the collective after torch's current stream at the call and ``wait()``
makes the current stream wait for it; see the engine's stream notes.
"""

import torch
import torch.distributed as dist

from ... import _ductile
from ..._errors import InvalidArgumentError
from ._collectives import Done

_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8,
}
_SIZES = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in _DTYPES.items()}
_PACK_LIMIT = 256 << 10  # bytes of a tensor gathered alone rather than packed
_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
        "prod": dist.ReduceOp.PRODUCT}

# torch 2.13 names them *_single; earlier releases *_into_tensor / *_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Work:
    """A collective in flight; `finish` (optional) runs once, when it is
    seen complete, before query() returns True or wait() returns."""

    __slots__ = ("_work", "_finish", "_done")

    def __init__(self, work, finish=None):
        self._work = work
        self._finish = finish
        self._done = False

    def query(self):
        if self._done:
            return True
        if not self._work.is_completed():
            return False
        self.wait()
        return True

    def wait(self):
        if self._done:
            return
        self._work.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._done = True


class _Works:
    """Several collectives seen as one."""

    __slots__ = ("_works",)

    def __init__(self, works):
        self._works = works

    def query(self):
        return all(w.query() for w in self._works)

    def wait(self):
        for w in self._works:
            w.wait()


class _Buffers:
    """Byte buffers for packing, reused by size."""

    def __init__(self, device):
        self._device = device
        self._free = {}

    def take(self, nbytes):
        stack = self._free.get(nbytes)
        if stack:
            return stack.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=self._device)

    def give(self, buffer):
        self._free.setdefault(buffer.numel(), []).append(buffer)


class TorchWorld:
    """The default process group (or `group`) as a world communicator."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgumentError(
                "zero3: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() first (torchrun sets the environment "
                "for env://)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.kind = f"torch.distributed ({self.backend})"
        if "nccl" in self.backend:
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._buffers = _Buffers(self.device)
        self._root = {}  # group rank -> global rank (broadcast takes a global one)

    # --- tensors over the coordinator's memory ------------------------------------

    def _at(self, address, numel, dtype_name):
        dtype = _DTYPES[dtype_name]
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=self.device)
        if self.device.type == "cpu":
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            return torch.frombuffer(_ductile.zero.host_view(address, nbytes), dtype=dtype)
        from ._memory import DeviceMemory
        return DeviceMemory("cuda", self.device).tensor(address, numel, dtype)

    def all_gather_at(self, send, recv, count, dtype):
        out = self._at(recv, count * self.size, dtype)
        inp = self._at(send, count, dtype)
        if inp.data_ptr() == out[self.rank * count:].data_ptr():
            inp = inp.clone()  # in place: the collective must not read what it writes
        return self.all_gather(out, inp)

    def all_gather_coalesced_at(self, items):
        """Large tensors are gathered straight into their outputs (packing
        them would copy each twice and hold a second copy of the result);
        the small ones together, packed into one byte buffer."""
        if len(items) == 1:
            return self.all_gather_at(*items[0])
        works, small = [], []
        for item in items:
            send, recv, count, dtype = item
            if count * _SIZES[dtype] >= _PACK_LIMIT:
                works.append(self.all_gather_at(*item))
            else:
                small.append(item)
        if len(small) == 1:
            works.append(self.all_gather_at(*small[0]))
        elif small:
            works.append(self._packed_gather(small))
        return works[0] if len(works) == 1 else _Works(works)

    def _packed_gather(self, items):
        pieces = [(self._at(send, count, dtype).view(torch.uint8),
                   self._at(recv, count * self.size, dtype).view(torch.uint8))
                  for send, recv, count, dtype in items]
        total = sum(inp.numel() for inp, _ in pieces)
        packed = self._buffers.take(total)
        gathered = self._buffers.take(total * self.size)
        offset = 0
        for inp, _ in pieces:
            packed[offset:offset + inp.numel()].copy_(inp)
            offset += inp.numel()
        work = _all_gather(gathered, packed, group=self.group, async_op=True)

        def unpack():
            rows = gathered.view(self.size, total)
            at = 0
            for inp, out in pieces:
                n = inp.numel()
                out.view(self.size, n).copy_(rows[:, at:at + n])
                at += n
            self._buffers.give(packed)
            self._buffers.give(gathered)
        return Work(work, unpack)

    def reduce_scatter_at(self, send, recv, count, dtype, op):
        return self.reduce_scatter(self._at(recv, count, dtype),
                                   self._at(send, count * self.size, dtype), op)

    def all_reduce_at(self, send, recv, count, dtype, op):
        out = self._at(recv, count, dtype)
        if send != recv:
            out.copy_(self._at(send, count, dtype))
        return self.all_reduce(out, op)

    def broadcast_at(self, buffer, count, dtype, root):
        return self.broadcast(self._at(buffer, count, dtype), root)

    def barrier_async(self):
        return Work(dist.barrier(group=self.group, async_op=True))

    # --- tensors (the engine's calls) -----------------------------------------------

    def all_gather(self, out, inp):
        if self.size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return Done
        return Work(_all_gather(out, inp, group=self.group, async_op=True))

    def reduce_scatter(self, out, inp, op="sum"):
        if self.size == 1:
            out.copy_(inp)
            return Done
        return Work(_reduce_scatter(out, inp, op=_OPS[op], group=self.group, async_op=True))

    def all_reduce(self, tensor, op="sum"):
        if self.size == 1:
            return Done
        return Work(dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True))

    def broadcast(self, tensor, root=0):
        if self.size == 1:
            return Done
        src = self._root.get(root)
        if src is None:
            src = self._root[root] = dist.get_global_rank(self.group, root) \
                if self.group is not None else root
        return Work(dist.broadcast(tensor, src=src, group=self.group, async_op=True))

    def barrier(self):
        if self.size > 1:
            dist.barrier(group=self.group)
