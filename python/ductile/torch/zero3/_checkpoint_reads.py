"""What a zero3 checkpoint load reads (see _checkpoint.py), each file
checked before a byte of it is read: it must be a regular file (not a FIFO,
which would block the open, nor a directory or a device), no larger than
what it can hold, and reached without leaving the checkpoint (a link to a
file elsewhere is refused). `latest` names the folder and, since format
version 3, the SHA-256 of its manifest, which manifest.json.sha256 beside
it records too: an edited manifest is refused before it is parsed. With a
key, manifest.json.hmac must verify first, and each shard file must match
the SHA-256 the manifest records (see _checkpoint.py). Then the manifest's
entries are checked for the types a save writes, and every shard file for
its header, size and CRC-32C (zlib's CRC-32 in versions 2 and 3)."""

import copy
import hashlib
import hmac
import json
import os
import re
import stat
import zlib
from typing import TypeGuard

from ... import _ductile
from ..._errors import IncompatibleError, IoError
from ._checkpoint_files import (CHECKSUM, FORMAT, HMAC_FILE, LATEST, MANIFEST, READ_VERSIONS,
                                dtype_name, io_error, rank_stem, read_header, tag_problem)

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
    passes (see the module's docstring); `cap`: the most bytes it may hold
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


class Pointer:
    """What `latest` says: the checkpoint folder's name and, since version
    3, the SHA-256 of its manifest."""

    def __init__(self, path, name, checksum):
        self.path = path
        self.name = name
        self.checksum = checksum


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


class Source:
    """Where a load reads: the checkpoint folder, the root it lies in
    (resolved: no file may lead out of it) and root/latest's Pointer."""

    def __init__(self, folder, base, pointer):
        self.folder = folder
        self.base = base
        self.pointer = pointer


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
        product = 1
        for d in shape:
            product *= d
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



