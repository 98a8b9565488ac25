"""Checkpoints: the ranks' agreement, then the atomic save and the load (re-sharded to any
world size)."""

import contextlib
import copy
import hashlib
import hmac
import json
import os
import uuid

import torch

from ... import _errors
from ..._errors import Error, IncompatibleError, InvalidArgumentError, IoError
from ..._paths import path_argument
from ._checkpoint_files import (CHECKSUM, FORMAT, HMAC_FILE, LATEST, MANIFEST, RankFiles, VERSION,
                                check_loss_scaler, check_model, check_tag, checkpoint_key,
                                clean_after_load, describe, final_name, from_json, fs, fsync_dir,
                                header, hmac_text, io_error, lock_root, optimizer_class,
                                optimizer_view, pointer_text, rank_stem, read_latest,
                                read_manifest, remove_leftovers, remove_tree, resolve,
                                shard_chunks, shard_layout, tag_problem, unlock_root, write_file)
from ._world import gather_bytes

# What every rank must hear from every other: each rank's outcome of a local phase (a save's
# writes, a load's reads and checks), exchanged with two small collectives, so that one rank's
# error is raised on all of them at once (the others name the failing rank and its message)
# instead of leaving them in the next collective until its timeout.

_RECORD_LIMIT = 1 << 16  # bytes of one rank's record (a message is cut to fit)


class Outcome:
    __slots__ = ("value", "payloads")

    def __init__(self, value, payloads):
        self.value = value
        self.payloads = payloads  # every rank's payload (bytes), by rank


def _error_class(name):
    cls = getattr(_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, _errors.Error):
        return cls
    return _errors.CommunicationError


