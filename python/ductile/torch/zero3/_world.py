"""The world zero3 runs on: the ranks, their collectives (torch.distributed's process group, or
the accelerator's own), the direct exchange between ranks, and device memory."""

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ... import _ductile
from ..._errors import InvalidArgumentError, UnsupportedError

# Tensors over memory the C++ coordinator owns, without copying: host memory (the cpu backend's,
# or a shard kept on the host) through ``torch.frombuffer``, cuda memory through
# ``__cuda_array_interface__``. The tensors never own the memory; whoever makes one keeps it only
# while the coordinator keeps the buffer (see materialize and dematerialize in _param.py).

# torch dtype -> (ductile element type name, __cuda_array_interface__ typestr)
_TYPES = {
    torch.float32: ("float32", "<f4"),
    torch.float64: ("float64", "<f8"),
    torch.float16: ("float16", "<f2"),
    torch.bfloat16: ("bfloat16", "<u2"),  # no typestr for bf16: carried as raw 16-bit words
    torch.int32: ("int32", "<i4"),
    torch.int64: ("int64", "<i8"),
    torch.uint8: ("uint8", "|u1"),
}

_ELEMENT_SIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _TYPES}


def type_name(dtype, what):
    """ductile's name for a torch dtype; InvalidArgumentError naming `what`
    for a type the collectives cannot carry."""
    entry = _TYPES.get(dtype)
    if entry is None:
        valid = ", ".join(str(t) for t in _TYPES)
        raise InvalidArgumentError(
            f"zero3: {what} has dtype {dtype}, which cannot be partitioned; valid: {valid}")
    return entry[0]


class _CudaArray:
    """A minimal __cuda_array_interface__ holder for torch.as_tensor."""

    def __init__(self, address, numel, typestr):
        self.__cuda_array_interface__ = {
            "data": (address, False), "shape": (numel,), "typestr": typestr, "version": 2,
            "strides": None}


class DeviceMemory:
    """Makes flat tensors over the coordinator's memory on its backend."""

    def __init__(self, backend, device=None):
        self.backend = backend
        if backend == "cpu":
            self.device = torch.device("cpu")
        elif backend == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device()) \
                if device is None else torch.device(device)
        else:
            raise UnsupportedError(
                f"zero3: the {backend} accelerator is not supported from PyTorch; valid: cpu, "
                "cuda")

    def tensor(self, address, numel, dtype):
        """A 1-D tensor of `numel` elements of `dtype` at `address`."""
        if self.backend == "cpu":
            return self.host_tensor(address, numel, dtype)
        typestr = _TYPES[dtype][1]
        t = torch.as_tensor(_CudaArray(address, numel, typestr), device=self.device)
        return t.view(dtype) if dtype == torch.bfloat16 else t

    @staticmethod
    def host_tensor(address, numel, dtype):
        """A 1-D cpu tensor of `numel` elements of `dtype` over the
        coordinator's host memory at `address`."""
        view = _ductile.zero.host_view(address, numel * _ELEMENT_SIZE[dtype])
        return torch.frombuffer(view, dtype=dtype)


# The engine's collectives, the same calls over either world (``SessionCollectives``: the
# accelerator's own, through the C++ coordinator, ``_ductile.zero.Session``; ``TorchWorld``:
# torch.distributed's process group):
# ``all_gather(out, inp)``, ``reduce_scatter(out, inp, op)``, ``all_reduce(tensor, op)`` (in
# place), ``broadcast(tensor, root)``, each returning a handle with ``query()`` (never blocks) and
# ``wait()``; and ``barrier()``. Every rank issues the same collectives in the same order (the
# engine's and the coordinator's are all issued from the training thread).


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


# All-gather and reduce-scatter over gloo by direct exchange (docs/zero3.md, "The world"): each
# rank sends its piece to every other rank and receives theirs straight into the output. Why:
# gloo's collectives stage through a flat buffer of the whole output, allocated on every call and
# copied through twice; on 2 ranks of a 2-core machine, gathering 66 MB took 74 ms as one
# collective and 20 ms as one exchange, and that buffer was part of the step's peak memory
# (tests/benchmarks/python/bench_zero3.py). Messages between two ranks with one tag match in the
# order they were posted, so every rank posts its exchanges in the same order, as with
# collectives; a user's point-to-point messages on the group must not use these tags. gloo reports
# a send or receive complete only once it was waited for, so ``query()`` is true only after
# ``wait()``.

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


