"""What every rank must hear from every other: each rank's outcome of a
local phase (a save's writes, a load's reads and checks), exchanged with two
small collectives, so that one rank's error is raised on all of them at
once instead of leaving the others in the next collective until its
timeout.

    outcome = agree(engine, lambda: phase())   # every rank, same order
    outcome.value                              # this rank's return value

``agree`` runs ``phase`` on this rank, catching any exception; then the
ranks all-gather (ok, error class, message, payload); if any rank failed,
every rank raises: the failing rank its own exception, the others the same
ductile error class with a message naming the rank and its message.
"""

import json

from ... import _errors
from ._collectives import gather_bytes

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
