"""The engine's collectives on tensors, over one of two worlds:

- ``SessionCollectives``: the accelerator's own world communicator (Open MPI
  on cpu, NCCL on cuda, or a single process), through the C++ session;
- ``TorchWorld`` (_torch_world.py): torch.distributed's process group, the
  host framework's communicator, which the C++ coordinator also uses for
  its gathers.

Both give the same calls: ``all_gather(out, inp)``, ``reduce_scatter(out,
inp, op)``, ``all_reduce(tensor, op)`` (in place), ``broadcast(tensor,
root)``, each returning a handle with ``query()`` (never blocks) and
``wait()``; and ``barrier()`` (blocking). Tensors are contiguous and on the
world's device; ops are "sum", "min", "max". Every rank issues the same
collectives in the same order (the engine's and the coordinator's share one
order: both are issued from the training thread).
"""

import torch

from ... import _ductile
from ._memory import type_name


class _Held:
    """A session collective's handle that keeps its tensors alive until it
    is waited for (the C++ side holds only their addresses)."""

    __slots__ = ("_pending", "_tensors")

    def __init__(self, pending, *tensors):
        self._pending = pending
        self._tensors = tensors

    def query(self):
        return self._pending.query()

    def wait(self):
        self._pending.wait()
        self._tensors = ()


class SessionCollectives:
    def __init__(self, session, device):
        self._session = session
        self.device = device
        self.rank = session.rank
        self.size = session.size
        self.kind = "accelerator"

    def all_gather(self, out, inp):
        return _Held(self._session.all_gather(inp.data_ptr(), out.data_ptr(), inp.numel(),
                                              type_name(inp.dtype, "an all_gather tensor")),
                     out, inp)

    def reduce_scatter(self, out, inp, op="sum"):
        return _Held(self._session.reduce_scatter(
            inp.data_ptr(), out.data_ptr(), out.numel(),
            type_name(inp.dtype, "a reduce_scatter tensor"), op), out, inp)

    def all_reduce(self, tensor, op="sum"):
        return _Held(self._session.all_reduce(tensor.data_ptr(), tensor.data_ptr(),
                                              tensor.numel(),
                                              type_name(tensor.dtype, "an all_reduce tensor"),
                                              op), tensor)

    def broadcast(self, tensor, root=0):
        return _Held(self._session.broadcast(tensor.data_ptr(), tensor.numel(),
                                             type_name(tensor.dtype, "a broadcast tensor"),
                                             root), tensor)

    def barrier(self):
        self._session.barrier()


class _Done(_ductile.zero.HostWork):
    """The handle of a collective that needed no communication."""

    __slots__ = ()

    def query(self):
        return True

    def wait(self):
        return None


Done = _Done()


def gather_bytes(comm, data):
    """Every rank's `data` (bytes of any length), by rank. Collective."""
    if comm.size == 1:
        return [bytes(data)]
    device = comm.device
    lengths = torch.zeros(comm.size, dtype=torch.int64, device=device)
    comm.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device)).wait()
    lengths = lengths.cpu()
    count = int(lengths.max())
    send = torch.zeros(max(count, 1), dtype=torch.uint8)
    if data:
        send[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    send = send.to(device)
    recv = torch.empty(comm.size * send.numel(), dtype=torch.uint8, device=device)
    comm.all_gather(recv, send).wait()
    raw = recv.cpu().numpy().tobytes()
    n = send.numel()
    return [raw[r * n:r * n + int(lengths[r])] for r in range(comm.size)]