# torch.distributed's process group as zero3's world (docs/zero3.md, "The world"). ``TorchWorld``
# serves the C++ coordinator, as a ``_ductile.zero.HostCommunicator`` (python/src/host_world.cpp)
# whose collectives arrive as addresses (``*_at`` calls) and are wrapped into tensors over that
# memory, cached by address since the coordinator reuses a few buffers; on host streams a
# coalesced gather is planned here once (``gather_plan``) and issued from C++ after that. It also
# serves the engine (gradients, checkpoints, all_reduce), on tensors.
#
# Stream semantics. cpu: the collective runs on gloo's threads; its output (copied out) is
# complete when the work is. cuda: the coordinator passes the stream it issues on (a
# ``cudaStream_t`` as an int); the collective is ordered after that stream's work, the stream's
# later work after the collective (``Work.wait()`` there, a device-side wait) and the copy-out
# runs on it, so the coordinator's event recorded on the stream marks the end and the host never
# waits. The engine's own collectives on cuda are ordered after torch's current stream by torch
# itself, and ``wait()`` makes the current stream wait for them.

_DTYPES = {name: dtype for dtype, (name, _) in _TYPES.items()}
_SIZES = {name: _ELEMENT_SIZE[dtype] for name, dtype in _DTYPES.items()}
_CACHE_LIMIT = 4096  # tensors and gather plans kept by address before the caches start over
# Small groups of one coalesced gather (a prefetch of several) are packed
# into one collective: a group whose gathered bytes are under
# _SMALL_GROUP_BYTES costs more in the collective's round trip than in its
# bytes. A larger group goes alone, straight into its place: packing it
# would add a copy in and a buffer the size of the pack, and save nothing.
# _PACK_LIMIT bounds the bytes a rank sends in one pack.
_SMALL_GROUP_BYTES = 4 << 20
_PACK_LIMIT = 16 << 20
# With direct exchanges, a group's member of _ALONE_BYTES gathered or more
# is exchanged alone, straight into its place: the group's scratch buffer
# and its copy-out then hold only the small members (a message pair a peer
# costs less than copying a member this size twice; its smaller neighbours
# stay together).
_ALONE_BYTES = 1 << 20
_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
        "prod": dist.ReduceOp.PRODUCT}

# torch 2.13 names them *_single; earlier releases *_into_tensor / *_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Under in-place recovery (_rejoin.py): a callable that raises
# CommunicationError once a newer round's notice arrived. A collective of
# the old round that waits only for live peers (a ring's neighbour) would
# otherwise wait for the group's timeout after the others left for the new
# round; with it, its wait polls the work and the notice instead.
superseded: Any = None
_POLL_S = 0.0002
_CHECK_EVERY = 50  # polls between two looks at the notice (one stat each)


def _wait_unless_superseded(work):
    polls = 0
    while not work.is_completed():
        polls += 1
        if polls % _CHECK_EVERY == 0 and superseded is not None:
            superseded()
        time.sleep(_POLL_S)


class Work(_ductile.zero.HostWork):
    """A collective in flight; `finish` (optional) runs once, when it is
    seen complete, before query() returns True or wait() returns."""

    __slots__ = ("_work", "_finish", "_done")

    def __init__(self, work, finish=None):
        _ductile.zero.HostWork.__init__(self)
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
        if superseded is not None:
            _wait_unless_superseded(self._work)
        self._work.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._done = True


class _OnStream(_ductile.zero.HostWork):
    """Collectives already ordered on a cuda stream (their copy-outs too):
    done when the event recorded after them is."""

    __slots__ = ("_event",)

    def __init__(self, stream):
        _ductile.zero.HostWork.__init__(self)
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def query(self):
        return self._event.query()

    def wait(self):
        self._event.synchronize()


def _run(world, runs):
    """The GatherRun of consecutive items of a coalesced gather that are one
    parameter group: their sends back to back (the group's shard), their
    outputs back to back, each `size` elements a rank; or of several groups
    of one dtype packed together (`sends`: their shards, copied in back to
    back)."""
    items = [item for run in runs for item in run]
    dtype = items[0][3]
    sizes = [count for _, _, count, _ in items]
    total = sum(sizes)
    send = sends = recv = outs = None
    if len(runs) == 1:
        send = world._at(items[0][0], total, dtype)
        recv = world._at(items[0][1], total * world.size, dtype)
    else:
        sends = [world._at(run[0][0], sum(c for _, _, c, _ in run), dtype) for run in runs]
    if len(items) > 1 and world.size > 1:
        outs = [world._at(place, count * world.size, dtype).view(world.size, count)
                for _, place, count, _ in items]
    return _ductile.zero.GatherRun(send=send, sends=sends, recv=recv, outs=outs, sizes=sizes,
                                   total=total)


