"""The checkpoint's files: their format (header, layout, checksums, signatures), durable
writes, and bounded, checked reads."""

import contextlib
import copy
import errno
import fcntl
import hashlib
import hmac
import json
import math
import os
import re
import shutil
import stat
import unicodedata
import weakref
import zlib
from typing import NamedTuple, TypeGuard

import torch

from ... import _ductile
from ..._errors import IncompatibleError, InvalidArgumentError, IoError

FORMAT = "ductile-zero3-checkpoint"
# 4: shard files checked by CRC-32C ("crc32c" in the manifest's shard
# records). 3: the manifest's SHA-256 in `latest` and in its sidecar file;
# shard files checked by zlib's CRC-32 ("crc32"), as in 2, which has no
# checksum of the manifest. 2 and 3 are read still.
VERSION = 4
READ_VERSIONS = (2, 3, 4)
LATEST = "latest"
MANIFEST = "manifest.json"
CHECKSUM = MANIFEST + ".sha256"  # sha256sum's format: "<hex>  manifest.json"
MAGIC = b"DZ3SHARD"
# Written when the user gives a key (below): "hmac-sha256 <hex>  manifest.json",
# the HMAC-SHA256 of the manifest's bytes under that key. The manifest then
# records every shard file's SHA-256, so that the HMAC vouches for the shard
# files too (their CRC-32C is no defence against a forger).
HMAC_FILE = MANIFEST + ".hmac"

# Test hook: called as _fault_hook(operation, path) before every mkdir,
# create, write, fsync, rename and removal of a save, so that a test can
# stop the process (SIGKILL) at any of them.
_fault_hook = None


def fs(operation, path):
    if _fault_hook is not None:
        _fault_hook(operation, path)


