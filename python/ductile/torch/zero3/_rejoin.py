"""In-place recovery (the engine's side): a worker of ``ductile agent`` whose peer is lost goes
on in the next round in the same process, without a restart of Python, torch or the model.

``engine.rejoin(notice)`` (``rejoin`` here) leaves the old world and enters the notice's round
(_round_notice.py): background snapshot threads are joined and their files dropped, the pass in
progress abandoned, the hooks removed, torch's default process group destroyed (locally: a dead
peer does not hold it up) and created again from the notice's rank, world size and TCPStore (the
variables RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
DUCTILE_ROUND follow, and the plan's DUCTILE_GLOBAL_BATCH, DUCTILE_MICRO_BATCH and
DUCTILE_GRADIENT_ACCUMULATION_STEPS when the notice has one); the parameters are sharded again
at the new world size (ShardedModel with ``previous``) and the notice's snapshot folder loaded
into them by ``_checkpoint.load_manifest``, which re-partitions any world size's files. The
engine, ``engine.module``, ``engine.optimizer`` and ``engine.lr_scheduler`` stay the same
objects: the optimizer's param groups get the new shards in place of the old (their values
stay), its state and the scheduler's are the snapshot's.

What it needs: torch.distributed's default process group as the world (gloo on the cpu, NCCL
on cuda; not ``group=``, not the accelerator's own communicator), the optimizer on the device
(no offload) and stepped by step() (not step_in_backward); else IncompatibleError names it.

The triggers, under the agent with ``DUCTILE_ROUND_NOTICE`` set (Recovery): the engine's
``forward``, ``backward`` and ``step`` keep the current optimizer step's micro-batches (the
forward's arguments, and once its backward ran, how the loss came from the forward's output).

- A collective that fails because a peer is gone (ductile.CommunicationError, torch's
  DistNetworkError or DistBackendError) inside them: the engine waits for a notice newer than
  its round (at most DUCTILE_ROUND_END_WAIT seconds, else DEFAULT_WAIT; CommunicationError when
  none comes, or the original error at once when the agent ends the round instead:
  DUCTILE_ROUND_END), rejoins, and runs the step's micro-batches again at the new world size:
  the forward in progress returns its output from the new round, a backward in progress and
  step() complete there. The loop ``loss = engine(batch); engine.backward(loss);
  engine.step()`` goes on unchanged. A micro-batch can be run again only when its loss is the
  forward's output, or the output's ``loss`` (attribute, key) or first element (a Hugging Face
  model given labels), unchanged since the forward returned it (its version counter). The first
  backward of another loss takes back ``<notice>.ready`` (the agent restarts the workers at a
  lost node, as without a notice); when such a micro-batch would have to run again before the
  agent read that (a failure in its backward or in step(), or in a later micro-batch of the
  same step), the original error is raised: the same restart, later. The DeepSpeed drop-in's
  engine goes through these calls too, its loss divided by its accumulation steps (kept with
  the micro-batch: the same division when it runs again).
  gloo's "Connection closed by peer" from the engine's own collectives on torch's group (a
  RuntimeError) counts as a lost peer too. A collective of the old round that waits only for
  live peers (a ring's neighbour, while the lost rank's neighbours have left) would wait for
  the group's timeout: with a notice path, on the cpu, the engine's waits on torch's works poll
  the work and, every 50 polls, the notice (_world.superseded), and leave with
  CommunicationError once a newer round's notice is there, which recovers as above (on cuda
  they wait as without a notice: the host never waits for the device's collectives). A wait
  that is not polled (the C++ planned gathers, a training loop's own collective), on a peer
  that went silent or left, fails once the HeldWatch thread (_held.py) shuts the old group's
  connections, 50 ms after a newer notice; it recovers as above.
- A pause the agent asks for (``<notice>.hold``: a node joins), agreed by every rank in the
  all-reduce before an optimizer update that waits for the last snapshot's copies: every rank
  leaves the step with RoundHold, says so (``<notice>.held``), waits for the notice and
  rejoins from that snapshot, which is the state it holds, and completes the step (its
  micro-batches run again) at the new world size.
- A newer notice at a step boundary (the first forward of a step: one ``stat``, no device
  work): the engine rejoins before that forward (a node joined). Ranks may see it a step apart;
  a rank still in the old round then fails its collective, or leaves it, and recovers as
  above.

The snapshot restored is the agent's choice: normally the one of the step before the failed
one (snapshot_interval 1), whose micro-batches are run again. From an older one (a longer
interval), the steps between are lost: the engine logs how many and goes on from the restored
step with the micro-batches it holds (``engine.global_step`` says where it is)."""

