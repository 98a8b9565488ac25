"""Progress lines that never wait for the device: the zero3 engine's (``ductile.zero3``
logger, docs/zero3.md, "Progress lines") and, through ``Lines``, the DeepSpeed drop-in's.

A line's values are taken when its step ends: host values as they are, device tensors
(a learning rate given as a tensor, the samples and tokens counted as tensors) copied
without blocking into pinned host memory behind a CUDA event. The line is written at a
later step, once that event is complete: a step never synchronises with the device for a
line (an incomplete copy waits for the next step), and the line for step N still says
step N. ``flush()`` (the engine's close, the drop-in's destroy, or the process' exit)
waits for the copies and writes every line left, so none is lost."""

from __future__ import annotations

import collections
import logging
import resource
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("ductile.zero3")


def visible_logger():
    """The logger at INFO unless the application set its level, with a
    handler to stderr when nothing would print its records: a log_interval
    asks for lines to be seen."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(name)s] %(message)s"))
        logger.addHandler(handler)
    return logger


def peak_memory(device):
    """(bytes, what they are): torch's counter of the device's peak
    allocation (a host-side counter: no synchronisation), or the process'
    peak resident set on the cpu."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "device"
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host_rss"


def _host_copy(tensor):
    """A host tensor that receives `tensor`'s values: pinned and filled
    without blocking when it lives on cuda (complete once the event
    recorded after it is), a plain copy on the cpu (the original may be
    changed in place later)."""
    tensor = tensor.detach()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    host.copy_(tensor, non_blocking=tensor.is_cuda)
    return host


def _staged(value, cuda):
    """`value` with every tensor in it (in lists and tuples too) replaced by
    its host copy; cuda[0] set when one of them is on cuda."""
    if isinstance(value, torch.Tensor):
        cuda[0] = cuda[0] or value.is_cuda
        return _host_copy(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_staged(v, cuda) for v in value)
    return value


def _python(value):
    """A staged value as Python numbers (host tensors read through numpy,
    never Tensor.item/tolist: the copies are complete by then)."""
    if isinstance(value, torch.Tensor):
        wide = value.double() if value.is_floating_point() else value.long()
        return wide.numpy().tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(_python(v) for v in value)
    return value


class Deferred:
    """One step's values on their way to the host (see the module's
    docstring): ``ready()`` without waiting, ``values()`` once ready (or
    ``wait()`` first)."""

    __slots__ = ("_values", "_event")

    def __init__(self, values: dict[str, Any]) -> None:
        cuda = [False]
        self._values = {k: _staged(v, cuda) for k, v in values.items()}
        self._event = None
        if cuda[0]:
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def values(self) -> dict[str, Any]:
        return {k: _python(v) for k, v in self._values.items()}


class Lines:
    """The lines taken and not yet written, in step order. ``poll()`` (at a
    step) writes those whose values have arrived, stopping at the first
    that has not; ``flush()`` waits for them all. Holds no engine: its
    finalizer (the owner's collection, or the process' exit) flushes."""

    def __init__(self) -> None:
        self._pending: collections.deque[tuple[Deferred, Callable[[dict[str, Any]], None]]] = \
            collections.deque()

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, values: dict[str, Any], write: Callable[[dict[str, Any]], None]) -> None:
        """Takes a line's values now; `write(values)` writes it later, with
        every tensor read as Python numbers."""
        self._pending.append((Deferred(values), write))

    def poll(self) -> None:
        pending = self._pending
        while pending and pending[0][0].ready():
            deferred, write = pending.popleft()
            write(deferred.values())

    def flush(self) -> None:
        pending = self._pending
        while pending:
            deferred, write = pending.popleft()
            deferred.wait()
            write(deferred.values())


def owned_lines(owner: object) -> Lines:
    """A Lines flushed when `owner` is collected or the process exits."""
    lines = Lines()
    weakref.finalize(owner, lines.flush)
    return lines