def _record(ok, error, payload):
    body = {"ok": ok, "payload": payload.hex()}
    if error is not None:
        body["class"] = type(error).__name__ if isinstance(error, _errors.Error) else "Error"
        body["message"] = str(error) or type(error).__name__
    text = json.dumps(body).encode()
    if len(text) > _RECORD_LIMIT:
        body["message"] = body.get("message", "")[:_RECORD_LIMIT // 4] + "..."
        body["payload"] = ""
        text = json.dumps(body).encode()
    return text


def agree(comm, phase, payload=lambda value: b"", what="zero3"):
    """Runs `phase()` here, then tells every rank how every rank did (see
    the module's docstring). `payload(value)` gives the bytes this rank
    shares on success (e.g. a checksum); Outcome.payloads has every rank's.
    Collective: every rank calls it at the same point."""
    error, value, shared = None, None, b""
    try:
        value = phase()
        shared = payload(value)
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        error = e
    world = comm.size
    if world == 1:
        if error is not None:
            raise error
        return Outcome(value, [shared])
    records = gather_bytes(comm, _record(error is None, error, shared))
    parsed = [json.loads(r.decode()) for r in records]
    if error is not None:
        raise error
    for r, rec in enumerate(parsed):
        if not rec["ok"]:
            cls = _error_class(rec.get("class", ""))
            raise cls(f"{what}: rank {r} of {world} failed: {rec.get('message', '')}")
    return Outcome(value, [bytes.fromhex(rec["payload"]) for rec in parsed])


# Sharded checkpoints that commit atomically, loadable at any world size: the files, the commit
# (the rename of ``latest``), the checksums and the keyed HMAC, and how a load fails without
# touching the engine are described in docs/zero3.md, "Checkpoints that commit atomically".
# Snapshots in memory (_snapshots.py) are written by the same code (``write`` with a ``Target``).
# Re-partitioning on W' ranks: rank r' needs elements [r' s', (r'+1) s') of each flattened
# parameter, which lie in one or a few of the old ranks' shards.

# --- save --------------------------------------------------------------------------


class Target:
    """Where a checkpoint goes and how it commits: a save (rank 0 leads in
    one shared root, everything fsynced, the superseded folders of the tag
    removed) or a snapshot in memory (_snapshots.py: each node's leader
    leads in its node-local root, no fsync, only the new and the previously
    committed tag folders kept). The protocol is the same."""

    def __init__(self, root, tag, leader, what, durable=True, keep_previous=False,
                 node_local=False, indented=True, before_commit=None, reuse=False):
        self.root = root
        self.tag = tag
        self.leader = leader              # this rank writes the folder, manifest and latest
        self.node_local = node_local      # a root per node, each with its leader
        # The manifest indented for people to read (json's C encoder writes
        # only the compact form, several times faster).
        self.indented = indented
        self.what = what                  # names the operation in errors
        self.durable = durable            # fsync files and folders
        self.keep_previous = keep_previous  # double-buffered: keep the last committed one
        self.before_commit = before_commit  # leader: called before the folder is renamed
        # Each rank overwrites its file of the oldest superseded tag folder
        # (double-buffered snapshots: the one the commit would remove).
        self.reuse = reuse


class Written:
    """What a leader has put into the root so far, to remove when the
    save fails (on any rank) before its commit."""

    def __init__(self):
        self.lock = None        # the root's flock
        self.staging = None     # root/<tag>.tmp, once created
        self.final = None       # root/<name>, once renamed
        self.pointer = None     # root/latest.tmp, once created
        self.committed = False  # latest replaced: nothing is removed any more

    def undo(self):
        if not self.committed:
            for path in (self.staging, self.final):
                if path is not None and os.path.lexists(path):
                    remove_tree(path)
            if self.pointer is not None and os.path.lexists(self.pointer):
                with contextlib.suppress(OSError):
                    os.unlink(self.pointer)
        unlock_root(self.lock)
        self.lock = None


def save_target(engine, root, tag=None):
    """The Target of engine.save(root, tag=tag), its arguments checked."""
    if engine._pass_open:
        raise IncompatibleError(
            "zero3: save() in the middle of a pass (a forward without its backward); save "
            "between steps")
    root = path_argument(root, "directory", "zero3 save")
    if tag is None:
        tag = f"step{engine.global_step}"
    check_tag(tag)
    return Target(root, tag, engine.rank == 0, "zero3 save")


def save(engine, root, client_state=None, tag=None):
    write(engine, save_target(engine, root, tag), client_state)


def write(engine, target, client_state=None):
    """Writes and commits one checkpoint as `target` says (see Target).
    Collective; an error on any rank is raised on every rank, after every
    leader removed what it wrote."""
    written = Written()
    try:
        _write(engine, target, client_state, written)
    finally:
        # The leaders alone write the folders; a failure anywhere is raised
        # on every rank by agree(), after every rank stopped writing.
        written.undo()


def _prepare_root(target, staging, written):
    """The leader's start: the root's lock, a killed save's leftovers
    removed, the staging folder created."""
    root = target.root
    try:
        fs("mkdir", root)
        os.makedirs(root, exist_ok=True)
        try:
            written.lock = lock_root(root)
        except BlockingIOError as e:
            raise IoError(f"{root}: another save is writing there (it holds the folder's "
                          "lock); save one at a time") from e
        if written.lock is not None:
            # No live save: every staging folder is a killed one's.
            remove_leftovers(root)
        elif os.path.lexists(staging):
            remove_tree(staging)  # an interrupted save of this tag
        fs("mkdir", staging)
        os.mkdir(staging)
        written.staging = staging
    except OSError as e:
        raise io_error(staging, "cannot create the checkpoint folder", e) from e


class Plan:
    """What the ranks agreed on for one checkpoint, and what this rank
    holds for it: its step, save id, the described state, the staging
    folder and this rank's file in it."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def prepare(engine, target, client_state, written):
    """The first phase of a checkpoint (collective): the state described,
    the leader's root locked and its staging folder made, the save id and
    whether the shards are hashed agreed; returns the Plan."""
    root, what = target.root, target.what
    rank, world = engine.rank, engine.world_size
    staging = os.path.join(root, target.tag + ".tmp")
    scheduler = engine.lr_scheduler
    scheduler_state = scheduler.state_dict() if scheduler is not None else None
    scaler_state = engine._scaler.state_dict() if engine._scaler is not None else None
    signing = [None]  # a leader's key, when it has one

    def described():
        optimizer, groups = optimizer_view(engine)
        parameters, opt = describe(engine, optimizer, groups)
        if target.leader or rank == 0:
            # A leader's key signs its manifest; every rank hashes its shard
            # file when rank 0 has one.
            signing[0] = checkpoint_key()[0]
        if target.leader:
            for name, value in (("client_state", client_state),
                                ("the lr_scheduler's state_dict()", scheduler_state)):
                try:
                    json.dumps(value)
                except (TypeError, ValueError, RecursionError) as e:
                    raise InvalidArgumentError(
                        f"zero3 checkpoint: {name} cannot be written as JSON: {e}") from e
            _prepare_root(target, staging, written)
        plan = None
        if rank == 0:
            plan = json.dumps({"save_id": uuid.uuid4().hex, "signed": signing[0] is not None})
        return optimizer, parameters, opt, plan

    first = agree(engine.comm, described,
                  payload=lambda v: (v[3] or "").encode(), what=what)
    optimizer, parameters, opt, _ = first.value
    agreed = json.loads(first.payloads[0].decode())
    # Every leader writes the manifest from what it holds: the parts that
    # are not the shard records must be the same on all of them, so that
    # the manifest's bytes (and its SHA-256) name the checkpoint everywhere.
    common = {"parameters": parameters, "optimizer": opt, "loss_scaler": scaler_state,
              "lr_scheduler": scheduler_state}
    common_digest = ""
    if target.leader and target.node_local and world > 1:
        common_digest = hashlib.sha256(json.dumps(common).encode()).hexdigest()
    return Plan(rank=rank, world=world, step=engine.global_step, staging=staging,
                stem=rank_stem(rank, world) + ".bin", save_id=agreed["save_id"],
                signed=agreed["signed"], key=signing[0], optimizer=optimizer,
                parameters=parameters, opt=opt, scheduler_state=scheduler_state,
                scaler_state=scaler_state, common_digest=common_digest,
                client_state=client_state)


def shard_records(plan, written_shards, what):
    """The manifest's shard records from every rank's [size, CRC-32C,
    (SHA-256), leader's digest]; IncompatibleError when leaders' manifests
    would differ."""
    shards = []
    digests: dict[str, list[int]] = {}  # a leader's digest -> the leaders with it
    for r, written_shard in enumerate(written_shards):
        record = {"file": rank_stem(r, plan.world) + ".bin", "bytes": written_shard[0],
                  "crc32c": written_shard[1]}
        if plan.signed:
            record["sha256"] = written_shard[2]
        shards.append(record)
        if written_shard[-1]:
            digests.setdefault(written_shard[-1], []).append(r)
    if len(digests) > 1:  # the same outcome on every rank: all payloads are shared
        ranks = "; ".join(f"ranks {v}" for v in digests.values())
        raise IncompatibleError(
            f"{what}: the leaders' optimizer, loss-scaler or scheduler state differ ({ranks} "
            "agree among themselves): their manifests would differ")
    return shards


def commit(plan, target, written, shards):
    """The leader's commit of the staged folder with its manifest; returns
    the folder's final name."""
    manifest = {
        "format": FORMAT, "version": VERSION, "save_id": plan.save_id, "step": plan.step,
        "tag": target.tag, "world_size": plan.world, "shards": shards,
        "parameters": plan.parameters, "optimizer": plan.opt,
        "client_state": plan.client_state, "loss_scaler": plan.scaler_state,
        "lr_scheduler": plan.scheduler_state,
    }
    text = json.dumps(manifest, indent=1 if target.indented else None).encode()
    return _commit(target, plan.staging, written, text, plan.key)


def _write(engine, target, client_state, written):
    plan = prepare(engine, target, client_state, written)
    finish(engine, target, plan, written, lambda: write_shards(engine, target, plan))


def write_shards(engine, target, plan, after=None):
    """This rank's shard file (its values, checksummed as they are
    written); returns its record [size, CRC-32C, (SHA-256), leader's
    digest]. `after`: on cuda, the event the copies wait for (when this
    runs off the training thread). Touches no collective: it may run on a
    thread of its own (_snapshots.py)."""
    path = os.path.join(plan.staging, plan.stem)
    reuse = _superseded_file(target.root, plan.stem) if target.reuse else None
    try:
        shard = write_file(path, shard_chunks(engine, plan.optimizer, plan.parameters,
                                              header(plan.save_id, plan.step, plan.rank,
                                                     plan.world), after),
                           sha256=plan.signed, durable=target.durable, reuse=reuse)
    except OSError as e:
        raise io_error(path, "cannot write the shard file", e) from e
    return shard + [plan.common_digest]


def finish(engine, target, plan, written, wrote):
    """The rest of a checkpoint once this rank's shard file is written
    (`wrote()` gives its record, or raises the write's error): every rank's
    records agreed, then the leaders' commit. Collective."""
    shards_written = agree(engine.comm, wrote,
                           payload=lambda v: json.dumps(v).encode(), what=target.what)
    shards = shard_records(plan, [json.loads(p.decode()) for p in shards_written.payloads],
                           target.what)
    agree(engine.comm, lambda: commit(plan, target, written, shards) if target.leader else None,
          what=target.what)


def _commit(target, staging, written, text, key):
    """The leader's commit of the staged folder (manifest, checksum, HMAC,
    rename, `latest`), then the folders no longer wanted removed."""
    root, tag, durable = target.root, target.tag, target.durable
    checksum = hashlib.sha256(text).hexdigest()
    name = final_name(root, tag)
    final = os.path.join(root, name)
    previous = committed_name(root) if target.keep_previous else None
    try:
        write_file(os.path.join(staging, MANIFEST), [text], durable=durable)
        write_file(os.path.join(staging, CHECKSUM), [f"{checksum}  {MANIFEST}\n".encode()],
                   durable=durable)
        if key is not None:
            mac = hmac.new(key, text, hashlib.sha256).hexdigest()
            write_file(os.path.join(staging, HMAC_FILE), [hmac_text(mac)], durable=durable)
        if target.before_commit is not None:
            target.before_commit()
        if durable:
            fsync_dir(staging)
        fs("rename", staging)
        os.rename(staging, final)
        written.staging, written.final = None, final
        if durable:
            fsync_dir(root)
        pointer = os.path.join(root, LATEST + ".tmp")
        if os.path.lexists(pointer):
            fs("remove", pointer)
            os.unlink(pointer)
        written.pointer = pointer
        write_file(pointer, [pointer_text(name, checksum)], durable=durable)
        fs("rename", pointer)
        os.replace(pointer, os.path.join(root, LATEST))  # the commit
        written.committed = True
        if durable:
            fsync_dir(root)
    except OSError as e:
        raise io_error(final, "cannot commit the checkpoint", e) from e
    for entry in os.listdir(root):
        if entry == name or entry == previous:
            continue
        if target.keep_previous:
            # Double-buffered: every other tag folder goes.
            unwanted = tag_problem(entry) is None and os.path.isdir(os.path.join(root, entry))
        else:
            # Superseded: every other folder of this tag (the previous save,
            # or one an interrupted save renamed but never committed).
            unwanted = entry == tag or (entry.startswith(tag + ".") and
                                        entry[len(tag) + 1:].isdigit())
        # Stale: the staging folders of interrupted saves.
        if unwanted or (entry.endswith(".tmp") and entry != LATEST + ".tmp"):
            remove_tree(os.path.join(root, entry))
    return name


def _superseded_file(root, stem):
    """This rank's file in the oldest tag folder of a double-buffered root
    that `latest` does not name (the one the next commit removes), or None.
    Once the ranks agreed that the newest snapshot is copied where it must
    be (_snapshots.py), nothing reads that folder any more."""
    current = committed_name(root)
    if current is None:
        return None
    oldest = None
    for entry in os.listdir(root):
        if entry == current or tag_problem(entry) is not None:
            continue
        step = entry[4:].partition(".")[0] if entry.startswith("step") else ""
        path = os.path.join(root, entry, stem)
        if step.isdigit() and os.path.isfile(path) and not os.path.islink(path):
            if oldest is None or int(step) < oldest[0]:
                oldest = (int(step), path)
    return None if oldest is None else oldest[1]


def committed_name(root):
    """The folder root/latest names now, or None (none, or unreadable)."""
    try:
        pointer = read_latest(root, os.path.realpath(root))
    except Error:
        return None
    return None if pointer is None else pointer.name


# --- load --------------------------------------------------------------------------


def _read(engine, root):
    """Everything a load needs, read and checked; the engine is untouched.
    Returns (manifest path, manifest, shard values per parameter, optimizer
    state dict or None)."""
    key, variable = checkpoint_key()
    source = resolve(root)
    path, manifest = read_manifest(source, key, variable)
    check_model(engine, path, manifest)
    check_loss_scaler(engine, path, manifest)
    saved = manifest["parameters"]
    optimizer, groups = optimizer_view(engine)
    saved_opt = manifest.get("optimizer")
    if optimizer is not None and saved_opt is None:
        raise IncompatibleError(f"{path}: the checkpoint has no optimizer state, the engine has "
                                f"a {optimizer_class(optimizer)}")
    if optimizer is not None and saved_opt.get("class") != optimizer_class(optimizer):
        raise IncompatibleError(
            f"{path}: the checkpoint's optimizer is {saved_opt.get('class')}, the engine's "
            f"{optimizer_class(optimizer)}")

    # Byte layout of every old rank's payload (the same for all of them).
    offsets, layout = shard_layout(saved, path)

    old_world = manifest["world_size"]
    files = RankFiles(source, path, manifest, layout, signed_by=variable)
    try:
        values = []
        for info, _meta, (old_shard, entry) in zip(engine._params, saved, offsets):
            first = engine.rank * info.shard_numel
            last = min(first + info.shard_numel, info.numel)
            by_key = {}  # state key (None: the parameter) -> this rank's shard of it
            for key, dtype, base in entry:
                esize = dtype.itemsize
                out = torch.zeros(info.shard_numel, dtype=dtype)
                raw = out.view(torch.uint8).numpy()
                q = first // old_shard if old_shard else 0
                while first < last and q < old_world:
                    lo = max(first, q * old_shard)
                    hi = min(last, (q + 1) * old_shard)
                    if lo < hi:
                        f, start = files.get(q)
                        f.seek(start + base + (lo - q * old_shard) * esize)
                        want = (hi - lo) * esize
                        got = f.readinto(memoryview(raw)[(lo - first) * esize:][:want])
                        if got != want:
                            raise IoError(f"{f.name}: short read of parameter '{info.name}'")
                    if hi >= last:
                        break
                    q += 1
                by_key[key] = out
            values.append(by_key)
    finally:
        files.close()
    state = None
    if optimizer is not None:
        state = _optimizer_state(engine, path, groups, saved_opt, saved, values)
    return path, manifest, values, state


def _optimizer_state(engine, path, groups, saved_opt, saved, values):
    saved_groups = saved_opt.get("param_groups") or []
    if [g.get("params") for g in saved_groups] != groups:
        raise IncompatibleError(
            f"{path}: the optimizer's parameter groups differ from the checkpoint's "
            f"({[len(g) for g in groups]} vs {[len(g.get('params') or []) for g in saved_groups]} "
            "parameters per group)")
    index = {pid: k for k, pid in enumerate(p for g in groups for p in g)}
    scalars = saved_opt.get("state") or {}
    state = {}
    for info, meta, pieces in zip(engine._params, saved, values):
        if info.id not in index:
            continue
        entry = {k: from_json(v, path) for k, v in (scalars.get(str(info.id)) or {}).items()}
        for k in meta["state"]:
            entry[k["key"]] = pieces[k["key"]].to(info.shard.device)
        if entry:
            state[index[info.id]] = entry
    param_groups = []
    for group, ids in zip(saved_groups, groups):
        g = {k: from_json(v, path) for k, v in group.items() if k != "params"}
        if "betas" in g and isinstance(g["betas"], list):
            g["betas"] = tuple(g["betas"])
        g["params"] = [index[p] for p in ids]
        param_groups.append(g)
    return {"state": state, "param_groups": param_groups}


def load(engine, root, lr_scheduler=True):
    return load_manifest(engine, root, lr_scheduler).get("client_state")


def load_manifest(engine, root, lr_scheduler=True):
    """load(), returning the loaded checkpoint's manifest."""
    if engine._pass_open:
        raise IncompatibleError(
            "zero3: load() in the middle of a pass (a forward without its backward)")
    root = path_argument(root, "directory", "zero3 load")
    path, manifest, values, state = agree(engine.comm, lambda: _read(engine, root),
                                          what="zero3 load").value
    optimizer = engine.optimizer
    if optimizer is not None:
        # The optimizer's own checks of the state may fail on one rank: the
        # ranks agree on them too, and every rank puts its state back.
        before = copy.deepcopy(optimizer.state_dict())

        def apply():
            try:
                optimizer.load_state_dict(state)
            except Exception as e:
                optimizer.load_state_dict(before)
                raise IoError(f"{path}: the optimizer state does not load into the "
                              f"{type(optimizer).__name__}: {type(e).__name__}: {e}") from e
        try:
            agree(engine.comm, apply, what="zero3 load")
        except BaseException:
            optimizer.load_state_dict(before)
            raise
    engine.shards_writable()
    with torch.no_grad():
        for info, pieces in zip(engine._params, values):
            info.shard.copy_(pieces[None].to(info.shard.device))
    engine.shards_changed()
    engine.global_step = manifest["step"]
    scaler = engine._scaler
    if scaler is not None and manifest.get("loss_scaler") is not None:
        scaler.load_state_dict(manifest["loss_scaler"])
    saved_scheduler = manifest.get("lr_scheduler")
    if lr_scheduler and engine.lr_scheduler is not None and saved_scheduler is not None:
        try:
            engine.lr_scheduler.load_state_dict(saved_scheduler)
        except Exception as e:
            raise IoError(f"{root}: the learning-rate scheduler's state does not load into the "
                          f"{type(engine.lr_scheduler).__name__}: {type(e).__name__}: {e}") from e
    if engine.rank == 0 and os.path.lexists(os.path.join(root, LATEST)):
        clean_after_load(root)  # a checkpoint root (not a tag folder given alone)
    return manifest