import collections
import dataclasses
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from ... import _round_end, _round_sockets
from ..._errors import CommunicationError, Error, IncompatibleError, InvalidArgumentError
from . import _checkpoint, _round_notice, _world
from ._held import HeldWatch, connections_of
from ._round_notice import NOTICE_ENV, RoundHold, RoundNotice

_log = logging.getLogger("ductile.zero3")

# Seconds a worker whose collective failed waits for the agent's notice
# without DUCTILE_ROUND_END_WAIT (the agent sets it: its lease TTL, failure
# grace and polls, plus a margin).
DEFAULT_WAIT = 60.0
_POLL = 0.01


# What gloo's TCP transport says when a peer's process is gone. The engine's
# own collectives on torch's group (an all-reduce in step()) raise torch's
# RuntimeError with it; the coordinator's raise ductile.CommunicationError.
_TRANSPORT_LOST = ("Connection closed by peer", "Connection reset by peer")


def _lost_peer(error):
    """Whether `error` is a collective's that failed because a peer is gone."""
    if _round_end._peer_lost(error):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _TRANSPORT_LOST)


def _as_notice(notice):
    if isinstance(notice, RoundNotice):
        return notice
    if isinstance(notice, str):
        notice = notice.encode()
    if isinstance(notice, (bytes, bytearray)):
        return _round_notice.parse(bytes(notice), "engine.rejoin")
    raise InvalidArgumentError(f"engine.rejoin: notice is a {type(notice).__name__}; valid: a "
                               "RoundNotice, or its JSON text (str or bytes)")


def _check_supported(engine):
    from ._world import TorchWorld
    why = None
    if not isinstance(engine.comm, TorchWorld):
        why = f"its world is {engine.comm.kind}; valid: torch.distributed's default group"
    elif engine.comm.group is not None:
        why = "its world is a process group given as group=; valid: the default group"
    elif engine._offload is not None:
        why = "optimizer offload is on; valid: the optimizer on the device"
    elif engine.step_in_backward:
        why = "step_in_backward is on; valid: the optimizer stepped by step()"
    elif engine._drop_in and engine.training["train_micro_batch_size_per_gpu"] is None:
        why = ("its DeepSpeed config gives no train_micro_batch_size_per_gpu, so the "
               "micro-batch would change with the world size; valid: a config that gives it")
    elif engine._build.config.fresh_runtime is None:
        why = (f"its configuration ({engine._build.config.origin}) cannot be read again; "
               "valid: a config given as a path, text or dict")
    if why is not None:
        raise IncompatibleError(f"zero3: the engine cannot rejoin a round in place: {why}")


