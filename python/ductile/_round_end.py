"""A worker of ``ductile agent`` whose collective fails because a peer is
gone: one line instead of a traceback.

When a node is lost, its peers' collectives fail before the agents notice
the lost lease and stop the round's workers: each survivor's worker would
print the traceback of a ductile.CommunicationError that says nothing the
agent's log does not say better (which node left). Installed by ``import
ductile`` when the agent set DUCTILE_ROUND_END, this excepthook takes such
an uncaught error, says so in one line, and waits (at most
DUCTILE_ROUND_END_WAIT seconds) for the agent, which writes why it ends
the round into the file DUCTILE_ROUND_END names before it stops the
workers:

    ductile: rank 1: round 2 ended: round 3 formed: node(s) b left; this worker stops

Any other exception, and one the agent did not explain within the wait
(a collective that failed for another reason), gets the interpreter's
traceback as before, and the worker's exit status is as before: 1, or
128 + the signal that stopped it.
"""

import os
import signal
import sys
import time
import types

ROUND_END_ENV = "DUCTILE_ROUND_END"
ROUND_END_WAIT_ENV = "DUCTILE_ROUND_END_WAIT"
# The agent's file: the round it ended, a newline, and why; short.
_MAX_REASON_BYTES = 4096


def _peer_lost(error: BaseException) -> bool:
    from ._errors import CommunicationError

    if isinstance(error, CommunicationError):
        return True
    dist = sys.modules.get("torch.distributed")
    for name in ("DistNetworkError", "DistBackendError"):
        kind = getattr(dist, name, None)
        if isinstance(kind, type) and isinstance(error, kind):
            return True
    return False


def _why_ended(path: str, round_: str) -> str | None:
    """The agent's reason for ending `round_`, when it wrote one."""
    try:
        with open(path, "rb") as f:
            text = f.read(_MAX_REASON_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    ended, _, why = text.partition("\n")
    if ended.strip() != round_:
        return None  # an earlier round's
    return why.strip() or None


def _hook(previous):
    def hook(kind: type[BaseException], error: BaseException,
             traceback: types.TracebackType | None) -> None:
        path = os.environ.get(ROUND_END_ENV)
        if not path or not _peer_lost(error):
            previous(kind, error, traceback)
            return
        rank = os.environ.get("RANK", "?")
        round_ = os.environ.get("DUCTILE_ROUND", "?")

        def ended(why: str, status: int) -> None:
            # To the descriptor: torch.distributed's excepthook calls this
            # one with sys.stderr swapped for a buffer it prints afterwards,
            # and the process ends here.
            line = f"ductile: rank {rank}: round {round_} ended: {why}; this worker stops\n"
            os.write(2, line.encode("utf-8", "replace"))
            os._exit(status)

        def stopped(signum: int, _frame: object) -> None:
            why = _why_ended(path, round_) or "the agent stopped this round's workers"
            ended(why, 128 + signum)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stopped)
        try:
            wait = max(0.0, float(os.environ.get(ROUND_END_WAIT_ENV, "0")))
        except ValueError:
            wait = 0.0
        deadline = time.monotonic() + wait
        while True:
            why = _why_ended(path, round_)
            if why:
                ended(why, 1)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        print(f"ductile: rank {rank}: a collective of round {round_} failed and the agent did "
              f"not end the round within {wait:g} s ({ROUND_END_WAIT_ENV}):",
              file=sys.stderr, flush=True)
        previous(kind, error, traceback)

    hook.ductile_round_end = True  # type: ignore[attr-defined]
    return hook


def install() -> None:
    """Wraps sys.excepthook (once)."""
    if not getattr(sys.excepthook, "ductile_round_end", False):
        sys.excepthook = _hook(sys.excepthook)
