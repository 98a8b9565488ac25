"""In-memory snapshots of the training state, for ``ductile agent``: when
a node dies, the job goes on from the newest state the surviving nodes
hold in memory, without reading a disk checkpoint.

When: the agent sets ``DUCTILE_SNAPSHOT_DIR`` (its node's ``own/`` folder,
on tmpfs) for every worker; with ``[zero] snapshot_interval`` N > 0 (1 by
default; DeepSpeed: ``"snapshot": {"interval": N}``), every ``step()``
that makes ``global_step`` a multiple of N writes a snapshot of that step.
Without the variable, or with N = 0, nothing is written.

What: a checkpoint in the format of _checkpoint.py, tag ``step<N>``,
written by the same protocol as ``engine.save`` (staging folder,
manifest, checksum, rename, ``latest``) with these differences: each node
has its own root, where every rank writes its own ``rank<r>-of-<W>.bin``
and the node's leader (the rank whose LOCAL_RANK is 0) does what rank 0
does in a save; the manifest lists every rank's shard and its bytes are
the same on every node (so its SHA-256, manifest.json.sha256, names the
snapshot across nodes); nothing is fsynced; the manifest is compact JSON;
the client state is ``engine.snapshot_client_state(step)`` when it is set
(``engine.restored_client_state`` once restored); and only the new and the previously committed
tag folders are kept. The leader also writes ``replicas`` (``[zero] snapshot_replicas`` and a
newline) before its first snapshot commits: how many other nodes the
agents copy each snapshot to.

A snapshot that fails (a full tmpfs, say) fails on every rank alike
(agree), is removed, and is logged as a warning on the ``ductile.zero3``
logger: training goes on, with the previous snapshot as the newest. A
failed collective (a rank gone) is raised.

Redundancy: the agents copy each committed snapshot to ``replicas``
other nodes and record in ``own/replicated`` (``<DUCTILE_SNAPSHOT_DIR>/replicated``)
the newest step every one of them holds, or ``off`` when the round has no
other node. Before the optimizer changes the state again (step(), or
backward() with step_in_backward), the ranks agree (one all-reduce) that
every node's last snapshot is replicated, and wait until it is: a node lost
at any moment then costs at most snapshot_interval steps. A wait longer
than REPLICATION_WAIT seconds (an agent that stopped copying) is logged
and given up for that snapshot.

Restore: when the agent starts a round from memory it sets
``DUCTILE_SNAPSHOT_RESTORE`` to a complete snapshot folder; the engine
loads it when it is built (collective), at any world size, and
``engine.restored_from_memory`` is its step. Once a newer snapshot is
committed and, by before_update's agreement, held by its replicas on every
node, the restored copy and the last round's snapshots are memory nothing
needs: each node's leader asks its agent to free them (it writes
``own/release``, the restored step, and waits until the agent removed it,
RELEASE_WAIT seconds at most) and every rank waits for the leaders before it
goes on, so that no rank writes its next snapshot beside them. The scheduler's state is
applied to the scheduler the engine gets afterwards (``engine.lr_scheduler
= ...``), which a DeepSpeed config's ``scheduler`` and the drop-ins set.

Disk checkpoints from a snapshot: ``engine.save(root, background=True)``
right after a step whose snapshot committed writes the disk checkpoint on a
thread from that snapshot's files (BackgroundSave), so that the step pays
for the snapshot only. The ranks agree on the save (its id, the leader's
staging folder) before save() returns; each rank's thread then copies its
snapshot file under the save's header, fsyncs it and writes
``<its file>.done`` (its size and CRC-32C) into the staging folder; rank
0's thread waits for every rank's (SAVE_WAIT seconds at most), then commits
as a save does. The next step (before its optimizer update, while the
snapshot is still one of the two kept), save, load or close, or
``engine.wait_for_save()``, joins the thread and raises its error on every
rank. A process that exits waits for the thread (it is not a daemon).
Without a committed snapshot of the current step on every rank, the save
is written in the foreground, with a warning.

The shard file is written through a mapping of it (_snapshot_mapping.py):
the tensors are copied straight into it (on cuda by the copy engine, the
mapping pinned), then checksummed over the mapping.

Overlap: with ``engine.snapshot_overlap = True``, step() agrees on the
snapshot's plan and leaves its shard file to a thread (SnapshotWrite) that
copies the shards and checksums the file while the next step's forward and
backward run (they read the shards, never write them). The next optimizer
update (before_update) waits for the copies only (on cuda on the device,
not the host), and commits, as step() would have, when every rank's thread
has its record (one all-reduce says; on the cpu the copies compute the
checksum, so it has); a save, load, close or shards_writable() waits for
the thread and commits. The bytes and the order of the commits
are the same; the snapshot of step N is committed during step N + 1, so a
node lost before that costs one step more. When the writes cannot keep up,
a snapshot due while the last one's thread still runs on some rank is
skipped (counted: engine.stats()'s snapshots_skipped), the last one commits
once every rank's record is there, and a warning says once the interval
held.

Threading: every method runs on the training thread, as step() does; a
BackgroundSave's or SnapshotWrite's thread touches only its files (and, on
cuda, its copy stream)."""