def _leave(engine):
    """Drops the old round's work: background threads (their files
    removed), the pass in progress, the hooks, the old optimizer hook;
    then the default process group. Nothing here waits for a peer."""
    snapshots = engine._snapshots
    writing, snapshots.writing = snapshots.writing, None
    if writing is not None:
        writing.thread.join()
        writing.written.undo()
    pending, snapshots.pending_save = snapshots.pending_save, None
    if pending is not None:
        pending.cancel.set()
        pending.thread.join()
        pending.written.undo()
    passes = engine._passes
    if passes.pass_open:
        try:
            passes.abandon()
        except Exception:  # noqa: BLE001 - its collectives failed with the peer: none is kept
            pass
    passes.uninstall(engine.module)
    recovery = engine._recovery
    if recovery is not None and recovery.connections is not None:
        recovery.connections.retire()  # destroyed next: its descriptors go
    if engine._steps.hook is not None:
        engine._steps.hook.remove()
    for zp in engine._params:
        zp.shard.grad = None
    if dist.is_initialized():
        # Aborted first: its connections close now, so that a peer still
        # waiting in a collective of the old round (one that does not talk
        # to the lost rank) fails and recovers too, rather than wait for
        # the group's timeout.
        try:
            dist.distributed_c10d._get_default_group().abort()
        except Exception:  # noqa: BLE001 - a group that cannot abort is destroyed anyway
            pass
        dist.destroy_process_group()


# The key prefix torch's init_process_group puts before the default group's
# keys when it made the store itself (env://): a worker rejoining in place
# meets the workers the agent started afresh in that round under it.
_ENV_PREFIX = "default_pg"


def _join(notice, backend, timeout):
    """The notice's round as torch's default process group (its TCPStore,
    as env:// reaches the agent's store, or under the notice's
    store_prefix); the round's variables set. Returns the inodes of the
    process's sockets before the group was made."""
    os.environ.update(notice.environment())
    from datetime import timedelta
    try:
        store = dist.TCPStore(notice.master_addr, notice.master_port, is_master=False,
                              timeout=timedelta(seconds=timeout))
    except (RuntimeError, OSError) as e:
        raise CommunicationError(
            f"zero3 rejoin: round {notice.round}: cannot reach the round's store at "
            f"{notice.master_addr}:{notice.master_port} (master_addr, master_port of "
            f"{NOTICE_ENV}) within {timeout:g} s: {e}") from e
    prefix = _ENV_PREFIX if notice.store_prefix is None else notice.store_prefix
    before = _round_sockets.socket_inodes()
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=notice.rank,
                            world_size=notice.world_size)
    return before


