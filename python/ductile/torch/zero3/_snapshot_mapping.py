"""A snapshot's shard file written through a mapping of it (_snapshots.py).

The file is made at its final size (its blocks allocated, so that a store
through the mapping never meets a full tmpfs, which would be SIGBUS rather
than an error), mapped once and kept mapped while it keeps its inode and
size: a rank's two snapshot files trade places every snapshot (the new one
is written over the superseded one's pages), so after the first two
snapshots nothing is mapped, allocated or pinned again; the mapping is
made anew only when the file's size changes (its header gains a byte at
steps 10, 100, ...).

Each shard and optimizer-state tensor is copied straight to its offset in
the mapping: no intermediate buffer. On the cpu by shard_io.copy_buffers
(stores that bypass the cache, each block's CRC-32C taken while its source
is in the cache, as write_buffers does). On cuda the mapping is registered
as pinned host memory (``cudaHostRegister``), so ``copy_`` into a view of
it is the copy engine's ``cudaMemcpyAsync`` device to host, on a stream of
its own that waits for the training thread's event, and ``copied`` (a CUDA
event) says when the copies are done; the CRC-32C is then computed over the
mapping's pages. The SHA-256 of a signed snapshot is computed over them
too. The bytes are those write_file writes: the header, then the values.

A mapping is unregistered and unmapped before its file is resized, before a
tree that holds it is removed (remove_tree), when the file has no name left
(found at the next lease: another process removed it), when more than
_MAX_FILES are kept (least recently used first), and by close().

Threading: a SnapshotFile is used by one thread at a time (the training
thread, or a SnapshotWrite's); MAPPINGS serves every thread under its lock.
"""

import contextlib
import hashlib
import logging
import mmap
import os
import stat
import threading

import numpy as np

import torch

from ... import _ductile
from . import _checkpoint
from ._checkpoint_files import _BATCH_BYTES, fs, header, io_error, raw_bytes, reused

# A rank alternates between two snapshot files; a few more cover a restore's
# and a replica's without thrashing.
_MAX_FILES = 4

_log = logging.getLogger("ductile.zero3")


class _Mapping:
    """One file mapped shared and read-write, [0, size), pinned on cuda."""

    def __init__(self, fd, size, pin):
        # A descriptor of its own: its st_nlink says when the file is gone.
        self.fd = os.dup(fd)
        self.size = size
        self.pin = pin  # asked for: a refused registration is not asked again
        self.pinned = False
        try:
            self.memory = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        # numpy holds the mapping's buffer while a view of it lives, so the
        # mapping cannot be closed under a tensor that still points into it.
        self.array: np.ndarray | None = np.frombuffer(self.memory, dtype=np.uint8)
        self.tensor: torch.Tensor | None = torch.from_numpy(self.array)
        try:
            self.pinned = pin and _register(self.tensor.data_ptr(), size)
        except BaseException:
            self.close()
            raise

    def close(self):
        if self.pinned:
            assert self.tensor is not None  # closed once
            _unregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = self.array = None
        with contextlib.suppress(BufferError):  # a view lives: unmapped when it goes
            self.memory.close()
        os.close(self.fd)

    def gone(self):
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True


def _register(pointer, size):
    """Pins [pointer, pointer + size) for the device's copies; False (the
    copies then go through the driver's staging) when the driver refuses."""
    code = int(torch.cuda.cudart().cudaHostRegister(pointer, size, 0))  # cudaHostRegisterDefault
    if code != 0:
        _log.warning("zero3 snapshots: cudaHostRegister of a %d-byte snapshot file's mapping "
                     "failed (cudaError %d); its copies go through pageable memory", size, code)
        return False
    return True


def _unregister(pointer):
    code = int(torch.cuda.cudart().cudaHostUnregister(pointer))
    if code != 0:
        _log.warning("zero3 snapshots: cudaHostUnregister of a snapshot file's mapping failed "
                     "(cudaError %d)", code)


class Mappings:
    """The process' mappings of snapshot files, by (device, inode)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: dict[tuple[int, int], _Mapping] = {}
        self._order: list[tuple[int, int]] = []  # least recently used first

    def lease(self, fd, size, pin):
        """The mapping of fd's file, made `size` bytes long with its blocks
        allocated; OSError (ENOSPC, ...) when the file cannot be."""
        with self._lock:
            for key in [k for k, m in self._kept.items() if m.gone()]:
                self._drop(key)
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            kept = self._kept.get(key)
            if kept is not None and (kept.size != size or st.st_size != size or
                                     kept.pin != pin):
                self._drop(key)  # unpinned and unmapped before the file is resized
                kept = None
            if kept is None:
                _allocate(fd, st, size)
                kept = self._kept[key] = _Mapping(fd, size, pin)
                while len(self._kept) > _MAX_FILES:
                    self._drop(self._order[0])
            else:
                self._order.remove(key)
            self._order.append(key)
            return kept

    def forget_tree(self, path):
        """Lets go of the mappings of the files under `path` (before it is
        removed)."""
        if not self._kept:
            return
        inodes = set()
        for folder, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(folder, name))
                    if stat.S_ISREG(st.st_mode):
                        inodes.add((st.st_dev, st.st_ino))
        with self._lock:
            for key in inodes & self._kept.keys():
                self._drop(key)

    def close(self):
        with self._lock:
            for key in list(self._kept):
                self._drop(key)

    def _drop(self, key):
        self._kept.pop(key).close()
        self._order.remove(key)


MAPPINGS = Mappings()


def _allocate(fd, st, size):
    """The file made `size` bytes long with every block allocated."""
    if st.st_size != size:
        os.ftruncate(fd, size)
    if st.st_blocks * 512 < size:
        os.posix_fallocate(fd, 0, size)


def checksum(array, signed, crc=None):
    """[CRC-32C, (SHA-256)] of the bytes of `array` (the file's, through its
    mapping; `crc`: their CRC-32C when the copies computed it); the GIL is
    released while they are read."""
    if crc is None:
        crc = _ductile.shard_io.crc32c(array)
    return [crc, hashlib.sha256(array).hexdigest()] if signed else [crc]


_STREAMS: dict[int, torch.cuda.Stream] = {}


def _copy_stream(device):
    """The copy stream of `device` (an index), made once."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