def _packed(runs, limit, size, member_alone=None):
    """Groups of runs gathered by one collective each: small runs of one
    dtype together (within `limit` bytes a rank), a larger one (gathered,
    _SMALL_GROUP_BYTES or more, or a single member of `member_alone` or
    more) alone; each alone on one rank (no collective to save)."""
    if size == 1:
        return [[run] for run in runs]
    out: list[list] = []
    small: list = []
    small_bytes = 0
    for run in runs:
        dtype = run[0][3]
        nbytes = sum(count for _, _, count, _ in run) * _SIZES[dtype]
        if nbytes * size >= _SMALL_GROUP_BYTES or nbytes > limit or \
                (member_alone is not None and len(run) == 1 and nbytes * size >= member_alone):
            out.append([run])
            continue
        if small and (small[0][0][3] != dtype or small_bytes + nbytes > limit):
            out.append(small)
            small, small_bytes = [], 0
        small.append(run)
        small_bytes += nbytes
    if small:
        out.append(small)
    return out


def _members_alone(runs, size, threshold):
    """Runs with each member of `threshold` gathered bytes or more split
    out as a run of its own."""
    out = []
    for run in runs:
        current: list = []
        for item in run:
            if len(run) > 1 and item[2] * size * _SIZES[item[3]] >= threshold:
                if current:
                    out.append(current)
                    current = []
                out.append([item])
            else:
                current.append(item)
        if current:
            out.append(current)
    return out


def _runs(items, size):
    """Splits coalesced items into runs of back-to-back members."""
    runs: list[list] = []
    current: list = []
    for item in items:
        if current:
            send, recv, count, dtype = current[-1]
            step = count * _SIZES[dtype]
            if not (item[3] == dtype and item[0] == send + step and item[1] == recv + size * step):
                runs.append(current)
                current = []
        current.append(item)
    if current:
        runs.append(current)
    return runs


