"""The files of a zero3 checkpoint (see _checkpoint.py): the file-system
operations of a save (each one passing the test hook), the shard files'
header, the manifest's parameter and optimizer entries, and the checks a
load makes of the manifest and of every shard file it reads."""

import json
import os
import shutil
import zlib

import torch

from ..._errors import IncompatibleError, InvalidArgumentError, IoError

FORMAT = "ductile-zero3-checkpoint"
VERSION = 2
LATEST = "latest"
_MAGIC = b"DZ3SHARD"
_CHUNK = 1 << 22

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
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise IoError(f"{where}: unknown dtype '{name}'")
    return dtype


def element_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def raw_bytes(tensor):
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy()


def fsync_dir(path):
    fs("fsync", path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path, chunks):
    """Writes `chunks` (bytes-like) to a new file and fsyncs it; returns
    (size, CRC-32)."""
    crc, size = 0, 0
    fs("create", path)
    with open(path, "xb") as f:
        for chunk in chunks:
            fs("write", path)
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
            size += len(chunk) if isinstance(chunk, (bytes, bytearray)) else chunk.nbytes
        f.flush()
        fs("fsync", path)
        os.fsync(f.fileno())
    return size, crc


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
        return torch.tensor(value["tensor"], dtype=dtype_of(value["dtype"], where))
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
        opt = {"class": type(optimizer).__name__,
               "param_groups": [
                   dict({k: json_value(v, f"optimizer hyperparameter '{k}'")
                         for k, v in group.items() if k != "params"}, params=ids)
                   for group, ids in zip(optimizer.param_groups, groups)],
               "state": scalars}
    return parameters, opt


def header(save_id, step, rank, world):
    text = json.dumps({"format": FORMAT, "save_id": save_id, "step": step, "rank": rank,
                       "world_size": world}).encode()
    return _MAGIC + len(text).to_bytes(4, "little") + text


def shard_chunks(engine, optimizer, parameters, header):
    yield header
    for info, meta in zip(engine._params, parameters):
        yield raw_bytes(info.shard)
        if optimizer is not None:
            for k in meta["state"]:
                yield raw_bytes(optimizer.state[info.shard][k["key"]])


def check_tag(tag):
    if not isinstance(tag, str) or not tag or tag in (".", "..", LATEST) or "/" in tag \
            or os.sep in tag or tag.endswith(".tmp") or tag.startswith("."):
        raise InvalidArgumentError(
            f"zero3 checkpoint: tag {tag!r} is not a valid folder name (a non-empty name "
            f"without '/', not '{LATEST}', not starting with '.' nor ending with '.tmp')")


def final_name(root, tag):
    if not os.path.lexists(os.path.join(root, tag)):
        return tag
    k = 1
    while os.path.lexists(os.path.join(root, f"{tag}.{k}")):
        k += 1
    return f"{tag}.{k}"


def read_latest(root):
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def remove_tree(path):
    fs("remove", path)
    shutil.rmtree(path, ignore_errors=True)


def resolve(root):
    """The checkpoint folder: root/<latest>, or root itself when it holds a
    manifest (a tag folder given directly)."""
    root = os.fspath(root)
    latest = read_latest(root) if os.path.isdir(root) else None
    if latest is not None:
        if "/" in latest or latest in (".", ".."):
            raise IoError(f"{os.path.join(root, LATEST)}: names {latest!r}, not a folder of "
                          f"{root}")
        folder = os.path.join(root, latest)
        if not os.path.isdir(folder):
            raise IoError(f"{os.path.join(root, LATEST)}: names {latest!r}, which does not exist")
        return folder
    if os.path.isfile(os.path.join(root, "manifest.json")):
        return root
    raise IoError(f"{root}: no checkpoint: neither '{LATEST}' nor manifest.json (was a "
                  "checkpoint ever saved there completely?)")


def read_manifest(folder):
    path = os.path.join(folder, "manifest.json")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError as e:
        raise IoError(f"{path}: no checkpoint manifest") from e
    except OSError as e:
        raise io_error(path, "cannot read the checkpoint manifest", e) from e
    except ValueError as e:
        raise IoError(f"{path}: the checkpoint manifest is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IoError(f"{path}: not a ductile zero3 checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise IoError(f"{path}: checkpoint version {manifest.get('version')!r}; this ductile "
                      f"reads version {VERSION}")
    world = manifest.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise IoError(f"{path}: world_size {world!r} is not a positive integer")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or len(shards) != world or not all(
            isinstance(s, dict) and s.get("file") == rank_stem(r, world) + ".bin"
            and isinstance(s.get("bytes"), int) and isinstance(s.get("crc32"), int)
            for r, s in enumerate(shards)):
        raise IoError(f"{path}: 'shards' must list rank0..rank{world - 1}'s file, size and "
                      "CRC-32")
    if not isinstance(manifest.get("save_id"), str) or not isinstance(manifest.get("step"), int):
        raise IoError(f"{path}: 'save_id' and 'step' are missing")
    return path, manifest


def check_model(engine, path, manifest):
    saved = manifest.get("parameters")
    if not isinstance(saved, list):
        raise IoError(f"{path}: 'parameters' is missing")
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
    """The old ranks' files, opened and checked (header, size, CRC-32) on
    first use."""

    def __init__(self, folder, manifest_path, manifest, layout_bytes):
        self.folder = folder
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
        try:
            f = open(path, "rb")
        except FileNotFoundError as e:
            raise IoError(f"{path}: missing shard file of rank {rank}") from e
        except OSError as e:
            raise io_error(path, "cannot open the shard file", e) from e
        try:
            offset = self._check(f, path, rank, record)
        except BaseException:
            f.close()
            raise
        self.files[rank] = (f, offset)
        return f, offset

    def _check(self, f, path, rank, record):
        m = self.manifest
        head = f.read(len(_MAGIC) + 4)
        if len(head) < len(_MAGIC) + 4 or head[:len(_MAGIC)] != _MAGIC:
            raise IoError(f"{path}: not a ductile zero3 shard file (no header)")
        n = int.from_bytes(head[len(_MAGIC):], "little")
        try:
            header = json.loads(f.read(n).decode()) if n <= 1 << 16 else None
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise IoError(f"{path}: the shard file's header is unreadable")
        ours = (m["save_id"], m["step"], rank, m["world_size"])
        theirs = (header.get("save_id"), header.get("step"), header.get("rank"),
                  header.get("world_size"))
        if ours != theirs:
            raise IoError(
                f"{path}: this shard file belongs to save {theirs[0]} (step {theirs[1]}, rank "
                f"{theirs[2]} of {theirs[3]}), but {self.manifest_path} to save {ours[0]} (step "
                f"{ours[1]}, rank {ours[2]} of {ours[3]}): the checkpoint mixes files of two saves")
        offset = len(_MAGIC) + 4 + n
        size = os.fstat(f.fileno()).st_size
        if size != record["bytes"] or size != offset + self.layout_bytes:
            raise IoError(
                f"{path}: {size} bytes, expected {record['bytes']} (the manifest's record and "
                "layout): the file is truncated or damaged")
        f.seek(0)
        crc = 0
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
        if crc != record["crc32"]:
            raise IoError(f"{path}: CRC-32 {crc:#010x} differs from the manifest's "
                          f"{record['crc32']:#010x}: the shard file is corrupt")
        return offset