import contextlib
import contextvars
import json
import logging
import os
import threading
import time

import torch

from ..._errors import CommunicationError, Error, InvalidArgumentError, IoError
from . import _checkpoint
from ._checkpoint import agree
from ._checkpoint_files import (header, io_error, rank_stem, read_header, shard_layout,
                                write_file, write_small)
from . import _round_notice
from ._round_notice import RoundHold
from ._snapshot_mapping import MAPPINGS, SnapshotFile, write_shards

SNAPSHOT_DIR_ENV = "DUCTILE_SNAPSHOT_DIR"
RESTORE_ENV = "DUCTILE_SNAPSHOT_RESTORE"
# Seconds to wait for DUCTILE_SNAPSHOT_RESTORE to appear: the agent started
# the workers while it still gathers the snapshot (they import and build
# meanwhile), and links the folder there once it is whole.
RESTORE_WAIT_ENV = "DUCTILE_SNAPSHOT_RESTORE_WAIT"
REPLICAS_FILE = "replicas"
REPLICATED_FILE = "replicated"
RELEASE_FILE = "release"
# Seconds rank 0's thread of a background save waits for every rank's
# shard file: a rank that died never writes its record.
SAVE_WAIT = 600.0
_COPY_BLOCK = 16 << 20
# Seconds a step waits for the agents to copy the last snapshot before it
# goes on without (logged): far above a copy's time, short enough that a
# stuck agent does not stall training.
REPLICATION_WAIT = 60.0
# Seconds a node's leader waits for its agent to take a release request
# (one pass of the agent's loop, --poll-interval, usually takes it).
RELEASE_WAIT = 10.0

_log = logging.getLogger("ductile.zero3")


def _local_rank():
    """This process' rank on its node: LOCAL_RANK (torchrun, ``ductile
    agent``), else Open MPI's; None when no launcher says."""
    for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise InvalidArgumentError(
                    f"zero3 snapshots: {name} = {value!r}; valid: this process' rank on its "
                    "node, an integer >= 0") from None
    return None


def _ordinal(n):
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _client_state(engine):
    """The snapshot's client state: engine.snapshot_client_state's value for
    the step, or None."""
    provide = engine.snapshot_client_state
    return None if provide is None else provide(engine.global_step)


def _write(engine, target):
    """_checkpoint.write of a snapshot, its shard file written through its
    mapping (_snapshot_mapping.py)."""
    written = _checkpoint.Written()
    try:
        plan = _checkpoint.prepare(engine, target, _client_state(engine), written)
        _checkpoint.finish(engine, target, plan, written,
                           lambda: write_shards(engine, target, plan))
    finally:
        written.undo()


# False while engines that are not the training's are made (a DPO reference
# model's: not_the_training).
_TRAINING = contextvars.ContextVar("ductile_zero3_training", default=True)


@contextlib.contextmanager
def not_the_training():
    """While it lasts, the engines made are not the training's (a reference
    model's beside the policy): they write no snapshots, restore none and
    take no round notices; the training's engine, made outside, does."""
    token = _TRAINING.set(False)
    try:
        yield
    finally:
        _TRAINING.reset(token)


