"""Workers of ``ductile agent`` that lose no step when the agent re-forms
the group on purpose: a scale-up, a node drained with SIGTERM, or a scale-up
that ``min_time`` allowed. With ``--checkpoint-timeout S`` the agent asks
the round's workers to save first, waits for them (at most S seconds), then
re-forms; the workers of the next round resume from that checkpoint.

    from ductile.torch import elastic

    step = resume_from_latest_checkpoint()
    while step < total_steps:
        train_one_step(step)
        step += 1
        if elastic.should_checkpoint(engine):   # the same answer on every rank
            engine.save(f"ckpt/step{step}", client_state={"step": step})
            elastic.checkpoint_saved()
            break                               # exit: the agent starts the next round

The agent tells the workers through a file (``DUCTILE_CHECKPOINT_REQUEST``,
which it creates when it asks) and learns that a worker saved through
another (``DUCTILE_CHECKPOINT_SAVED``, which :func:`checkpoint_saved`
creates). Outside the agent, or without ``--checkpoint-timeout``, these
variables are not set: :func:`should_checkpoint` is always False and
:func:`checkpoint_saved` does nothing.

Ranks must agree on the step they save at (a zero3 save is collective, and
so are most): :func:`should_checkpoint` combines every rank's view with a
maximum, through the engine, a callable or torch.distributed.
"""

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .zero3 import Zero3Engine

from .._errors import InvalidArgumentError

__all__ = ["checkpoint_requested", "checkpoint_reason", "should_checkpoint", "checkpoint_saved"]

_REQUEST = "DUCTILE_CHECKPOINT_REQUEST"
_SAVED = "DUCTILE_CHECKPOINT_SAVED"


def checkpoint_requested() -> bool:
    """True once the agent asked this round's workers to checkpoint, as this
    worker sees it (other ranks may see it a step later: see
    :func:`should_checkpoint`)."""
    path = os.environ.get(_REQUEST)
    return bool(path and os.path.exists(path))


def checkpoint_reason() -> str | None:
    """Why the agent asked ("scale-up: 3 node(s) admitted of 3 present",
    "node b drains (signal 15)"), or None when it has not asked."""
    path = os.environ.get(_REQUEST)
    if not path:
        return None
    try:
        with open(path) as f:
            return json.load(f).get("reason")
    except (OSError, ValueError):
        return None


def should_checkpoint(
        sync: "Zero3Engine | Callable[[torch.Tensor], torch.Tensor] | None" = None) -> bool:
    """True on every rank when any rank has seen the agent's request, so
    that all ranks save at the same step. Collective when `sync` reaches
    other ranks: call it at the same point of the loop on every rank.

    ``sync``: a ductile zero3 engine (its ``all_reduce(tensor, "max")``), a
    callable taking a one-element float tensor and returning its maximum over
    the ranks, or None: torch.distributed's default group when it is
    initialized with more than one rank, else this rank's own view.
    """
    seen = checkpoint_requested()
    if sync is not None and not (hasattr(sync, "all_reduce") or callable(sync)):
        raise InvalidArgumentError(
            f"should_checkpoint(sync={type(sync).__name__}): give a zero3 engine, a callable "
            f"that returns the maximum of a tensor over the ranks, or None (torch.distributed)")
    import torch

    flag = torch.tensor([1.0 if seen else 0.0])
    if sync is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return seen
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    elif hasattr(sync, "all_reduce"):
        flag = sync.all_reduce(flag, "max")
    else:
        flag = sync(flag)
    return bool(float(flag.reshape(-1)[0]) > 0.0)


def checkpoint_saved() -> None:
    """Tells the agent that this worker's checkpoint is complete. Once every
    worker of the round did (or ``--checkpoint-timeout`` passed), the agent
    re-forms; this worker should then take no more steps (exit, or wait to
    be stopped)."""
    path = os.environ.get(_SAVED)
    if not path:
        return
    part = path + ".part"
    with open(part, "w") as f:
        f.write(str(os.getpid()))
    os.replace(part, path)