def rank_stem(rank, world):
    return f"rank{rank}-of-{world}"


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def dtype_of(name, where):
    dtype = getattr(torch, str(name), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise IoError(f"{where}: unknown dtype {name!r}")
    try:  # a dtype whose elements are raw bytes (not a quantized one, say)
        torch.zeros(1, dtype=dtype).view(torch.uint8)
    except (RuntimeError, TypeError) as e:
        raise IoError(f"{where}: dtype {name!r} cannot be read from raw bytes") from e
    return dtype


def raw_bytes(tensor):
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy()


def fsync_dir(path):
    fs("fsync", path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_small(path, text):
    """`text` in `path`, written whole or not at all (a staged file renamed
    over it): a reader never sees half of it. OSError."""
    staged = path + ".tmp"
    if os.path.lexists(staged):
        os.unlink(staged)
    write_file(staged, [text.encode()], durable=False)
    fs("rename", staged)
    os.replace(staged, path)


def write_file(path, chunks, sha256=False, durable=True, reuse=None):
    """Writes `chunks` (bytes-like) to a new file and fsyncs it (unless not
    `durable`: a snapshot in memory); returns [size, CRC-32C], and the
    SHA-256 (hex) when `sha256`. The file must not
    exist, not even as a link (O_EXCL, O_NOFOLLOW): a link planted in the
    folder cannot redirect the write onto another file. `reuse`: a regular
    file of a superseded snapshot to move to `path` and overwrite in place,
    when there is one: its memory pages are written over instead of new ones
    being allocated, zeroed and the old ones freed (on tmpfs, most of a
    snapshot's cost). The chunks are written in batches of about
    _BATCH_BYTES by shard_io.write_buffers, which checksums each block while
    it is in the cache; OSError when a write fails."""
    crc, size = 0, 0
    digest = hashlib.sha256() if sha256 else None
    fd = reused(reuse, path) if reuse is not None else None
    if fd is None:
        fs("create", path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o666)
    try:
        batch, batched = [], 0
        for chunk in chunks:
            fs("write", path)  # before each chunk: where the test hook may stop a save
            batch.append(chunk)
            batched += memoryview(chunk).nbytes
            if batched >= _BATCH_BYTES:
                size, crc = _write_batch(fd, batch, size, crc, digest)
                batch, batched = [], 0
        if batch:
            size, crc = _write_batch(fd, batch, size, crc, digest)
        if reuse is not None:
            os.ftruncate(fd, size)  # a reused file may have been longer
        if durable:
            fs("fsync", path)
            os.fsync(fd)
    finally:
        os.close(fd)
    return [size, crc] if digest is None else [size, crc, digest.hexdigest()]


# The chunks a save yields are views of tensors (or host copies of them, off
# the CPU): a batch bounds how many of those copies are alive at once, and
# one call per batch keeps the per-call cost off small tensors.
_BATCH_BYTES = 64 << 20


def _write_batch(fd, batch, size, crc, digest):
    """(size, CRC-32C) after writing `batch` at offset `size`."""
    written, crc = _ductile.shard_io.write_buffers(fd, batch, size, crc)
    if digest is not None:
        for chunk in batch:
            digest.update(chunk)
    return size + written, crc


def reused(old, path, access=os.O_WRONLY):
    """`old` renamed to `path` and opened for writing over (`access`:
    O_WRONLY, or O_RDWR for a mapping), or None when there is nothing to
    reuse (gone, or not a regular file: never followed through a link)."""
    try:
        fs("rename", old)
        os.rename(old, path)
    except OSError:
        return None
    try:
        fd = os.open(path, access | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        os.unlink(path)
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        os.unlink(path)
        return None
    return fd


def checkpoint_key():
    """The key that signs and checks checkpoints, and the variable that gave
    it (DUCTILE_CHECKPOINT_KEY_FILE or DUCTILE_CHECKPOINT_KEY): the C++
    reader's, the one the agent checks in-memory snapshots with. (None,
    None) when neither is set. Raises InvalidArgumentError naming the
    variable (both set, empty, too short), or NotFoundError/IoError naming
    the file."""
    return _ductile.checkpoint_key()


def hmac_text(mac):
    return f"hmac-sha256 {mac}  {MANIFEST}\n".encode()


def io_error(path, what, e):
    return IoError(f"{path}: {what}: {e.strerror or e}")


def optimizer_view(engine):
    """(optimizer, per-group lists of param ids)."""
    optimizer = engine.optimizer
    if optimizer is None:
        return None, []
    pid_of = {id(info.shard): info.id for info in engine._params}
    groups = []
    for group in optimizer.param_groups:
        ids = []
        for p in group["params"]:
            if id(p) not in pid_of:
                raise IncompatibleError(
                    "zero3 checkpoint: the optimizer holds a tensor that is not one of the "
                    "engine's shards; build it over engine.shard_parameters()")
            ids.append(pid_of[id(p)])
        groups.append(ids)
    return optimizer, groups


def optimizer_class(optimizer):
    """The optimizer's class as checkpoints name it: an offloaded one goes
    by the class its factory made (the state layout is that class's), so a
    checkpoint loads with or without offload."""
    return getattr(optimizer, "checkpoint_class", type(optimizer).__name__)


def json_value(value, where):
    if isinstance(value, torch.Tensor):
        return {"tensor": value.detach().cpu().tolist(), "dtype": dtype_name(value.dtype)}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [json_value(v, where) for v in value]
    raise InvalidArgumentError(
        f"zero3 checkpoint: {where} has a value of type {type(value).__name__} that cannot be "
        "saved")


def from_json(value, where):
    if isinstance(value, dict) and "tensor" in value:
        dtype = dtype_of(value.get("dtype"), where)
        try:
            return torch.tensor(value["tensor"], dtype=dtype)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise IoError(f"{where}: a tensor of the optimizer state cannot be read: {e}") from e
    return value


def describe(engine, optimizer, groups):
    """The manifest's parameters and optimizer entries (no I/O)."""
    parameters, scalars = [], {}
    for info in engine._params:
        state = optimizer.state.get(info.shard, {}) if optimizer is not None else {}
        shard_keys, other = [], {}
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and tuple(value.shape) == (info.shard_numel,):
                shard_keys.append({"key": key, "dtype": dtype_name(value.dtype)})
            else:
                other[key] = json_value(value, f"optimizer state '{key}' of '{info.name}'")
        parameters.append({"name": info.name, "shape": list(info.shape),
                           "dtype": dtype_name(info.shard.dtype), "numel": info.numel,
                           "shard_numel": info.shard_numel, "state": shard_keys})
        scalars[str(info.id)] = other
    opt = None
    if optimizer is not None:
        opt = {"class": optimizer_class(optimizer),
               "param_groups": [
                   dict({k: json_value(v, f"optimizer hyperparameter '{k}'")
                         for k, v in group.items() if k != "params"}, params=ids)
                   for group, ids in zip(optimizer.param_groups, groups)],
               "state": scalars}
    return parameters, opt


def header(save_id, step, rank, world):
    text = json.dumps({"format": FORMAT, "save_id": save_id, "step": step, "rank": rank,
                       "world_size": world}).encode()
    return MAGIC + len(text).to_bytes(4, "little") + text


def read_header(f, path):
    """The header of the shard file open as `f` (read from its start) and
    the offset of its values; IoError naming `path` when there is none."""
    head = f.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
        raise IoError(f"{path}: not a ductile zero3 shard file (no header)")
    n = int.from_bytes(head[len(MAGIC):], "little")
    try:
        fields = json.loads(f.read(n).decode()) if n <= 1 << 16 else None
    except (ValueError, RecursionError):
        fields = None
    if not isinstance(fields, dict):
        raise IoError(f"{path}: the shard file's header is unreadable")
    return fields, len(MAGIC) + 4 + n


def shard_layout(parameters, where):
    """Where each value lies in a rank's shard file of `parameters` (the
    manifest's list): [(shard numel, [(state key or None, dtype, byte
    offset), ...]) per parameter], and the bytes of all of them."""
    offsets, layout = [], 0
    for meta in parameters:
        shard = int(meta["shard_numel"])
        pieces = [(None, dtype_of(meta["dtype"], where))] + [
            (k["key"], dtype_of(k["dtype"], where)) for k in meta["state"]]
        entry = []
        for key, dtype in pieces:
            entry.append((key, dtype, layout))
            layout += shard * dtype.itemsize
        offsets.append((shard, entry))
    return offsets, layout


def shard_chunks(engine, optimizer, parameters, header, after=None):
    """The shard file's chunks: the header, then every shard and its
    optimizer state. `after`: a CUDA event the device copies wait for
    (recorded on the training thread's stream), else they wait for this
    thread's current stream."""
    yield header
    tensors = []
    for info, meta in zip(engine._params, parameters):
        tensors.append(info.shard)
        if optimizer is not None:
            tensors += [optimizer.state[info.shard][k["key"]] for k in meta["state"]]
    if any(t.is_cuda for t in tensors):
        staging = _STAGING.get(engine)
        if staging is None:
            staging = _STAGING[engine] = DeviceStaging()
        yield from staging.copies(tensors, after)
    else:
        yield from map(raw_bytes, tensors)


class DeviceStaging:
    """Two pinned host buffers and a copy stream that bring a CUDA rank's
    shards to the host for a checkpoint or a snapshot: one buffer is filled
    by asynchronous copies on the copy stream while the other's bytes are
    written, so a save costs the step the device-to-host copy overlapped
    with the write, not a pageable copy and then the write. Allocated at
    the first save and reused by every later one (pinning is slow)."""

    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.buffers = [torch.empty(_BATCH_BYTES, dtype=torch.uint8, pin_memory=True)
                        for _ in range(2)]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self._rest = None

    def copies(self, tensors, after=None):
        """The bytes of `tensors` (CUDA or CPU) in order, as host views of
        _BATCH_BYTES each but the last, copied once `after` (a CUDA event;
        None: the current stream's work so far) is complete. Buffer j is
        refilled only after its view was handed over and the next one asked
        for: write_file writes a chunk of _BATCH_BYTES before it asks for
        the next, so by then the bytes are in the file."""
        if after is not None:
            self.stream.wait_event(after)
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
        source = (t.detach().reshape(-1).view(torch.uint8) for t in tensors)
        self._rest = None
        which, filled = 0, self._fill(0, source)
        while filled:
            following = self._fill(1 - which, source)
            self.events[which].synchronize()
            yield self.buffers[which][:filled].numpy()
            which, filled = 1 - which, following

    def _fill(self, which, source):
        """Copies the next bytes of `source` into buffer `which`; how many."""
        buffer, position = self.buffers[which], 0
        with torch.cuda.stream(self.stream):
            while position < len(buffer):
                if self._rest is None or not len(self._rest):
                    self._rest = next(source, None)
                    if self._rest is None:
                        break
                n = min(len(self._rest), len(buffer) - position)
                buffer[position:position + n].copy_(self._rest[:n], non_blocking=True)
                self._rest = self._rest[n:]
                position += n
            self.events[which].record(self.stream)
        return position


_STAGING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_tag(tag):
    problem = tag_problem(tag)
    if problem is not None:
        raise InvalidArgumentError(
            f"zero3 checkpoint: tag {tag!r} is not a valid folder name (valid: {problem})")


def final_name(root, tag):
    name, k = tag, 0
    while os.path.lexists(os.path.join(root, name)):
        k += 1
        name = f"{tag}.{k}"
    return name


def tag_problem(tag):
    """Why `tag` cannot name a checkpoint folder, or None."""
    if not isinstance(tag, str) or not tag:
        return "a non-empty str"
    if tag in (".", "..", LATEST) or tag.startswith(".") or tag.endswith(".tmp"):
        return f"not '{LATEST}', not starting with '.' nor ending with '.tmp'"
    if "/" in tag or os.sep in tag:
        return "without '/'"
    if any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp") for c in tag):
        return "without NUL, control, format (bidi) characters or lone surrogates"
    if len(tag.encode("utf-8")) > 255:
        return "at most 255 bytes in UTF-8"
    return None


def pointer_text(name, checksum):
    return f"{name}\nsha256 {checksum}\n".encode()


def remove_tree(path):
    fs("remove", path)
    # A snapshot file's mapping (pinned on cuda) would keep the file's
    # memory after its last name is gone: it is let go first.
    from ._snapshot_mapping import MAPPINGS
    MAPPINGS.forget_tree(path)
    shutil.rmtree(path, ignore_errors=True)


def lock_root(root):
    """An exclusive flock on the root folder, held by rank 0 of a save while
    it writes there (released when the process dies): the descriptor to
    close, or None where the file system cannot lock (then nobody can tell
    a live save from a killed one, and nothing is cleaned). Raises
    BlockingIOError when another process holds it."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise
    return fd


def unlock_root(fd):
    if fd is not None:
        os.close(fd)  # releases the flock


def remove_leftovers(root, keep=()):
    """Removes the `*.tmp` folders (and latest.tmp) of saves killed before
    their commit. The caller holds the root's lock (lock_root), so no live
    save is writing them; `keep`: entries not to touch."""
    try:
        entries = os.listdir(root)
    except OSError:
        return
    for entry in entries:
        if entry.endswith(".tmp") and entry not in keep:
            path = os.path.join(root, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                remove_tree(path)
            else:
                fs("remove", path)
                with contextlib.suppress(OSError):
                    os.unlink(path)


def clean_after_load(root):
    """What a load does for the saves killed before it: when no save holds
    the root's lock, their leftovers are removed (best effort: a read-only
    checkpoint stays as it is)."""
    try:
        fd = lock_root(root)
    except (BlockingIOError, OSError):
        return  # a save is running there (or the lock cannot be taken)
    if fd is None:
        return
    try:
        remove_leftovers(root)
    finally:
        unlock_root(fd)


# What a load reads (docs/zero3.md, "Checkpoints that commit atomically"), each file checked
# before a byte of it is read: a regular file (a FIFO would block the open), no larger than what it
# can hold, reached without leaving the checkpoint.

# The most a file of the checkpoint may hold, before it is read: `latest`
# and the sidecar hold a name and a checksum; a manifest, about 300 bytes a
# parameter (64 MiB: some 200,000 parameters).
_POINTER_BYTES = 4096
MANIFEST_BYTES = 64 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 22


def shard_checksum(version):
    """How a manifest of format `version` checks its shard files: (the
    shard record's key, the checksum's name, its function(data, value))."""
    if version >= 4:
        return "crc32c", "CRC-32C", _ductile.shard_io.crc32c
    return "crc32", "CRC-32", zlib.crc32


def _checked_fd(path, base, cap, what):
    """An open descriptor of `path` after the checks every file of a load
    passes (see the comment above); `cap`: the most bytes it may hold
    (None: any). Raises IoError naming the file."""
    real = os.path.realpath(path)
    if os.path.commonpath([real, base]) != base:
        raise IoError(f"{path}: the {what} is a link to {real}, out of the checkpoint {base}; "
                      "a checkpoint's files must lie inside it")
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise IoError(f"{path}: no {what}") from e
    except OSError as e:
        raise io_error(path, f"cannot open the {what}", e) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IoError(f"{path}: the {what} is {_file_type(st.st_mode)}, not a regular file")
        if cap is not None and st.st_size > cap:
            raise IoError(f"{path}: the {what} has {st.st_size} bytes, more than the {cap} it "
                          "can have")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _file_type(mode):
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"a file of mode {mode:#o}"


def open_checked(path, base, cap, what):
    """`path` opened for binary reading after the checks of _checked_fd."""
    return os.fdopen(_checked_fd(path, base, cap, what), "rb")


def read_checked(path, base, cap, what):
    """The bytes of `path` (at most `cap`), after the checks of _checked_fd."""
    with open_checked(path, base, cap, what) as f:
        try:
            data = f.read(cap + 1)
        except OSError as e:
            raise io_error(path, f"cannot read the {what}", e) from e
    if len(data) > cap:  # it grew since it was checked
        raise IoError(f"{path}: the {what} has more than the {cap} bytes it can have")
    return data


def _text(data, path, what):
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IoError(f"{path}: the {what} is not UTF-8 text (byte {e.start} is "
                      f"{data[e.start]:#04x})") from e


class Pointer(NamedTuple):
    """What `latest` says: the checkpoint folder's name and, since version
    3, the SHA-256 of its manifest."""

    path: str
    name: str
    checksum: str | None


def read_latest(root, base):
    """The Pointer of root/latest, or None when there is none (or it is empty)."""
    path = os.path.join(root, LATEST)
    if not os.path.lexists(path):
        return None
    text = _text(read_checked(path, base, _POINTER_BYTES, "checkpoint pointer"), path,
                 "checkpoint pointer")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    if not lines or not lines[0].strip():
        return None
    name = lines[0].strip()
    checksum = None
    if len(lines) == 2 and lines[1].startswith("sha256 ") and \
            _SHA256.fullmatch(lines[1][len("sha256 "):].strip()):
        checksum = lines[1][len("sha256 "):].strip()
    elif len(lines) != 1:
        raise IoError(f"{path}: not a checkpoint pointer: it must hold a folder name and a line "
                      "'sha256 <64 hex digits>'")
    problem = tag_problem(name.rsplit(".", 1)[0] if _numbered(name) else name)
    if problem is not None:
        raise IoError(f"{path}: names {name!r}, not a folder of {root} (a folder name "
                      f"{problem})")
    return Pointer(path, name, checksum)


def _numbered(name):
    head, _, k = name.rpartition(".")
    return bool(head) and k.isdigit()


class Source(NamedTuple):
    """Where a load reads: the checkpoint folder, the root it lies in
    (resolved: no file may lead out of it) and root/latest's Pointer."""

    folder: str
    base: str
    pointer: Pointer | None


def resolve(root):
    """The checkpoint folder: root/<latest>, or root itself when it holds a
    manifest (a tag folder given directly)."""
    base = os.path.realpath(root)
    pointer = read_latest(root, base) if os.path.isdir(root) else None
    if pointer is not None:
        folder = os.path.join(root, pointer.name)
        if not os.path.isdir(folder):
            raise IoError(f"{pointer.path}: names {pointer.name!r}, which does not exist")
        return Source(folder, base, pointer)
    if os.path.lexists(os.path.join(root, MANIFEST)):
        return Source(root, base, None)
    raise IoError(f"{root}: no checkpoint: neither '{LATEST}' nor {MANIFEST} (was a "
                  "checkpoint ever saved there completely?)")


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _check_hmac(path, data, folder, base, key, variable):
    """Refuses the manifest unless HMAC_FILE beside it holds the
    HMAC-SHA256 of its bytes under `key` (given by the environment
    `variable`)."""
    sidecar = os.path.join(folder, HMAC_FILE)
    if not os.path.lexists(sidecar):
        raise IoError(f"{sidecar}: no HMAC of the manifest, and {variable} gives a key: the "
                      "checkpoint was saved without that key (or its HMAC was removed); it is "
                      f"not loaded. Load it with {variable} unset to check it against damage "
                      "only")
    text = _text(read_checked(sidecar, base, _POINTER_BYTES, "manifest HMAC"), sidecar,
                 "manifest HMAC")
    fields = text.split()
    if len(fields) != 3 or fields[0] != "hmac-sha256" or not _SHA256.fullmatch(fields[1]) \
            or fields[2] != MANIFEST:
        raise IoError(f"{sidecar}: not a manifest HMAC (one line 'hmac-sha256 <64 hex digits>  "
                      f"{MANIFEST}')")
    expected = hmac.new(key, data, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, fields[1]):
        raise IoError(f"{path}: its HMAC-SHA256 under the key of {variable} is not the one "
                      f"{sidecar} records: the manifest was changed after the save, or signed "
                      "with another key; it is not loaded")


def read_manifest(source, key=None, variable=None):
    """(path, manifest) of the source's folder, checked against its
    checksums, then for the entries every load reads. With a `key` (from
    the environment `variable`), its HMAC must verify first: the checksums
    alone detect damage, not an edit whose author recomputed them."""
    folder, base = source.folder, source.base
    path = os.path.join(folder, MANIFEST)
    data = read_checked(path, base, MANIFEST_BYTES, "checkpoint manifest")
    if key is not None:
        _check_hmac(path, data, folder, base, key, variable)
    digest = hashlib.sha256(data).hexdigest()
    recorded = []  # (file, checksum)
    if source.pointer is not None and source.pointer.checksum is not None:
        recorded.append((source.pointer.path, source.pointer.checksum))
    sidecar = os.path.join(folder, CHECKSUM)
    if os.path.lexists(sidecar):
        text = _text(read_checked(sidecar, base, _POINTER_BYTES, "manifest checksum"), sidecar,
                     "manifest checksum")
        fields = text.split()
        if len(fields) != 2 or not _SHA256.fullmatch(fields[0]) or fields[1] != MANIFEST:
            raise IoError(f"{sidecar}: not a manifest checksum (one line '<64 hex digits>  "
                          f"{MANIFEST}')")
        recorded.append((sidecar, fields[0]))
    for where, checksum in recorded:
        if checksum != digest:
            raise IoError(f"{path}: its SHA-256 is {digest}, but {where} records {checksum}: "
                          "the manifest was changed after the save; it is not loaded")
    try:
        manifest = json.loads(_text(data, path, "checkpoint manifest"),
                              object_pairs_hook=_no_duplicates)
    except RecursionError as e:
        raise IoError(f"{path}: the checkpoint manifest nests too deeply to be read") from e
    except ValueError as e:
        raise IoError(f"{path}: the checkpoint manifest is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IoError(f"{path}: not a ductile zero3 checkpoint manifest")
    version = manifest.get("version")
    if version not in READ_VERSIONS:
        raise IoError(f"{path}: checkpoint version {version!r}; this ductile reads versions "
                      f"{', '.join(map(str, READ_VERSIONS))}")
    if version >= 3 and not recorded:
        raise IoError(f"{path}: a version {version} manifest is loaded only with its checksum, "
                      f"and neither {sidecar} nor a checksum line in {LATEST} exists")
    world = manifest.get("world_size")
    if not _count(world) or world < 1:
        raise IoError(f"{path}: world_size {world!r} is not a positive integer")
    shards = manifest.get("shards")
    crc_key, crc_name, _ = shard_checksum(version)
    if not isinstance(shards, list) or len(shards) != world or not all(
            isinstance(s, dict) and s.get("file") == rank_stem(r, world) + ".bin"
            and _count(s.get("bytes")) and _count(s.get(crc_key))
            for r, s in enumerate(shards)):
        raise IoError(f"{path}: 'shards' must list rank0..rank{world - 1}'s file, size and "
                      f"{crc_name} ('{crc_key}')")
    if not isinstance(manifest.get("save_id"), str) or not _count(manifest.get("step")):
        raise IoError(f"{path}: 'save_id' and 'step' are missing")
    return path, manifest


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_entries(path, manifest):
    """The entries a load reads, of the types a save writes them: a manifest
    edited by hand and signed again is refused here, naming the entry,
    rather than by an exception of the runtime deep in the load."""
    def bad(where, what):
        raise IoError(f"{path}: {where} must be {what}: the manifest is damaged")

    world = manifest["world_size"]
    parameters = manifest.get("parameters")
    if not isinstance(parameters, list):
        bad("'parameters'", "a list")
    for i, meta in enumerate(parameters):
        where = f"parameters[{i}]"
        if not isinstance(meta, dict):
            bad(where, "an object")
        if not isinstance(meta.get("name"), str) or not isinstance(meta.get("dtype"), str):
            bad(where, "an object with a name and a dtype")
        shape = meta.get("shape")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            bad(f"{where}.shape", "a list of sizes")
        numel, shard = meta.get("numel"), meta.get("shard_numel")
        product = math.prod(shape)
        if not _count(numel) or numel != product:
            bad(f"{where}.numel", f"the product of its shape, {product}")
        if not _count(shard) or shard * world < numel:
            bad(f"{where}.shard_numel", f"an integer whose {world} shards cover its {numel} "
                                        "elements")
        state = meta.get("state")
        if not isinstance(state, list) or not all(
                isinstance(k, dict) and isinstance(k.get("key"), str)
                and isinstance(k.get("dtype"), str) for k in state):
            bad(f"{where}.state", "a list of objects with a key and a dtype")
    optimizer = manifest.get("optimizer")
    if optimizer is not None:
        if not isinstance(optimizer, dict) or not isinstance(optimizer.get("class"), str):
            bad("'optimizer'", "null or an object with a class")
        groups = optimizer.get("param_groups")
        if not isinstance(groups, list) or not all(
                isinstance(g, dict) and isinstance(g.get("params"), list)
                and all(_count(p) for p in g["params"]) for g in groups):
            bad("optimizer.param_groups", "a list of objects with params (parameter ids)")
        state = optimizer.get("state")
        if not isinstance(state, dict) or not all(isinstance(v, dict) for v in state.values()):
            bad("optimizer.state", "an object of objects")
    for key in ("loss_scaler", "lr_scheduler"):
        value = manifest.get(key)
        if value is not None and not isinstance(value, dict):
            bad(f"'{key}'", "null or an object")


def check_loss_scaler(engine, path, manifest):
    """Loads the manifest's loss scaler state into a copy of the engine's,
    so that a bad one is found before any rank changes anything."""
    scaler, state = engine._scaler, manifest.get("loss_scaler")
    if scaler is None or state is None:
        return
    try:
        copy.deepcopy(scaler).load_state_dict(state)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise IoError(f"{path}: 'loss_scaler' cannot be loaded: {type(e).__name__}: {e}") from e


def check_model(engine, path, manifest):
    check_entries(path, manifest)
    saved = manifest["parameters"]
    ours = engine._params
    if len(saved) != len(ours):
        raise IncompatibleError(
            f"{path}: the checkpoint has {len(saved)} parameters, the model {len(ours)}: it was "
            "saved from another model")
    for info, meta in zip(ours, saved):
        mine = (info.name, list(info.shape), dtype_name(info.shard.dtype))
        theirs = (meta.get("name"), meta.get("shape"), meta.get("dtype"))
        if mine != theirs:
            raise IncompatibleError(
                f"{path}: parameter {info.id} is {theirs[0]} {theirs[1]} {theirs[2]} in the "
                f"checkpoint but {mine[0]} {mine[1]} {mine[2]} in the model: it was saved from "
                "another model")


class RankFiles:
    """The old ranks' files, opened and checked (header, size, CRC) on
    first use."""

    def __init__(self, source, manifest_path, manifest, layout_bytes, signed_by=None):
        # signed_by: the environment variable of the key that verified the
        # manifest; each shard file must then match the SHA-256 it records.
        self.signed_by = signed_by
        self.folder = source.folder
        self.base = source.base
        self.manifest_path = manifest_path
        self.manifest = manifest
        self.layout_bytes = layout_bytes
        self.files = {}  # rank -> (file, payload offset)

    def close(self):
        for f, _ in self.files.values():
            f.close()

    def get(self, rank):
        entry = self.files.get(rank)
        if entry is not None:
            return entry
        m = self.manifest
        record = m["shards"][rank]
        path = os.path.join(self.folder, record["file"])
        # At most the manifest's size: a larger file is refused unread.
        f = open_checked(path, self.base, record["bytes"], f"shard file of rank {rank}")
        try:
            offset = self._check(f, path, rank, record)
        except BaseException:
            f.close()
            raise
        self.files[rank] = (f, offset)
        return f, offset

    def _check(self, f, path, rank, record):
        m = self.manifest
        header, offset = read_header(f, path)
        ours = (m["save_id"], m["step"], rank, m["world_size"])
        theirs = (header.get("save_id"), header.get("step"), header.get("rank"),
                  header.get("world_size"))
        if ours != theirs:
            raise IoError(
                f"{path}: this shard file belongs to save {theirs[0]} (step {theirs[1]}, rank "
                f"{theirs[2]} of {theirs[3]}), but {self.manifest_path} to save {ours[0]} (step "
                f"{ours[1]}, rank {ours[2]} of {ours[3]}): the checkpoint mixes files of two saves")
        size = os.fstat(f.fileno()).st_size
        if size != record["bytes"]:
            raise IoError(
                f"{path}: {size} bytes, expected {record['bytes']} (the size {self.manifest_path} "
                "records): the file is truncated or damaged")
        if size != offset + self.layout_bytes:
            raise IoError(
                f"{path}: {size} bytes, but the parameters {self.manifest_path} lists take "
                f"{offset + self.layout_bytes} ({offset} of header and {self.layout_bytes} of "
                "values): the manifest and the file disagree; the checkpoint is damaged")
        wanted = record.get("sha256") if self.signed_by is not None else None
        if self.signed_by is not None and not (isinstance(wanted, str) and
                                               _SHA256.fullmatch(wanted)):
            raise IoError(f"{self.manifest_path}: no SHA-256 of {path}, and {self.signed_by} "
                          "gives a key: a signed manifest records one for every shard file; "
                          "it is not loaded")
        digest = hashlib.sha256() if wanted is not None else None
        crc_key, crc_name, checksum = shard_checksum(m["version"])
        f.seek(0)
        crc = 0
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            crc = checksum(chunk, crc)
            if digest is not None:
                digest.update(chunk)
        if crc != record[crc_key]:
            raise IoError(f"{path}: {crc_name} {crc:#010x} differs from the manifest's "
                          f"{record[crc_key]:#010x}: the shard file is corrupt")
        if digest is not None:
            assert isinstance(wanted, str)  # checked above: there is a digest only then
            if not hmac.compare_digest(digest.hexdigest(), wanted):
                raise IoError(f"{path}: its SHA-256 is {digest.hexdigest()}, but the signed "
                              f"{self.manifest_path} records {wanted}: the shard file was "
                              "changed after the save; it is not loaded")
        return offset