class Snapshots:
    """The snapshot policy of one engine: when to write one, where, and
    the restore at start (see the module's docstring)."""

    def __init__(self, engine, interval, replicas):
        self.engine = engine
        self.interval = interval
        self.replicas = replicas
        self.root = os.environ.get(SNAPSHOT_DIR_ENV) or ""
        # Whether this engine is the training's (not_the_training).
        self.training = _TRAINING.get()
        self.enabled = bool(self.root) and interval > 0 and self.training
        local = _local_rank() if self.enabled else None
        # Without a launcher's word, one node: rank 0 leads.
        self.leader = local == 0 if local is not None else engine.rank == 0
        self._replicas_written = False
        self._last = None  # the step of the last snapshot attempted
        self._written = None  # the step of the last snapshot committed
        self.pending_save = None  # the BackgroundSave not yet joined
        self._committed = None  # the step of the last snapshot written, not yet known replicated
        # The restored manifest's scheduler state, for the scheduler set
        # later, and the restored optimizer groups' hyperparameters.
        self.scheduler_state = None
        self.group_values = []
        self._restored = None  # the step restored from memory, until the agent freed it
        # The training thread's time blocked by the snapshots (engine.stats()):
        # a snapshot's write and commit in step(), and the wait for its
        # replicas before the next optimizer update, summed over the
        # snapshots whose wait is over (`timed`); `_open` holds the first
        # part of the snapshot still waiting for its replicas.
        self.blocked_ns = 0
        self.timed = 0
        self._open: tuple[int, int] | None = None  # (step, ns blocked so far)
        # engine.snapshot_overlap: the shard file written on a thread while
        # the next step's forward and backward run (SnapshotWrite), committed
        # before the next optimizer update.
        self.overlap = False
        self.writing: SnapshotWrite | None = None  # the write not yet committed
        # Snapshots due while the last one was still being written, not
        # taken (engine.stats()), and whether the interval held is logged.
        self.skipped = 0
        self._hold_logged = False
        # In-place recovery's question (_rejoin.Recovery): (whether the agent
        # asks this rank to pause at this update (a node joins), whether
        # this step could run again); None: never asked.
        self.hold_requested = None

    def due(self, step):
        return self.enabled and step % self.interval == 0 and step != self._last

    def after_step(self):
        """Called by step() after the optimizer step (and the scheduler's):
        writes the snapshot of global_step when it is due."""
        step = self.engine.global_step
        if not self.due(step):
            return
        self._last = step
        if self.writing is not None:
            # Still being written at the last update: one more thread would
            # only queue behind it, so it commits first or this one is skipped.
            if not self._all_written():
                self.skipped += 1
                self.writing.skipped += 1
                return
            self.finish_write()
            if self._open is not None:
                self._time_blocked(0)
        start = time.perf_counter_ns()
        target = _checkpoint.Target(self.root, f"step{step}", self.leader, "zero3 snapshot",
                                    durable=False, keep_previous=True, node_local=True,
                                    reuse=True,
                                    indented=False, before_commit=self._write_replicas)
        try:
            if self.overlap:
                self.writing = SnapshotWrite(self.engine, target, step)
            else:
                _write(self.engine, target)
                self._committed_at(step)
        except CommunicationError:
            raise  # a rank is gone: the job cannot go on, snapshot or not
        except Error as e:
            self._failed(step, e)
        finally:
            self._open = (step, time.perf_counter_ns() - start)
            if self.writing is None and self._committed is None:  # nothing follows
                self._time_blocked(0)

    def _all_written(self):
        """Whether every rank's snapshot thread has its record (or its
        error) (collective)."""
        assert self.writing is not None  # asked only while one is written
        done = self.writing.done()
        if self.engine.world_size == 1:
            return done
        return self.engine.all_reduce(torch.tensor([1.0 if done else 0.0]), "min").item() == 1.0

    def close(self):
        """engine.close(): the last snapshot committed, the files' mappings
        let go (collective)."""
        self.finish_save()
        MAPPINGS.close()

    def _committed_at(self, step):
        self._written = step
        self._committed = step if self.replicas > 0 else None

    def _failed(self, step, error):
        # Agreed: every rank raised it and goes on alike.
        _log.warning("zero3 snapshot of step %d into %s (%s) failed, training goes on: %s",
                     step, self.root, SNAPSHOT_DIR_ENV, error)

    def finish_write(self):
        """Commits the snapshot whose shard file a thread writes (waiting
        for the thread first), if there is one (collective)."""
        writing, self.writing = self.writing, None
        if writing is None:
            return
        start = time.perf_counter_ns()
        try:
            writing.finish(self.engine)
            self._committed_at(writing.step)
            if writing.skipped and not self._hold_logged:
                self._hold_logged = True
                held = self.interval * (writing.skipped + 1)
                _log.warning("zero3 snapshots: snapshot_interval %d is faster than the writes "
                             "(%.1f ms); holding every %s step", self.interval,
                             writing.seconds * 1e3, _ordinal(held))
        except CommunicationError:
            raise
        except Error as e:
            self._failed(writing.step, e)
        finally:
            if self._open is not None:
                step, blocked = self._open
                self._open = (step, blocked + time.perf_counter_ns() - start)
                if self._committed is None:
                    self._time_blocked(0)

    def _time_blocked(self, waited_ns):
        """Counts the open snapshot's blocked time, its replicas' wait
        (`waited_ns`) added."""
        assert self._open is not None  # called while a snapshot's time is open
        step, blocked = self._open
        self._open = None
        blocked += waited_ns
        self.blocked_ns += blocked
        self.timed += 1
        _log.debug("zero3 snapshot of step %d: the training thread was blocked %.2f ms",
                   step, blocked / 1e6)

    def _replicated(self):
        """The newest step the agents copied to every replica, as this
        node's agent wrote it; None when there is nothing to wait for (no
        other node, or an agent that writes no such file)."""
        path = os.path.join(self.root, REPLICATED_FILE)
        try:
            with open(path, "rb") as f:
                text = f.read(64).strip()
        except OSError:
            return None
        if text == b"off":
            return None
        try:
            return int(text)
        except ValueError:
            return None  # being replaced: a rename makes that rare; read again next time

    def before_update(self):
        """Called before the optimizer changes the shards: waits until every
        node's last snapshot is held by its replicas (collective: every rank
        calls it at the same point, and all leave together); a background
        save from the last snapshot is joined first."""
        if self.pending_save is not None:
            self.finish_save()
        elif self.writing is not None:
            self.writing.order_update()
            if self._all_written():
                self.finish_write()
        want = self._committed
        if want is None:
            self._release_restored()
            return
        start = time.perf_counter_ns()
        try:
            self._wait_for_replicas(want)
        finally:
            if self._open is not None:
                self._time_blocked(time.perf_counter_ns() - start)

    def _wait_for_replicas(self, want):
        engine = self.engine
        deadline = time.monotonic() + REPLICATION_WAIT
        waited = False
        asked = self.hold_requested
        while True:
            got = self._replicated()
            timed_out = time.monotonic() > deadline
            ready = got is None or got >= want or timed_out
            # The same all-reduce agrees on a pause the agent asked of any
            # rank: every rank leaves this update together, when every rank
            # can run its step again.
            hold, replayable = asked() if asked is not None else (False, True)
            agreed, go_on, can = engine.all_reduce(torch.tensor(
                [1.0 if ready else 0.0, 0.0 if hold else 1.0, 1.0 if replayable else 0.0]),
                "min").tolist()
            if agreed == 1.0:
                break
            waited = True
            time.sleep(0.002)
        if timed_out and not (got is None or got >= want):
            _log.warning("zero3 snapshot of step %d: its copies to %d other node(s) did not "
                         "complete in %.0f s (%s/%s says %s); training goes on without waiting",
                         want, self.replicas, REPLICATION_WAIT, self.root, REPLICATED_FILE, got)
        else:
            if waited:
                _log.debug("zero3 snapshot of step %d: waited for its replicas", want)
            self._release_restored()
        self._committed = None
        if go_on != 1.0 and can != 1.0 and hold:
            # Some rank's step cannot run again (a loss computed outside the
            # forward): no pause; the agent restarts the workers.
            _round_notice.refuse_hold(self.engine._recovery.watch.path)
        elif go_on != 1.0:
            raise RoundHold(f"zero3: paused before the update of step {engine.global_step + 1} "
                            f"for a new round (the agent's request); the snapshot of step {want} "
                            "is committed and copied")

    def _release_restored(self):
        """After a restore, once a newer snapshot is committed and replicated
        (collective: every rank calls it at the same point): the node's
        leader asks its agent to free the restored copy and the snapshots up
        to the restored step, and waits for it; then every rank waits for
        every leader."""
        step = self._restored
        if step is None or self._written is None or self._written <= step:
            return
        self._restored = None
        if self.leader:
            self._ask_release(step)
        self.engine.all_reduce(torch.tensor([1.0]), "min")

    def _ask_release(self, step):
        path = os.path.join(self.root, RELEASE_FILE)
        try:
            write_small(path, f"{step}\n")
        except OSError as e:
            _log.warning("zero3 snapshots: cannot ask the agent to free the restored snapshot of "
                         "step %d (%s): %s; it is freed later", step, path, e)
            return
        deadline = time.monotonic() + RELEASE_WAIT
        while os.path.lexists(path):
            if time.monotonic() > deadline:
                _log.warning("zero3 snapshots: the agent did not take %s within %.0f s "
                             "(RELEASE_WAIT); training goes on, the restored snapshot of step %d "
                             "is freed later", path, RELEASE_WAIT, step)
                try:
                    os.unlink(path)
                except OSError:
                    pass  # taken meanwhile
                return
            time.sleep(0.005)

    def save(self, root, client_state, tag):
        """engine.save(background=True): from this step's snapshot on a
        thread, or in the foreground when some rank has none (collective)."""
        self.finish_save()
        engine = self.engine
        target = _checkpoint.save_target(engine, root, tag)
        source = self._source(engine.global_step)
        everywhere = engine.all_reduce(torch.tensor([1.0 if source else 0.0]), "min").item()
        if source is None or everywhere != 1.0:
            if engine.rank == 0:
                _log.warning("zero3 save into %s: no snapshot of step %d in memory on every "
                             "rank (%s, snapshot_interval); saved in the foreground",
                             target.root, engine.global_step, SNAPSHOT_DIR_ENV)
            _checkpoint.write(engine, target, client_state)
            return
        self.pending_save = BackgroundSave(engine, target, client_state, source)

    def finish_save(self):
        """Commits the snapshot a thread writes, if any; joins the
        background save, if one is running, and raises its error on every
        rank (collective)."""
        self.finish_write()
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            pending.finish(self.engine.comm)

    def _source(self, step):
        """This rank's file of the committed snapshot of `step`, or None."""
        if not self.enabled or self._written != step:
            return None
        if _checkpoint.committed_name(self.root) != f"step{step}":
            return None
        engine = self.engine
        path = os.path.join(self.root, f"step{step}",
                            rank_stem(engine.rank, engine.world_size) + ".bin")
        return path if os.path.isfile(path) and not os.path.islink(path) else None

    def _write_replicas(self):
        """The leader's `replicas` file, once, before its first commit."""
        if self._replicas_written:
            return
        path = os.path.join(self.root, REPLICAS_FILE)
        try:
            write_small(path, f"{self.replicas}\n")
        except OSError as e:
            raise io_error(path, "cannot write the snapshot's replica count", e) from e
        self._replicas_written = True

    def restore(self):
        """Loads DUCTILE_SNAPSHOT_RESTORE when it is set (collective);
        returns the restored step, or None."""
        folder = os.environ.get(RESTORE_ENV)
        engine = self.engine
        if not folder or engine.optimizer is None or not self.training:
            # The snapshot is the training's state: an engine that does not
            # train (an evaluation's, a DPO reference model's) keeps its own.
            return None
        _await_folder(folder)
        try:
            manifest = _checkpoint.load_manifest(engine, folder, lr_scheduler=False)
        except Error as e:
            raise type(e)(f"{RESTORE_ENV}={folder}: the snapshot to resume from does not load: "
                          f"{e}", kind=e.kind, type=e.type) from e
        self.scheduler_state = manifest.get("lr_scheduler")
        engine.restored_client_state = manifest.get("client_state")
        self._restored = engine.global_step
        optimizer = engine.optimizer
        if optimizer is not None:
            self.group_values = [{k: v for k, v in g.items() if k != "params"}
                                 for g in optimizer.param_groups]
        return engine.global_step

    def apply_scheduler_state(self, scheduler):
        """Gives the first scheduler set after the restore the snapshot's
        state. A scheduler built after the restore has reset the
        optimizer's learning rates to its first step's: the restored
        groups' values are put back."""
        if scheduler is None or self.scheduler_state is None:
            return
        state, self.scheduler_state = self.scheduler_state, None
        try:
            scheduler.load_state_dict(state)
        except Exception as e:
            raise InvalidArgumentError(
                f"{RESTORE_ENV}: the snapshot's learning-rate scheduler state does not load "
                f"into the {type(scheduler).__name__}: {type(e).__name__}: {e}") from e
        optimizer = self.engine.optimizer
        if optimizer is not None:
            for group, values in zip(optimizer.param_groups, self.group_values):
                group.update(values)