class SnapshotFile:
    """One rank's shard file of one snapshot (never fsynced: it lives in
    memory): copy() fills it from the tensors, finish() checksums it (see
    the module's docstring). Both raise IoError naming the file."""

    def __init__(self, engine, target, plan):
        self.path = os.path.join(plan.staging, plan.stem)
        self.root = target.root if target.reuse else None  # where a superseded file lies
        self.stem = plan.stem
        self.signed = plan.signed
        self.common_digest = plan.common_digest
        self.head = header(plan.save_id, plan.step, plan.rank, plan.world)
        self.tensors = []
        optimizer = plan.optimizer
        for info, meta in zip(engine._params, plan.parameters):
            self.tensors.append(info.shard)
            if optimizer is not None:
                self.tensors += [optimizer.state[info.shard][k["key"]] for k in meta["state"]]
        self.size = len(self.head) + sum(t.numel() * t.element_size() for t in self.tensors)
        self.cuda = any(t.is_cuda for t in self.tensors)
        self.copied = None  # on cuda: the event recorded after the copies
        self.crc = None  # on the cpu: computed by the copies
        # The mapping's bytes, held while this file is written: a mapping let
        # go meanwhile is unmapped only once they are dropped.
        self._bytes = None

    def copy(self, after=None):
        """Makes the file and copies the header and the tensors into it;
        on cuda the copies are queued on the copy stream after `after` (an
        event; None: the current stream's work so far), and `copied` is
        recorded after them."""
        try:
            self._copy(after)
        except OSError as e:
            raise io_error(self.path, "cannot write the shard file", e) from e

    def _copy(self, after):
        old = _checkpoint._superseded_file(self.root, self.stem) if self.root else None
        fd = reused(old, self.path, os.O_RDWR) if old is not None else None
        if fd is None:
            fs("create", self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o666)
        try:
            mapping = MAPPINGS.lease(fd, self.size, self.cuda)
        finally:
            os.close(fd)
        self._bytes = mapping.array
        target = mapping.tensor
        fs("write", self.path)
        offset = len(self.head)
        self._bytes[:offset] = np.frombuffer(self.head, dtype=np.uint8)
        if not self.cuda:
            offset = self._cpu_copies(self._bytes, offset)
        else:
            stream = _copy_stream(torch.cuda.current_device())
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                offset = self._copies(target, offset, True)
                self.copied = torch.cuda.Event()
                self.copied.record(stream)
        assert offset == self.size  # the tensors' sizes are the plan's

    def _copies(self, target, offset, non_blocking):
        for tensor in self.tensors:
            fs("write", self.path)  # before each tensor: where a test may stop a snapshot
            values = tensor.detach().reshape(-1).view(torch.uint8)
            n = values.numel()
            target[offset:offset + n].copy_(values, non_blocking=non_blocking)
            offset += n
        return offset

    def _cpu_copies(self, target, offset):
        """The tensors copied into `target` (the mapping's bytes) by
        shard_io.copy_buffers, whose stores bypass the cache and which
        checksums each block while its source is in the cache, where copy_
        and then a pass over the mapping read every byte twice more. A call per
        _BATCH_BYTES keeps the per-call cost off small tensors."""
        crc = _ductile.shard_io.crc32c(self.head)
        batch, batched = [], 0
        for tensor in self.tensors:
            fs("write", self.path)  # before each tensor: where a test may stop a snapshot
            batch.append(raw_bytes(tensor))
            batched += batch[-1].nbytes
            if batched >= _BATCH_BYTES:
                copied, crc = _ductile.shard_io.copy_buffers(target, offset, batch, crc)
                offset, batch, batched = offset + copied, [], 0
        if batch:
            copied, crc = _ductile.shard_io.copy_buffers(target, offset, batch, crc)
            offset += copied
        self.crc = crc
        return offset

    def finish(self):
        """Waits for the copies (cuda) and returns the file's record [size,
        CRC-32C, (SHA-256), leader's digest], computed over the mapping."""
        if self.copied is not None:
            self.copied.synchronize()
        values, self._bytes = self._bytes, None
        return [self.size] + checksum(values, self.signed, self.crc) + [self.common_digest]


def write_shards(engine, target, plan):
    """_checkpoint.write_shards through the file's mapping, on the calling
    thread: this rank's shard file of a snapshot, the same bytes and
    record. Touches no collective."""
    file = SnapshotFile(engine, target, plan)
    file.copy()
    return file.finish()
