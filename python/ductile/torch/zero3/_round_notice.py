"""The round notice: how ``ductile agent`` tells a running worker that a new round formed, so
that its engine rejoins in place (``engine.rejoin``, _rejoin.py) instead of being restarted.

The contract. The agent sets ``DUCTILE_ROUND_NOTICE`` to a path of its own per worker (beside
``DUCTILE_ROUND_END``); when a round forms that the worker joins, the agent writes there,
atomically (a staged file renamed over the path, so a reader sees the old notice or the new one,
never half of one), at most MAX_BYTES of UTF-8 JSON, one object:

    {"round": 3, "rank": 1, "world_size": 2, "local_rank": 0, "local_world_size": 1,
     "master_addr": "node-a.example", "master_port": 29513,
     "restore": "/dev/shm/ductile-snapshots-.../restore/step41",
     "plan": {"global_batch": 12, "micro_batch": 2, "gradient_accumulation_steps": 3}}

``round``: the new round's number (DUCTILE_ROUND), greater than the worker's; ``rank``,
``world_size``, ``local_rank``, ``local_world_size``: the worker's place in it (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); ``master_addr``, ``master_port``: the round's
TCPStore (MASTER_ADDR, MASTER_PORT), where the new process group rendezvouses as torch's
``env://`` does for a worker started in that round (so that workers rejoining in place and
workers started afresh meet in one group), or, with ``store_prefix`` (optional), under that key
prefix (a store that serves several rounds keeps them apart); ``restore``: a complete
snapshot folder, as DUCTILE_SNAPSHOT_RESTORE names one, that every rank of the round loads;
``plan`` (optional): the elastic policy's plan at the new world size (DUCTILE_GLOBAL_BATCH,
DUCTILE_MICRO_BATCH, DUCTILE_GRADIENT_ACCUMULATION_STEPS). No other key is valid.

The agent writes notices only to a worker that said it can act on them: once its engine is
built with in-place recovery (``engine.rejoin``'s requirements met), the worker writes the file
``<notice path>.ready`` (READY_SUFFIX; its process id, a newline). A worker without one (a script
that does not use the engine, an engine that cannot rejoin) is stopped and started again at a
new round, as torchrun restarts its workers.

A round that only adds nodes finds the workers training. The agent first asks them to pause:
it writes ``<notice path>.hold`` (HOLD_SUFFIX: the new round's number, a newline). At the next
optimizer update every rank agrees on it in the all-reduce that already waits for the last
snapshot's copies; they leave the step with RoundHold, each writes ``<notice path>.held``
(HELD_SUFFIX: the step whose snapshot is committed and copied, a newline) and waits
for the notice, which names that snapshot. Only a worker whose ``.ready`` file has a second
line ``hold`` can pause (its snapshots are copied to other nodes: ``snapshot_replicas`` > 0),
and only at a step every rank can run again (each micro-batch's loss the forward's output);
otherwise a rank that was asked writes ``-1`` there and the agent restarts the workers.

A worker that left its step to wait for a notice writes ``<notice path>.waiting`` (WAITING_SUFFIX:
its round, a newline); once it joined the notice's round (the snapshot loaded), it writes
``<notice path>.joined`` (JOINED_SUFFIX: the round, a newline). An agent whose workers neither
wait nor joined soon after the notice (a collective of the old round held by a silent peer whose
connections the engine could not shut: _held.py), or did not join in time, stops them and starts
them again in that round, from the same snapshot.

A worker polls the path once a step (one ``stat``: the notice is read only when its size or
modification time changed) and after a collective failed because a peer is gone; a notice of a
round not newer than the worker's is ignored."""

import dataclasses
import json
import os

from ..._errors import CommunicationError, InvalidArgumentError, IoError
from ._checkpoint_files import write_small

NOTICE_ENV = "DUCTILE_ROUND_NOTICE"
ROUND_ENV = "DUCTILE_ROUND"
# The worker's word that its engine acts on notices, the agent's request to
# pause at the next update, and the worker's word that it paused (see the
# module's docstring).
READY_SUFFIX = ".ready"
HOLD_SUFFIX = ".hold"
HELD_SUFFIX = ".held"
JOINED_SUFFIX = ".joined"
WAITING_SUFFIX = ".waiting"
# A notice is a few hundred bytes; anything past this is not one.
MAX_BYTES = 64 << 10
_MAX_PORT = 65535
_MAX_ADDR = 255
_PLAN_KEYS = {"global_batch": "DUCTILE_GLOBAL_BATCH", "micro_batch": "DUCTILE_MICRO_BATCH",
              "gradient_accumulation_steps": "DUCTILE_GRADIENT_ACCUMULATION_STEPS"}