class TorchWorld(_ductile.zero.HostCommunicator):
    """The default process group (or `group`) as a world communicator.
    rank, size, kind, group, direct_exchange and direct_tag are the C++
    base's (read-only)."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgumentError(
                "zero3: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() first (torchrun sets the environment "
                "for env://)")
        self.backend = str(dist.get_backend(group))
        if "nccl" in self.backend:
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        size = dist.get_world_size(group)
        # direct_exchange: gathers (the C++ host world's planned ones too, with direct_tag) and
        # sum reduce-scatters by direct exchange. The default group (None) is looked up at each
        # call, never held: a ProcessGroup kept alive past destroy_process_group() outlives the
        # interpreter, and a gloo thread dropping its tensors then aborts the process.
        _ductile.zero.HostCommunicator.__init__(
            self, rank=dist.get_rank(group), size=size,
            kind=f"torch.distributed ({self.backend})", group=group,
            gather_collective=_all_gather,
            direct_exchange=self.device.type == "cpu" and "gloo" in self.backend and
            1 < size <= MAX_RANKS,
            direct_tag=TAG)
        self._memory = DeviceMemory(self.device.type, self.device)
        # The engine's calls done by exchange (the C++ host world counts its
        # own: stats()["host_world_exchanges"]).
        self.exchanges = {"all_gather": 0, "reduce_scatter": 0}
        self._root = {}     # group rank -> global rank (broadcast takes a global one)
        self._tensors = {}  # (address, numel, dtype) -> tensor over that memory
        self._plans = {}    # coalesced gather items -> [GatherRun]
        self._streams = {}  # cudaStream_t -> torch.cuda.ExternalStream

    # --- tensors over the coordinator's memory ------------------------------------

    def _at(self, address, numel, dtype_name):
        key = (address, numel, dtype_name)
        t = self._tensors.get(key)
        if t is not None:
            return t
        dtype = _DTYPES[dtype_name]
        if numel == 0:
            t = torch.empty(0, dtype=dtype, device=self.device)
        else:
            t = self._memory.tensor(address, numel, dtype)
        if len(self._tensors) >= _CACHE_LIMIT:
            self._tensors.clear()
        self._tensors[key] = t
        return t

    def _stream(self, handle):
        s = self._streams.get(handle)
        if s is None:
            s = self._streams[handle] = torch.cuda.ExternalStream(handle, device=self.device)
        return s

    def _on(self, stream, issue):
        """Runs `issue()` (returning torch works) ordered on the cuda stream
        `stream` (see the module's notes), or as it is (stream None)."""
        if stream is None:
            return issue()
        s = self._stream(stream)
        with torch.cuda.stream(s):
            work = issue()
            work.wait()
            return _OnStream(s)

    def all_gather_at(self, send, recv, count, dtype, stream=None):
        out = self._at(recv, count * self.size, dtype)
        inp = self._at(send, count, dtype)
        if send == recv + self.rank * count * _SIZES[dtype] and not self.direct_exchange:
            inp = inp.clone()  # in place: the collective must not read what it writes
        return self._on(stream, lambda: self.all_gather(out, inp))

    def _packing(self, runs):
        """The collectives of a coalesced gather's runs (see _packed); with
        direct exchanges, large members alone (_ALONE_BYTES)."""
        if not self.direct_exchange:
            return _packed(runs, _PACK_LIMIT, self.size)
        return _packed(_members_alone(runs, self.size, _ALONE_BYTES), _PACK_LIMIT, self.size,
                       _ALONE_BYTES)

    def _plan(self, items):
        """The runs of a coalesced gather of `items`, made once per items."""
        key = tuple(items)
        runs = self._plans.get(key)
        if runs is None:
            runs = [_run(self, packed) for packed in self._packing(_runs(items, self.size))]
            if len(self._plans) >= _CACHE_LIMIT:
                self._plans.clear()
            self._plans[key] = runs
        return runs

    def all_gather_coalesced_at(self, items, stream):
        """One all-gather a run of back-to-back members (a parameter
        group), straight into the output for a single member or one rank,
        else into a scratch buffer copied out into the members' places;
        ordered on the cuda stream `stream`. On host streams the C++ host
        world issues these gathers itself (gather_plan)."""
        if len(items) == 1:
            send, recv, count, dtype = items[0]
            return self.all_gather_at(send, recv, count, dtype, stream)
        s = self._stream(stream)
        with torch.cuda.stream(s):
            for run in self._plan(items):
                self._gather_run(run).wait()
            return _OnStream(s)

    # The C++ host world (python/src/host_world.cpp) issues coalesced
    # gathers on host streams (cpu) itself, from the plan made here the
    # first time it sees their items, with gather_collective on `group`
    # (or, with direct_exchange, by sends and receives on it): the
    # coordinator gathers the same groups into the same buffers every
    # pass, so no Python function of ductile's runs.
    def gather_plan(self, items):
        """How to gather coalesced `items` (see all_gather_coalesced_at):
        a GatherRun per collective (see _run); `clone`: a single item
        gathered in place, whose send the collective must not read while it
        writes."""
        if len(items) == 1:
            send, recv, count, dtype = items[0]
            clone = send == recv + self.rank * count * _SIZES[dtype] and \
                not self.direct_exchange  # an exchange sends from the output itself
            return [_ductile.zero.GatherRun(send=self._at(send, count, dtype),
                                            recv=self._at(recv, count * self.size, dtype),
                                            total=count, clone=clone)]
        return self._plan(items)

    def _gather_run(self, run):
        send = run.send
        if send is None:  # several groups: their shards copied in back to back
            send = torch.cat(run.sends)
        if run.outs is None:
            return self.all_gather(run.recv, send)
        gathered = torch.empty(self.size * run.total, dtype=send.dtype, device=self.device)
        work = _all_gather(gathered, send, group=self.group, async_op=True)

        def copy_out():
            torch.split_with_sizes_copy(gathered.view(self.size, run.total), run.sizes, dim=1,
                                        out=run.outs)
        return Work(work, copy_out)

    def reduce_scatter_at(self, send, recv, count, dtype, op, stream=None):
        out, inp = self._at(recv, count, dtype), self._at(send, count * self.size, dtype)
        return self._on(stream, lambda: self.reduce_scatter(out, inp, op))

    def all_reduce_at(self, send, recv, count, dtype, op, stream=None):
        out = self._at(recv, count, dtype)

        def issue():
            if send != recv:
                out.copy_(self._at(send, count, dtype))
            return self.all_reduce(out, op)
        return self._on(stream, issue)

    def broadcast_at(self, buffer, count, dtype, root, stream=None):
        tensor = self._at(buffer, count, dtype)
        return self._on(stream, lambda: self.broadcast(tensor, root))

    def barrier_async(self, stream=None):
        return self._on(stream, lambda: Work(dist.barrier(group=self.group, async_op=True)))

    # --- tensors (the engine's calls) -----------------------------------------------

    def all_gather(self, out, inp):
        if self.size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return Done
        if self.direct_exchange:
            self.exchanges["all_gather"] += 1
            return DirectGather(self.group if self.group is not None else dist.group.WORLD,
                                self.rank, self.size, out, inp)
        return Work(_all_gather(out, inp, group=self.group, async_op=True))

    def reduce_scatter(self, out, inp, op="sum"):
        if self.size == 1:
            out.copy_(inp)
            return Done
        if self.direct_exchange and op == "sum":
            self.exchanges["reduce_scatter"] += 1
            return DirectReduceScatter(self.group if self.group is not None else dist.group.WORLD,
                                       self.rank, self.size, out, inp)
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