def _transplant(optimizer, params):
    """An optimizer factory that gives `optimizer` (the user's object) the
    new shards in place of the old ones, group by group (its values stay),
    and an empty state (the snapshot's is loaded next)."""
    pid_of = {id(zp.shard): zp.id for zp in params}
    groups = [[pid_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]

    def factory(shards):
        for group, pids in zip(optimizer.param_groups, groups):
            group["params"] = [shards[pid] for pid in pids]
        optimizer.state = collections.defaultdict(dict)
        return optimizer
    return factory


def rejoin(engine, notice):
    """Zero3Engine.rejoin (see the module's docstring)."""
    from ._engine import ShardedModel
    from ._progress import StepLog
    from ._settings import torch_world
    from ._snapshots import Snapshots

    notice = _as_notice(notice)
    _check_supported(engine)
    round_ = _round_notice.current_round()
    if notice.round <= round_:
        raise InvalidArgumentError(
            f"engine.rejoin: round {notice.round} is not newer than this worker's round "
            f"{round_} (DUCTILE_ROUND); valid: a notice of a later round")
    backend = engine.comm.backend
    build = engine._build
    sync = engine._gradients.sync
    callback = engine._passes.module_callback
    clipping, measure = engine._steps.gradient_clipping, engine._steps.measure_grad_norm
    previous = engine._params
    optimizer = engine.optimizer
    factory = _transplant(optimizer, previous) if optimizer is not None else None
    old = engine._snapshots
    log_interval = engine.log_interval
    runtime = build.config.fresh_runtime()  # the old one's accelerator holds the old world
    try:
        engine.flush_log()
    except Error:
        pass  # a line's values needed the lost peer: the line is dropped
    _leave(engine)
    before = _join(notice, backend, _wait_seconds())
    if engine._recovery is not None and engine._recovery.connections is not None:
        engine._recovery.connections = connections_of(notice.round, before)

    sharded = ShardedModel(engine.module, runtime, torch_world(None),
                           engine.mixed_precision, build.groups, build.offload,
                           build.max_device_memory, None, optimizer is not None, False,
                           previous=previous)
    for zp in previous:
        zp.shard = None  # the old shards' memory goes with the old world
    engine._attach(sharded, factory, clipping, False)
    engine._steps.measure_grad_norm = measure
    engine._gradients.sync = sync  # inside no_sync(), still inside
    engine._passes.module_callback = callback
    engine._step_log = StepLog(log_interval, engine) if log_interval else None
    snapshots = Snapshots(engine, old.interval, old.replicas)
    snapshots.overlap = old.overlap
    engine._snapshots = snapshots
    try:
        manifest = _checkpoint.load_manifest(engine, notice.restore, lr_scheduler=True)
    except Error as e:
        raise type(e)(f"{NOTICE_ENV}: round {notice.round}: the snapshot to resume from "
                      f"({notice.restore}) does not load: {e}", kind=e.kind,
                      type=e.type) from e
    step = manifest["step"]
    engine.restored_client_state = manifest.get("client_state")
    snapshots._restored = step  # the agent frees it once a newer snapshot is replicated
    engine.restored_from_memory = step
    if engine._recovery is not None:
        engine._recovery.watch.round = notice.round
        _round_notice.acknowledge_join(engine._recovery.watch.path, notice.round)
    _log.info("zero3: rank %d of %d in round %d: rejoined in place from the snapshot of step "
              "%d (%s)", engine.rank, engine.world_size, notice.round, step, notice.restore)
    if engine._after_rejoin is not None:
        engine._after_rejoin(step)
    return step


class RoundRejoined(Exception):
    """Raised out of the engine's forward, backward or step once it has
    rejoined a new round in place, for a loop that starts its step again
    itself (Recovery.unwinds): `step` is the step of the snapshot restored
    (the engine's global_step), `round` the round joined."""

    def __init__(self, step, round_):
        super().__init__(f"rejoined round {round_} in place from the snapshot of step {step}")
        self.step = step
        self.round = round_


def _store_port():
    """MASTER_PORT, the round's store the script's group was made over
    (env://): not one of the group's own connections."""
    try:
        return int(os.environ.get("MASTER_PORT", ""))
    except ValueError:
        return None


def _wait_seconds():
    value = os.environ.get(_round_end.ROUND_END_WAIT_ENV, "")
    try:
        return max(1.0, float(value)) if value else DEFAULT_WAIT
    except ValueError:
        raise InvalidArgumentError(f"{_round_end.ROUND_END_WAIT_ENV} = {value!r}; valid: "
                                   "seconds, a number") from None


# --- the triggers ------------------------------------------------------------------------


@dataclasses.dataclass
class MicroBatch:
    """A forward of the current optimizer step: its arguments and, once its
    backward ran, how to find the loss in its output (None: computed
    outside it; see _loss_path)."""

    args: tuple
    kwargs: dict
    output: Any = None
    loss_path: tuple | None = None
    backward_kwargs: dict | None = None
    # What the loss was divided by before its backward (the DeepSpeed
    # drop-in's gradient accumulation steps), the same when it runs again.
    divisor: int = 1
    sync: bool = True
    done: bool = False
    # The version counters of the output's tensors a loss may be, when the
    # forward returned: a loss changed in place since (the HF Trainer's
    # `loss *= world size`) is not what running the forward again gives.
    versions: dict = dataclasses.field(default_factory=dict)


def _candidates(output):
    """The output's tensors a loss may be, by their path in it, in the
    order _loss_path tries them."""
    found: dict[tuple, Any] = {(): output, ("attr", "loss"): getattr(output, "loss", None)}
    if isinstance(output, collections.abc.Mapping):
        found[("key", "loss")] = output.get("loss")
    if isinstance(output, (tuple, list)) and output:
        found[("index", 0)] = output[0]
    return {path: t for path, t in found.items() if isinstance(t, torch.Tensor)}


def _versions(output):
    return {path: t._version for path, t in _candidates(output).items()}


def _path_of(entry, loss):
    """Where `loss` is in `entry`'s output, unchanged since the forward
    returned it; None when it is not there (computed outside, or changed
    in place)."""
    path = _loss_path(entry.output, loss)
    if path is None or entry.versions.get(path) != loss._version:
        return None
    return path


def _loss_path(output, loss):
    """Where `loss` is in `output`: () itself, ("attr", "loss"), ("key",
    "loss"), ("index", 0); None when it is not there (computed outside)."""
    return next((path for path, t in _candidates(output).items() if t is loss), None)


def _follow(output, path):
    if not path:
        return output
    kind, where = path
    if kind == "attr":
        return getattr(output, where)
    return output[where]


class Recovery:
    """The engine's forward, backward and step under the agent with a
    round notice (see the module's docstring)."""

    @classmethod
    def of(cls, engine):
        path = os.environ.get(NOTICE_ENV)
        if not path or engine.optimizer is None or not engine._snapshots.training:
            # An engine that does not train (an evaluation's, a DPO
            # reference model's) leaves the notices to the one that does.
            return None
        try:
            _check_supported(engine)
        except IncompatibleError as e:
            # Not ready: the agent restarts this worker at a new round.
            _log.warning("%s; at a lost node the agent restarts this worker", e)
            return None
        recovery = cls(engine, path)
        # A pause at an update is agreed in the all-reduce that waits for
        # the snapshot's copies: without copies there is none to ride on.
        snapshots = engine._snapshots
        can_hold = snapshots.enabled and snapshots.replicas > 0
        if can_hold:
            snapshots.hold_requested = recovery.hold_requested
        _round_notice.announce_ready(path, can_hold)
        return recovery

    def __init__(self, engine, path):
        self.engine = engine
        self.watch = _round_notice.NoticeWatch(path, _round_notice.current_round())
        self.micro: list[MicroBatch] = []  # the current step's
        # The group's connections, shut by the HeldWatch thread when a
        # newer notice finds this worker held in a collective (_held.py).
        self.connections = None
        self.held = None
        # Only a host collective (gloo) is polled: on cuda, polling an NCCL
        # work would make the host wait for the device at every collective.
        if engine.device.type == "cpu":
            _world.superseded = self.superseded
            self.connections = connections_of(self.watch.round, _round_sockets.baseline(),
                                              _store_port())
            self.held = HeldWatch(self)
        self.base = 0  # global_step when the current step's first forward ran
        # Where each recovery began: "forward", "backward" or "step"; "boundary" for a
        # notice seen at a step's first forward.
        self.recoveries: list[str] = []
        # Whether `.ready` was withdrawn (a loss that cannot run again).
        self.withdrawn = False
        # With `unwinds` (a training loop that starts its step again itself
        # from the restored state: DuctileTrainer), a recovery raises
        # RoundRejoined once rejoined instead of running the step's
        # micro-batches again, and nothing of them is kept.
        self.unwinds = False
        self.step_open = False  # a forward of the current step ran (unwinds)

    def close(self):
        """Ends the HeldWatch thread (the engine is closed)."""
        if self.held is not None:
            self.held.stop()

    # --- forward, backward, step ----------------------------------------------------------

    def forward(self, args, kwargs):
        engine = self.engine
        if not self.micro and not self.step_open:
            self.base = engine.global_step
            notice = self.watch.newer()
            if notice is not None:
                self.recoveries.append("boundary")
                restored = rejoin(engine, notice)
                self._lost(notice, restored)
                if self.unwinds:
                    raise RoundRejoined(restored, notice.round)
                self.base = engine.global_step
        if self.unwinds:
            self.step_open = True
            while True:
                try:
                    return engine.module(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - _recover raises all but a lost peer's
                    self._recover(e, [], "forward")
        entry = MicroBatch(args, kwargs, sync=engine._gradients.sync)
        while True:
            try:
                entry.output = engine.module(*args, **kwargs)
                break
            except Exception as e:  # noqa: BLE001 - _recover raises all but a lost peer's
                self._recover(e, [], "forward")
        if torch.is_grad_enabled():  # else no backward follows: nothing to run again
            entry.versions = _versions(entry.output)
            self.micro.append(entry)
        return entry.output

    def backward(self, loss, kwargs, divisor=1):
        """Back-propagates `loss` / `divisor`; returns that loss."""
        engine = self.engine
        if self.unwinds:
            divided = loss / divisor if divisor != 1 else loss
            try:
                engine._backward(divided, kwargs)
            except Exception as e:  # noqa: BLE001 - _recover raises all but a lost peer's
                self._recover(e, [], "backward")
            return divided
        entry = next((m for m in reversed(self.micro) if not m.done and
                      _path_of(m, loss) is not None), None)
        if entry is not None:
            entry.loss_path = _path_of(entry, loss)
            entry.backward_kwargs = dict(kwargs)
            entry.divisor = divisor
            entry.sync = engine._gradients.sync
        else:
            # A loss computed outside the engine's forward, or changed in
            # place since: this step's gradients cannot be made again. The
            # outputs waiting for their backward are not kept.
            for m in self.micro:
                if not m.done:
                    m.done, m.output = True, None
            self.micro.append(MicroBatch((), {}, done=True))
            if not self.withdrawn:
                # Once is enough: a loop computes its losses one way.
                self.withdrawn = True
                _round_notice.withdraw_ready(self.watch.path)
                _log.warning("zero3: the loss given to backward() is not the forward's output "
                             "(nor its loss or first element) as the forward returned it; its "
                             "step cannot run again, and at a lost node the agent restarts "
                             "this worker")
        divided = loss / divisor if divisor != 1 else loss
        try:
            engine._backward(divided, kwargs)
        except Exception as e:
            if entry is None:
                raise  # its loss came from outside the forward: it cannot run again
            self._recover(e, [entry], "backward")
        if entry is not None:
            entry.done = True
            entry.output = None  # the graph is gone; the arguments are what runs again
        return divided

    def step(self, lr_kwargs):
        engine = self.engine
        if not self.micro:
            self.base = engine.global_step
        try:
            while True:
                try:
                    engine._step(lr_kwargs)
                    break
                except Exception as e:  # noqa: BLE001 - _recover raises all but a lost peer's
                    if self._recover(e, [], "step"):
                        break  # the failed step's snapshot was restored: it is done
        finally:
            self.micro = []
            self.step_open = False

    # --- recovery --------------------------------------------------------------------------

    def _recover(self, error, current, where):
        """After `error` in a forward, backward (of `current`) or step:
        waits for the next round's notice, rejoins it and runs the step's
        micro-batches done so far again (and `current`). Returns True when
        the snapshot restored is of the step in progress (step() is done).
        Raises `error` when it is not a lost peer's, or when a micro-batch
        cannot run again. With `unwinds`, raises RoundRejoined once
        rejoined."""
        if self.unwinds:
            raise RoundRejoined(self.recover(error, where), self.watch.round) from error
        if not _lost_peer(error) and self.watch.newer() is None:
            # A collective of a round the agent already replaced (a newer
            # notice is there) fails however gloo says it: it is the end of
            # that round too, e.g. a timeout waiting on a silent peer.
            raise error
        done = [m for m in self.micro if m.done] + current
        if any(m.loss_path is None for m in done):
            raise error
        while True:
            base = self.base
            latest = base + 1 if where == "step" else base
            restored = self.recover(error, where)
            if restored > latest:
                raise IncompatibleError(
                    f"zero3 rejoin: round {self.watch.round} restored step {restored}, but this "
                    f"rank had completed step {base} only; valid: a snapshot of step "
                    f"{latest} or earlier") from error
            if restored == base + 1:
                return True
            try:
                self._replay(done)
                return False
            except Exception as e:  # a peer lost again: the next round
                if not _lost_peer(e):
                    raise
                error = e

    def recover(self, error, where):
        """After `error`, raised by a collective inside the engine or beside
        it (the training loop's own, on torch's default group): waits for
        the next round's notice, rejoins it, and returns the step of the
        snapshot restored. Raises `error` when it is not a lost peer's (nor
        any collective's error once a newer notice is there); the steps
        after the snapshot are the caller's to run again."""
        if not _lost_peer(error) and self.watch.newer() is None:
            raise error
        if isinstance(error, RoundHold):
            _round_notice.acknowledge_hold(self.watch.path, self.engine.global_step)
        notice = self._wait(error)
        self.recoveries.append(where)
        self.step_open = False
        restored = rejoin(self.engine, notice)
        self._lost(notice, restored)
        self.base = restored
        return restored

    def _replay(self, done):
        """Runs the micro-batches `done` again (forward and backward)."""
        engine = self.engine
        sync = engine._gradients.sync
        try:
            for entry in done:
                engine._gradients.sync = entry.sync
                output = engine.module(*entry.args, **entry.kwargs)
                loss = _follow(output, entry.loss_path)
                if entry.divisor != 1:
                    loss = loss / entry.divisor
                engine._backward(loss, entry.backward_kwargs or {})
        finally:
            engine._gradients.sync = sync

    def hold_requested(self):
        """(Whether the agent asks this worker to pause (a node joins; see
        _round_notice.py), whether the current step's micro-batches can run
        again)."""
        asked = _round_notice.hold_requested(self.watch.path, self.watch.round)
        return asked, self.unwinds or all(m.loss_path is not None for m in self.micro)

    def superseded(self):
        """Raises CommunicationError when a newer round's notice arrived (a
        collective of the old round waits; _world.superseded)."""
        notice = self.watch.newer()
        if notice is not None:
            raise CommunicationError(
                f"zero3: a collective of round {self.watch.round} was left: round "
                f"{notice.round} formed ({self.watch.path}, {NOTICE_ENV})")

    def _lost(self, notice, restored):
        if restored < self.base:
            _log.warning("zero3: round %d resumed from the snapshot of step %d: the %d step(s) "
                         "after it are lost; training goes on from step %d", notice.round,
                         restored, self.base - restored, restored)

    def _wait(self, error):
        """The newer round's notice, once the agent wrote it; `error` again
        when the agent ends the round instead (DUCTILE_ROUND_END: it stops
        this worker), CommunicationError when none comes in time."""
        wait = _wait_seconds()
        deadline = time.monotonic() + wait
        end = os.environ.get(_round_end.ROUND_END_ENV)
        round_ = str(self.watch.round)
        # The agent tells a worker that waits here from one still inside a
        # collective of the old round (which a silent peer can hold).
        _round_notice.announce_waiting(self.watch.path, self.watch.round)
        if self.connections is not None:
            self.connections.retire()  # out of the old round's collectives for good
        while True:
            notice = self.watch.newer()
            if notice is not None:
                return notice
            if end and _round_end._why_ended(end, round_):
                raise error
            if time.monotonic() > deadline:
                raise CommunicationError(
                    f"zero3: a collective of round {round_} failed ({type(error).__name__}: "
                    f"{error}) and no notice of a newer round came to {self.watch.path} "
                    f"({NOTICE_ENV}) within {wait:g} s ({_round_end.ROUND_END_WAIT_ENV})"
                ) from error
            time.sleep(_POLL)