_KEYS = ("round", "rank", "world_size", "local_rank", "local_world_size", "master_addr",
         "master_port", "store_prefix", "restore", "plan")
_REQUIRED = ("round", "rank", "world_size", "local_rank", "local_world_size", "master_addr",
             "master_port", "restore")


@dataclasses.dataclass(frozen=True)
class RoundNotice:
    """A validated round notice (see the module's docstring)."""

    round: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    store_prefix: str | None
    restore: str
    plan: dict[str, int] | None = None

    def environment(self):
        """The variables a worker of this round is started with, as the
        agent sets them (the plan's too, when there is one)."""
        env = {"RANK": self.rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": self.local_rank,
               "LOCAL_WORLD_SIZE": self.local_world_size, "MASTER_ADDR": self.master_addr,
               "MASTER_PORT": self.master_port, ROUND_ENV: self.round,
               "ROLE_RANK": self.rank, "ROLE_WORLD_SIZE": self.world_size}
        for key, name in _PLAN_KEYS.items():
            if self.plan is not None and key in self.plan:
                env[name] = self.plan[key]
        return {k: str(v) for k, v in env.items()}


def _integer(where, key, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, int) or value < low or \
            (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidArgumentError(f"{where}: {key} = {value!r}; valid: an integer {bound}")
    return value


def _text(where, key, value, limit=4096):
    if not isinstance(value, str) or not value or len(value) > limit or "\0" in value:
        raise InvalidArgumentError(f"{where}: {key} = {value!r}; valid: a non-empty string of at "
                                   f"most {limit} characters")
    return value


def parse(data, where):
    """A RoundNotice of `data` (the notice's bytes); InvalidArgumentError
    naming `where` (the path), the key, the bad value and what is valid."""
    if len(data) > MAX_BYTES:
        raise InvalidArgumentError(f"{where}: a round notice of more than {MAX_BYTES} bytes; "
                                   f"valid: a JSON object of at most {MAX_BYTES} bytes")
    try:
        fields = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidArgumentError(f"{where}: the round notice is not UTF-8 JSON ({e}); valid: "
                                   "a JSON object") from None
    if not isinstance(fields, dict):
        raise InvalidArgumentError(f"{where}: the round notice is a {type(fields).__name__}; "
                                   "valid: a JSON object")
    unknown = sorted(k for k in fields if k not in _KEYS)
    if unknown:
        raise InvalidArgumentError(f"{where}: {unknown[0]} is not a key of a round notice; "
                                   f"valid: {', '.join(_KEYS)}")
    missing = [k for k in _REQUIRED if k not in fields]
    if missing:
        raise InvalidArgumentError(f"{where}: the round notice has no {missing[0]}; required: "
                                   f"{', '.join(_REQUIRED)}")
    round_ = _integer(where, "round", fields["round"], 1)
    world = _integer(where, "world_size", fields["world_size"], 1)
    rank = _integer(where, "rank", fields["rank"], 0, world - 1)
    local_world = _integer(where, "local_world_size", fields["local_world_size"], 1, world)
    local_rank = _integer(where, "local_rank", fields["local_rank"], 0, local_world - 1)
    addr = _text(where, "master_addr", fields["master_addr"], _MAX_ADDR)
    port = _integer(where, "master_port", fields["master_port"], 1, _MAX_PORT)
    prefix = fields.get("store_prefix")
    if prefix is not None:
        prefix = _text(where, "store_prefix", prefix, _MAX_ADDR)
    restore = _text(where, "restore", fields["restore"])
    if not os.path.isabs(restore):
        raise InvalidArgumentError(f"{where}: restore = {restore!r}; valid: an absolute path to "
                                   "a complete snapshot folder")
    plan = fields.get("plan")
    if plan is not None:
        if not isinstance(plan, dict):
            raise InvalidArgumentError(f"{where}: plan = {plan!r}; valid: an object of "
                                       f"{', '.join(_PLAN_KEYS)}")
        for key, value in plan.items():
            if key not in _PLAN_KEYS:
                raise InvalidArgumentError(f"{where}: plan.{key} is not a key of plan; valid: "
                                           f"{', '.join(_PLAN_KEYS)}")
            _integer(where, f"plan.{key}", value, 1)
    return RoundNotice(round_, rank, world, local_rank, local_world, addr, port, prefix,
                       restore, plan)


def read(path):
    """The notice at `path`, or None when there is none (no file); IoError
    for a file that cannot be read, InvalidArgumentError for a bad one."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise IoError(f"{path} ({NOTICE_ENV}): cannot read the round notice: "
                      f"{e.strerror or e}") from e
    return parse(data, f"{path} ({NOTICE_ENV})")


class RoundHold(CommunicationError):
    """Every rank agreed to pause at this optimizer update for the round
    the agent's hold request names (a node joins): the step is run again
    once the notice came."""


def _write_whole(path, text, what):
    try:
        write_small(path, text)
    except OSError as e:
        raise IoError(f"{path} ({NOTICE_ENV}): cannot {what}: {e.strerror or e}") from e


def announce_ready(path, can_hold):
    """Writes ``path`` + READY_SUFFIX (this process's id; a line ``hold``
    when `can_hold`): the agent may write this worker round notices instead
    of restarting it. IoError names the file."""
    _write_whole(path + READY_SUFFIX, f"{os.getpid()}\n" + ("hold\n" if can_hold else ""),
                 "say that this worker takes round notices")


def withdraw_ready(path):
    """Removes ``path`` + READY_SUFFIX: this worker's steps cannot run again
    (a loss computed outside the forward); at a lost node the agent restarts
    it. IoError names the file."""
    try:
        os.unlink(path + READY_SUFFIX)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise IoError(f"{path}{READY_SUFFIX} ({NOTICE_ENV}): cannot withdraw that this worker "
                      f"takes round notices: {e.strerror or e}") from e


def hold_requested(path, round_):
    """Whether the agent asked (``path`` + HOLD_SUFFIX) to pause for a round
    newer than `round_` (one failed open when there is no request)."""
    try:
        with open(path + HOLD_SUFFIX, "rb") as f:
            text = f.read(64)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise IoError(f"{path}{HOLD_SUFFIX} ({NOTICE_ENV}): cannot read the agent's hold "
                      f"request: {e.strerror or e}") from e
    try:
        return int(text.strip() or b"0") > round_
    except ValueError:
        return False  # being replaced: a rename makes that rare; read again next time


def refuse_hold(path):
    """Writes ``path`` + HELD_SUFFIX as ``-1``: this worker cannot pause
    (a rank's step cannot run again); the agent restarts it."""
    _write_whole(path + HELD_SUFFIX, "-1\n", "say that this worker cannot pause")


def announce_waiting(path, round_):
    """Writes ``path`` + WAITING_SUFFIX: this worker of round `round_` left
    its step and waits for the next round's notice."""
    _write_whole(path + WAITING_SUFFIX, f"{round_}\n", "say that this worker waits for a notice")


def acknowledge_join(path, round_):
    """Writes ``path`` + JOINED_SUFFIX: this worker joined round `round_`
    in place (the agent restarts workers that do not join in time)."""
    _write_whole(path + JOINED_SUFFIX, f"{round_}\n", "say that this worker joined the round")


def acknowledge_hold(path, step):
    """Writes ``path`` + HELD_SUFFIX: paused, with the snapshot of `step`
    committed and copied."""
    _write_whole(path + HELD_SUFFIX, f"{step}\n", "say that this worker paused")


def current_round():
    """This worker's round, DUCTILE_ROUND (0 when the agent set none)."""
    value = os.environ.get(ROUND_ENV, "")
    try:
        return int(value) if value else 0
    except ValueError:
        raise InvalidArgumentError(f"{ROUND_ENV} = {value!r}; valid: the round number, an "
                                   "integer >= 0") from None


class NoticeWatch:
    """The notice path and what was seen of it: ``newer()`` (one stat when
    nothing changed) says whether a notice of a round newer than `round`
    arrived."""

    def __init__(self, path, round_):
        self.path = path
        self.round = round_
        self._seen = None  # (size, mtime_ns, inode) of the file last read
        self._notice = None  # what it held

    def newer(self):
        """The notice when one newer than `round` is at the path, else None."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise IoError(f"{self.path} ({NOTICE_ENV}): cannot read the round notice: "
                          f"{e.strerror or e}") from e
        key = (info.st_size, info.st_mtime_ns, info.st_ino)
        if key != self._seen:
            self._notice = read(self.path)
            self._seen = key
        notice = self._notice
        return notice if notice is not None and notice.round > self.round else None
