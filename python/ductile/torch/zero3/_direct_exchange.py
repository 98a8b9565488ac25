"""All-gather and reduce-scatter over gloo by direct exchange: each rank
sends its piece to every other rank and receives theirs straight into the
output (``ProcessGroup.send`` / ``recv``), instead of gloo's collectives.

Why: gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` stage
through a flat buffer of the whole output that they allocate on every call
and copy through twice, on gloo's worker thread. For a large group that
costs more than the bytes' transfer: on 2 ranks of this project's CPU
machine (2 cores), gathering 66 MB took 74 ms as one collective and 20 ms as
one exchange (a send and a receive a rank), and that buffer, allocated at
the end of backward, was part of the step's peak memory
(tests/benchmarks/python/bench_zero3.py, docs/benchmarks.md). An exchange sends
the same bytes a ring does, (ranks - 1) pieces a rank.

Where: TorchWorld uses it on gloo up to ``MAX_RANKS`` ranks (each rank
then keeps (ranks - 1) sends and receives in flight); NCCL's collectives
run on the device and are kept. A gather's messages are issued by one C++
function (``issue_direct_gather`` in python/src/host_world.cpp), which the
C++ host world's planned gathers call too, with ``TAG``.

Order: messages between two ranks with one tag are matched in the order
they were posted, so every rank posts its exchanges in the same order, as
with collectives (the engine's and the coordinator's all come from the
training thread). Gathers and reduce-scatters use tags of their own; a
user's point-to-point messages on the same group must not use them.

Completion: gloo reports a send or receive complete only once it has been
waited for, so ``query()`` is true only after ``wait()``: a poller sees the
exchange in flight until it waits, and the wait then returns at once when
the bytes are in.
"""

from collections.abc import Sequence
from typing import Any

import torch

from ... import _ductile

# Ranks up to which TorchWorld exchanges directly on gloo. Beyond, gloo's
# ring keeps 2 messages in flight a rank instead of 2 x (ranks - 1).
MAX_RANKS = 8
# gloo's point-to-point tags of the gathers (the C++ host world's planned
# gathers get it as TorchWorld.direct_tag) and of the reduce-scatters.
TAG = 0x64756374
REDUCE_SCATTER_TAG = TAG + 1


class _Exchange(_ductile.zero.HostWork):
    """Messages in flight: complete once each was waited for."""

    __slots__ = ("_works", "_done")
    _works: Sequence[Any]  # emptied once waited for
    _done: bool

    def query(self):
        return self._done

    def wait(self):
        if self._done:
            return
        for work in self._works:
            work.wait()
        self._works = ()
        self._done = True


class DirectGather(_Exchange):
    """``out`` (ranks x n elements) gets every rank's ``inp`` (n elements)
    in rank order; issued at once, complete after ``wait()``. The messages
    are issued in C++ (``_ductile.zero.direct_gather``, which the C++ host
    world's planned gathers call too)."""

    __slots__ = ()

    def __init__(self, group, rank, size, out, inp):
        _ductile.zero.HostWork.__init__(self)
        works = _ductile.zero.direct_gather(group, rank, size, out, inp, TAG)
        self._works = works
        self._done = not works


class DirectReduceScatter(_Exchange):
    """``out`` (n elements) gets the sum over ranks of their ``inp`` slice
    ``rank`` (``inp``: ranks x n elements, each rank's slice sent to it);
    the other ranks' slices arrive in buffers of their own and are added
    by ``wait()``. ``inp`` must stay unchanged until then."""

    __slots__ = ("_received", "_mine", "_out")
    _received: Sequence[torch.Tensor]  # emptied once added

    def __init__(self, group, rank, size, out, inp):
        _ductile.zero.HostWork.__init__(self)
        n = out.numel()
        works, received = [], []
        for k in range(1, size):
            dst = (rank + k) % size
            works.append(group.send([inp[dst * n:(dst + 1) * n]], dst, REDUCE_SCATTER_TAG))
            buffer = torch.empty_like(out)
            works.append(group.recv([buffer], (rank - k) % size, REDUCE_SCATTER_TAG))
            received.append(buffer)
        self._works = works
        self._received = received
        self._mine = inp[rank * n:(rank + 1) * n]
        self._out = out
        self._done = False

    def wait(self):
        if self._done:
            return
        _Exchange.wait(self)
        received = self._received
        torch.add(self._mine, received[0], out=self._out)
        for buffer in received[1:]:
            self._out.add_(buffer)
        self._received = ()
        self._mine = self._out = None
