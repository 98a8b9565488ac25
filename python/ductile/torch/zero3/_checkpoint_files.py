"""The files of a zero3 checkpoint (see _checkpoint.py), as a save writes
them: the file-system operations (each one passing the test hook), the
shard files' header, the manifest's parameter and optimizer entries, the
names a tag may take, and the root's lock with the leftovers of killed
saves. _checkpoint_reads.py reads them back."""

import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import unicodedata

import torch

from ... import _ductile
from ..._errors import Error, IncompatibleError, InvalidArgumentError, IoError
from ..._paths import path_argument

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
KEY_FILE_ENV = "DUCTILE_CHECKPOINT_KEY_FILE"
KEY_ENV = "DUCTILE_CHECKPOINT_KEY"
_KEY_FILE_BYTES = 4096
# Fewer bytes than this are guessable; `openssl rand -hex 32` gives 64.
MIN_KEY_BYTES = 16

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


def element_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def raw_bytes(tensor):
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy()


def fsync_dir(path):
    fs("fsync", path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    fd = _reused(reuse, path) if reuse is not None else None
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


def _reused(old, path):
    """`old` renamed to `path` and opened for writing over, or None when
    there is nothing to reuse (gone, or not a regular file: never
    followed through a link)."""
    try:
        fs("rename", old)
        os.rename(old, path)
    except OSError:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        os.unlink(path)
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        os.unlink(path)
        return None
    return fd


def checkpoint_key():
    """The key that signs and checks checkpoints: the bytes of the file
    DUCTILE_CHECKPOINT_KEY_FILE names (read by the bounded reader, blanks
    at its ends dropped), or of DUCTILE_CHECKPOINT_KEY; None when neither
    is set. Returns (key, the variable that gave it). Raises
    InvalidArgumentError naming the variable (both set, empty, too short),
    or the reader's NotFoundError/IoError naming the file."""
    path = os.environ.get(KEY_FILE_ENV)
    text = os.environb.get(KEY_ENV.encode())
    if path is not None and text is not None:
        raise InvalidArgumentError(f"zero3 checkpoint: both {KEY_FILE_ENV} and {KEY_ENV} are "
                                   "set; set one of them")
    if path is not None:
        if not path:
            raise InvalidArgumentError(f"zero3 checkpoint: {KEY_FILE_ENV} is set but empty; "
                                       "give the path of a key file, or unset it")
        try:
            key = _ductile.read_user_file(path, "checkpoint key file", _KEY_FILE_BYTES).strip()
        except Error as e:
            raise type(e)(f"{e} (named by {KEY_FILE_ENV})", kind=e.kind, type=e.type) from e
        where = f"{path} (named by {KEY_FILE_ENV})"
        variable = KEY_FILE_ENV
    elif text is not None:
        key = text
        where = KEY_ENV
        variable = KEY_ENV
    else:
        return None, None
    # The key itself is a secret: a message gives its length, never its bytes.
    if len(key) < MIN_KEY_BYTES:
        raise InvalidArgumentError(
            f"zero3 checkpoint: the key of {where} has {len(key)} bytes; valid: at least "
            f"{MIN_KEY_BYTES} (e.g. the 64 hex digits of `openssl rand -hex 32`), or unset "
            f"{variable} to save without a key")
    return key, variable


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
            layout += shard * element_size(dtype)
        offsets.append((shard, entry))
    return offsets, layout


def shard_chunks(engine, optimizer, parameters, header):
    yield header
    for info, meta in zip(engine._params, parameters):
        yield raw_bytes(info.shard)
        if optimizer is not None:
            for k in meta["state"]:
                yield raw_bytes(optimizer.state[info.shard][k["key"]])


def check_tag(tag):
    problem = tag_problem(tag)
    if problem is not None:
        raise InvalidArgumentError(
            f"zero3 checkpoint: tag {tag!r} is not a valid folder name (valid: {problem})")


def final_name(root, tag):
    if not os.path.lexists(os.path.join(root, tag)):
        return tag
    k = 1
    while os.path.lexists(os.path.join(root, f"{tag}.{k}")):
        k += 1
    return f"{tag}.{k}"


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


def check_root(root, what):
    """`root` as a str path; InvalidArgumentError for one no file can have."""
    return path_argument(root, "directory", what)


def remove_tree(path):
    fs("remove", path)
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
                try:
                    os.unlink(path)
                except OSError:
                    pass


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