def _text(value):
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _write_step(fields: dict[str, Any]) -> None:
    """Writes one zero3 progress line from its step's values (rank 0)."""
    seconds = fields.pop("_seconds")
    samples, tokens = fields.pop("_counts")
    lr = fields["lr"]
    fields["lr"] = None if lr is None else float(lr)
    rates = {}
    if samples:
        rates["samples_per_second"] = samples / seconds
    if tokens:
        rates["tokens_per_second"] = tokens / seconds
    # The documented order: the rates after step_time_s.
    at = list(fields).index("step_time_s") + 1
    items = list(fields.items())
    fields = dict(items[:at] + list(rates.items()) + items[at:])
    logger.info(" ".join(f"{key}={_text(value)}" for key, value in fields.items()),
                extra={"zero3_step": fields})


class StepLog:
    """The interval's counters of one engine and the line they make.
    Between two lines a step costs one integer test and, for the steps that
    count samples (``Zero3Engine.count_batch``), two additions; the
    counters are summed over the ranks at a logged step and the line is
    written at a later step (the module's docstring)."""

    def __init__(self, interval, engine):
        self.interval = interval
        self._engine = engine
        self.lines = owned_lines(self)
        visible_logger()
        self._restart()

    def _restart(self):
        engine = self._engine
        self._start = time.perf_counter()
        self._steps = 0  # counted here: a checkpoint's load moves global_step
        self._samples = 0
        self._tokens = 0
        coordinator = engine._session.stats()
        self._fetch_wait_ns = coordinator["fetch_wait_ns"]
        self._grad_wait_ns = engine._gradients.counters["grad_wait_ns"]
        offload = engine._offload
        self._offload_bytes = None if offload is None else (
            offload.counters["offload_grad_bytes"], offload.counters["offload_param_bytes"])

    def count(self, samples, tokens):
        self._samples = self._samples + samples
        if tokens is not None:
            self._tokens = self._tokens + tokens

    def due(self, step):
        """Whether the step that ends at global_step `step` is logged;
        called once a step."""
        self._steps += 1
        return step % self.interval == 0

    def log(self, lr):
        """At a logged step, after it: the line's values taken (rank 0), and
        a new interval. Collective with more than one rank (the counts'
        sum, on the device without waiting for it)."""
        engine = self._engine
        seconds = max(time.perf_counter() - self._start, 1e-9)
        steps = max(self._steps, 1)
        counts = self._counted()
        if engine.rank == 0:
            fields = {"step": engine.global_step, "loss_scale": float(engine.loss_scale),
                      "lr": lr, "step_time_s": seconds / steps}
            fields["peak_memory_bytes"], fields["peak_memory"] = peak_memory(engine.device)
            fields["gather_wait_ms"] = (engine._session.stats()["fetch_wait_ns"]
                                        - self._fetch_wait_ns) / 1e6 / steps
            fields["grad_wait_ms"] = (engine._gradients.counters["grad_wait_ns"]
                                      - self._grad_wait_ns) / 1e6 / steps
            if self._offload_bytes is not None:
                counters = engine._offload.counters
                fields["offload_to_host_bytes"] = (counters["offload_grad_bytes"]
                                                   - self._offload_bytes[0]) // steps
                fields["offload_to_device_bytes"] = (counters["offload_param_bytes"]
                                                     - self._offload_bytes[1]) // steps
            fields["_seconds"] = seconds
            fields["_counts"] = counts
            self.lines.add(fields, _write_step)
        self._restart()

    def _counted(self):
        """The interval's samples and tokens over every rank: ints, or one
        tensor of both (summed over the ranks; read when the line is
        written)."""
        engine = self._engine
        counts = (self._samples, self._tokens)
        if engine.world_size == 1 and not any(isinstance(c, torch.Tensor) for c in counts):
            return counts
        # Made on the device by kernels (a fill, a copy that does not
        # block): a blocking host-to-device copy would wait for the stream.
        counts = torch.stack([
            c.to(engine.device, torch.int64, non_blocking=True) if isinstance(c, torch.Tensor)
            else torch.full((), c, dtype=torch.int64, device=engine.device) for c in counts])
        if engine.world_size > 1:
            engine.comm.all_reduce(counts, "sum").wait()
        return counts