def _await_folder(folder):
    """Returns once `folder` exists, when DUCTILE_SNAPSHOT_RESTORE_WAIT
    allows waiting for it; IoError naming both when it does not come."""
    value = os.environ.get(RESTORE_WAIT_ENV, "")
    try:
        wait = float(value) if value else 0.0
    except ValueError:
        raise InvalidArgumentError(f"{RESTORE_WAIT_ENV} = {value!r}; valid: seconds, a number "
                                   ">= 0") from None
    deadline = time.monotonic() + wait
    while not os.path.exists(folder):
        if time.monotonic() >= deadline:
            if wait > 0:
                raise IoError(f"{RESTORE_ENV}={folder}: the snapshot to resume from did not "
                              f"come within {wait:g} s ({RESTORE_WAIT_ENV})")
            return  # loaded as it is: the load names what is missing
        time.sleep(0.01)


class SnapshotWrite:
    """One snapshot whose shard file (its values and their CRC-32C) a
    thread writes while training goes on (engine.snapshot_overlap): the
    plan is agreed on the training thread first (_checkpoint.prepare,
    collective), the records and the commit after the thread, on the
    training thread again (finish(), at an update once its record is there),
    so the bytes and the commits are those of a snapshot written in
    step(). The thread copies the values into the file's mapping (on cuda:
    queues the copies on a copy stream), sets `copied`, then checksums the
    file; the next optimizer update waits for `copied` only (order_update)."""

    def __init__(self, engine, target, step):
        self.target = target
        self.step = step
        self.written = _checkpoint.Written()
        try:
            self.plan = _checkpoint.prepare(engine, target, _client_state(engine), self.written)
            self.file = SnapshotFile(engine, target, self.plan)
        except BaseException:
            self.written.undo()
            raise
        self.record = None
        self.error = None
        self.seconds = 0.0  # the thread's time, once it ended
        self.skipped = 0  # the snapshots skipped while this one was written
        # Set once the copies are done (cpu) or queued behind file.copied
        # (cuda), or failed: the shards may change after it.
        self.copied = threading.Event()
        device = engine.device
        after = None
        if device.type == "cuda":
            # The copies start after the step's work on the training
            # thread's stream, on the training thread's device.
            after = torch.cuda.Event()
            after.record()
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        self.thread = threading.Thread(target=self._run, args=(device, after),
                                       name="ductile-zero3-snapshot")
        self.thread.start()

    def _run(self, device, after):
        start = time.perf_counter()
        try:
            # The thread's current device is its own: the rank's, for the
            # copy stream.
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                self.file.copy(after)
                if self.file.crc is not None and not self.file.signed:
                    # The copies computed the checksum (cpu): the record is
                    # ready with them, and the update that waits for them
                    # commits.
                    self.record = self.file.finish()
                self.copied.set()
                if self.record is None:
                    self.record = self.file.finish()
        except Exception as e:  # noqa: BLE001 - raised on the training thread by finish()
            self.error = e
        finally:
            self.seconds = time.perf_counter() - start
            self.copied.set()

    def done(self):
        """Whether the thread's record or error is there."""
        return self.record is not None or self.error is not None

    def order_update(self):
        """Before the optimizer changes the shards: on the cpu, waits until
        the thread copied them; on cuda, until it queued the copies, and
        makes the current stream wait for them (the host does not)."""
        self.copied.wait()
        if self.file.copied is not None:
            torch.cuda.current_stream().wait_event(self.file.copied)

    def _result(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.record

    def finish(self, engine):
        """Waits for the thread, then agrees on every rank's file and
        commits (collective); raises the first failure on every rank."""
        try:
            _checkpoint.finish(engine, self.target, self.plan, self.written, self._result)
        finally:
            self.thread.join()
            self.written.undo()


class BackgroundSave:
    """One disk checkpoint written from a snapshot's files on a thread (see
    the module's docstring). Built on the training thread after the save's
    first agreement; finish() joins it there."""

    def __init__(self, engine, target, client_state, source):
        self.target = target
        self.source = source
        self.written = _checkpoint.Written()
        try:
            self.plan = _checkpoint.prepare(engine, target, client_state, self.written)
        except BaseException:
            self.written.undo()
            raise
        self.copy_error = None  # this rank's copy's
        self.error = None  # the commit's (rank 0)
        self.copied = threading.Event()  # this rank's copy ended, well or not
        self.cancel = threading.Event()  # rank 0: another rank's copy failed
        self.thread = threading.Thread(target=self._run, name="ductile-zero3-save")
        self.thread.start()

    def finish(self, comm):
        """Waits for this rank's copy, agrees on every rank's, then joins
        the thread (rank 0's commits meanwhile) and agrees on the commit;
        raises the first failure on every rank (collective)."""
        self.copied.wait()
        what = self.target.what

        def raise_if(error):
            if error is not None:
                raise error

        try:
            try:
                agree(comm, lambda: raise_if(self.copy_error), what=what)
            except BaseException:
                self.cancel.set()  # rank 0's thread waits for records that will not come
                raise
            finally:
                self.thread.join()
        finally:
            # Every rank's copy has ended: rank 0 may remove the staging
            # folder (unless committed) and let the root's lock go.
            self.written.undo()
        agree(comm, lambda: raise_if(self.error), what=what)

    def _run(self):
        plan, target = self.plan, self.target
        try:
            try:
                record = self._copy() + [plan.common_digest]
                self._report(os.path.join(plan.staging, plan.stem + ".done"), record)
            except Exception as e:  # noqa: BLE001 - raised on the training thread by finish()
                self.copy_error = e
                return
            finally:
                self.copied.set()
            if target.leader:
                records = self._gather()
                shards = _checkpoint.shard_records(plan, records, target.what)
                _checkpoint.commit(plan, target, self.written, shards)
        except Exception as e:  # noqa: BLE001 - raised on the training thread by finish()
            self.error = e

    def _copy(self):
        """This rank's shard file: the snapshot's values under the save's
        header; returns [size, CRC-32C, (SHA-256)]."""
        plan, source = self.plan, self.source
        path = os.path.join(plan.staging, plan.stem)
        with open(source, "rb") as f:
            old, offset = read_header(f, source)
            want = {"step": plan.step, "rank": plan.rank, "world_size": plan.world}
            got = {k: old.get(k) for k in want}
            if got != want:
                raise IoError(f"{source}: the snapshot's shard file is of {got}, the save "
                              f"of {want}")
            size = os.fstat(f.fileno()).st_size - offset
            layout = shard_layout(plan.parameters, source)[1]
            if size != layout:
                raise IoError(f"{source}: {size} bytes of values, the state takes {layout}: "
                              "the snapshot is damaged")

            def chunks():
                yield header(plan.save_id, plan.step, plan.rank, plan.world)
                while block := f.read(_COPY_BLOCK):
                    yield block

            try:
                return write_file(path, chunks(), sha256=plan.signed, durable=True)
            except OSError as e:
                raise io_error(path, "cannot write the shard file", e) from e

    @staticmethod
    def _report(path, record):
        """Writes this rank's record for rank 0's thread (atomically)."""
        part = path + ".part"
        try:
            with open(part, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, path)
        except OSError as e:
            raise io_error(path, "cannot write the shard file's record", e) from e

    def _gather(self):
        """Rank 0: every rank's record, in rank order, once all are there;
        the records are removed from the staging folder."""
        plan, what = self.plan, self.target.what
        paths = [os.path.join(plan.staging, rank_stem(r, plan.world) + ".bin.done")
                 for r in range(plan.world)]
        records: list = [None] * plan.world
        deadline = time.monotonic() + SAVE_WAIT
        while True:
            for r, path in enumerate(paths):
                if records[r] is not None:
                    continue
                try:
                    with open(path, "rb") as f:
                        text = f.read(1 << 16)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise io_error(path, "cannot read a rank's record", e) from e
                try:
                    record = json.loads(text.decode())
                except (UnicodeDecodeError, ValueError) as e:
                    raise IoError(f"{path}: rank {r}'s record does not parse: {e}") from e
                records[r] = record
            missing = [r for r, record in enumerate(records) if record is None]
            if not missing:
                break
            if self.cancel.is_set():
                raise IoError(f"{what}: not committed: ranks {missing} failed to copy their "
                              "snapshot files")
            if time.monotonic() > deadline:
                raise IoError(f"{what}: ranks {missing} did not write their shard files within "
                              f"{SAVE_WAIT:.0f} s (SAVE_WAIT)")
            time.sleep(0.01)
        for path in paths:
            try:
                os.unlink(path)
            except OSError as e:
                raise io_error(path, "cannot remove a rank's record", e) from e
        return records
