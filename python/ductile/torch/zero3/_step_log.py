"""The engine's progress lines: every ``log_interval`` optimizer steps
([zero] log_interval, or a DeepSpeed config's steps_per_print), one line
through the ``ductile.zero3`` logger on rank 0 with what the interval did.

Between two lines a step costs one integer test and, for the steps that
count samples (``Zero3Engine.count_batch``), two additions; the counters
are read, summed over the ranks (one all-reduce of two numbers) and
formatted only at a logged step.

The line's fields (also on the record as ``record.zero3_step``, a dict):

- ``step``: the engine's global_step after the logged step;
- ``loss_scale``: the fp16 loss scale (1.0 without loss scaling);
- ``lr``: the learning rate of the logged step (the optimizer's first
  parameter group);
- ``step_time_s``: the interval's wall time over its steps (forward,
  backward, step and whatever the loop did between steps);
- ``samples_per_second``, ``tokens_per_second``: what count_batch counted
  over the interval on every rank, over its wall time (absent when nothing
  was counted);
- ``peak_memory_bytes`` and ``peak_memory``: the device's peak allocated
  memory ("device", cuda) or the process's peak resident set ("host_rss",
  cpu) since the start;
- ``gather_wait_ms``: per step, the time the passes waited for parameter
  gathers (the coordinator's fetch_wait_ns) and ``grad_wait_ms`` for the
  gradient reduce-scatters;
- ``offload_to_host_bytes``, ``offload_to_device_bytes``: per step, the
  gradient shards copied to the host and the parameters copied back (with
  offload_optimizer or offload_param; absent without).
"""

import logging
import resource
import time

import torch

logger = logging.getLogger("ductile.zero3")


def _visible_logger():
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


def _peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "device"
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host_rss"


class StepLog:
    """The interval's counters of one engine and the line they make."""

    def __init__(self, interval, engine):
        self.interval = interval
        self._engine = engine
        _visible_logger()
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
        """At a logged step, after it: the line (rank 0), and a new
        interval. Collective with more than one rank (the counts' sum)."""
        engine = self._engine
        seconds = max(time.perf_counter() - self._start, 1e-9)
        steps = max(self._steps, 1)
        samples, tokens = self._counted()
        if engine.rank == 0:
            fields = {"step": engine.global_step, "loss_scale": float(engine.loss_scale),
                      "lr": None if lr is None else float(lr), "step_time_s": seconds / steps}
            if samples:
                fields["samples_per_second"] = samples / seconds
            if tokens:
                fields["tokens_per_second"] = tokens / seconds
            fields["peak_memory_bytes"], fields["peak_memory"] = _peak_memory(engine.device)
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
            logger.info(" ".join(f"{key}={_text(value)}" for key, value in fields.items()),
                        extra={"zero3_step": fields})
        self._restart()

    def _counted(self):
        """The interval's samples and tokens over every rank."""
        engine = self._engine
        counts = (self._samples, self._tokens)
        tensors = any(isinstance(c, torch.Tensor) for c in counts)
        if engine.world_size == 1 and not tensors:
            return counts
        if tensors:
            counts = torch.stack([torch.as_tensor(c, dtype=torch.int64).to(engine.device)
                                  for c in counts])
        else:
            counts = torch.tensor(counts, dtype=torch.int64, device=engine.device)
        if engine.world_size > 1:
            engine.comm.all_reduce(counts, "sum").wait()
        return counts.tolist()


def _text(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
