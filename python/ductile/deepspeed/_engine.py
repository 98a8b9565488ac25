"""DeepSpeed's engine contract over ductile's ZeRO-3 engine.

``DeepSpeedEngine`` is a ``torch.nn.Module`` whose ``module`` is the user's
model, with the methods and properties DeepSpeed's engine has that training
scripts, Hugging Face Accelerate and the HF Trainer call (the list is kept
in tests/python/test_deepspeed_engine.py). The sharding, gathers, gradient
reduction, clipping, mixed precision and the optimizer step are the zero3
engine's (``ductile.torch.zero3.Zero3Engine``); this file adds what
DeepSpeed's engine does around them:

- gradient accumulation counted by micro-steps: ``backward`` divides the
  loss by ``gradient_accumulation_steps`` (``scale_wrt_gas``), and ``step``
  steps the optimizer and the scheduler only at an accumulation boundary;
- the counters ``global_steps``, ``global_samples``, ``micro_steps``,
  ``skipped_steps``, saved with the scheduler's state in checkpoints;
- ``steps_per_print`` and ``wall_clock_breakdown``: DeepSpeed's progress,
  throughput and timing lines, through the ``ductile.deepspeed`` logger on
  rank 0; and, as the zero3 engine's ``log_interval``, its progress line
  (``ductile.zero3`` logger), with the samples of each step and the tokens
  of each training forward counted here. A step's lines are written at a
  later step, once their values reached the host (the zero3 engine's
  ``Lines``): no line makes a step wait for the device; ``destroy()`` and
  the process' exit write the last ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .._config import StrPath
from .._errors import InvalidArgumentError, IoError
from ..torch.zero3 import Zero3Engine
from ..torch.zero3._progress import owned_lines
from ..zero_to_fp32 import write_script

_logger = logging.getLogger("ductile.deepspeed")


class _StdoutHandler(logging.StreamHandler):
    """A handler writing to whatever sys.stdout is when a line is logged
    (a test's capture, a redirected stream), as print() does."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass


def _progress_logger(level=None):
    """The logger of the progress lines, printing to stdout at the config's
    log_level (default "warning", so the step lines are silent) as
    DeepSpeed's logger does, unless the application configured it."""
    if not _logger.handlers:
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter(
            "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
        _logger.addHandler(handler)
        _logger.propagate = False
    if level is not None:
        _logger.setLevel(level.upper())
    return _logger


class _Timers:
    """Wall-clock time of forward, backward and step since the last boundary
    (wall_clock_breakdown), and the step's samples/s (steps_per_print)."""

    def __init__(self):
        self.spent = {"fwd": 0.0, "bwd": 0.0, "step": 0.0}
        self.step_start = None  # the first forward of the current step
        self.trained_time = 0.0  # seconds of the steps counted in the running average
        self.trained_steps = 0

    @contextlib.contextmanager
    def timed(self, name):
        start = time.perf_counter()
        if self.step_start is None:
            self.step_start = start
        try:
            yield
        finally:
            self.spent[name] += time.perf_counter() - start

    def end_step(self):
        """Seconds since the step's first forward (0 without one)."""
        start, self.step_start = self.step_start, None
        return 0.0 if start is None else time.perf_counter() - start

    def take(self):
        spent, self.spent = self.spent, dict.fromkeys(self.spent, 0.0)
        return spent


def _tokens_of(args, kwargs):
    """The tokens of a forward's batch: the attention mask's ones (a 0-d
    tensor, read only when a line is logged), else the input ids' count
    (padding-free packs have no mask); None for inputs without either."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return mask.sum(dtype=torch.int64)
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids.numel() if isinstance(ids, torch.Tensor) else None


def _write_report(values):
    """Writes one step's DeepSpeed lines from the values _report took."""
    progress = values.get("progress")
    if progress is not None:
        step, skipped, micro_step, average, current, allocated, peak = progress
        log = _progress_logger()
        log.info(f"[Rank 0] step={step}, skipped={skipped}, lr={values['lr']}, "
                 f"mom={values['mom']}")
        log.info(f"[Rank 0] epoch=0/micro_step={micro_step}/global_step={step}, "
                 f"RunningAvgSamplesPerSec={average}, CurrSamplesPerSec={current}, "
                 f"MemAllocated={allocated}GB, MaxMemAllocated={peak}GB")
    spent = values["spent"]
    if spent is not None:
        print("time (ms) | " + " | ".join(f"{name}: {seconds * 1e3:.2f}"
                                          for name, seconds in spent.items()), flush=True)


def _follow_world(sampler, world_size, rank):
    """`sampler` (initialize's DistributedSampler) at another world size,
    from its next epoch (an epoch begun keeps its indices)."""
    sampler.num_replicas, sampler.rank = world_size, rank
    sampler.num_samples = -(-len(sampler.dataset) // world_size)  # drop_last False
    sampler.total_size = sampler.num_samples * world_size


class DeepSpeedEngine(torch.nn.Module):
    """What ``ductile.deepspeed.initialize`` returns first: DeepSpeed's
    engine over ``zero3``, the ductile ZeRO-3 engine of ``module``."""

    # batch: (train_batch_size, micro-batch per rank, gradient accumulation
    # steps); training: the DeepSpeed config's training keys as the mapping
    # read them; config: the DeepSpeed config as given.
    # replan: the batch sizes at another world size (after an in-place rejoin).
    def __init__(self, module: torch.nn.Module, zero3: Zero3Engine, batch: tuple[int, int, int],
                 training: Mapping[str, Any], lr_scheduler: Any = None,
                 training_dataloader: torch.utils.data.DataLoader | None = None,
                 config: dict[str, Any] | None = None,
                 replan: Callable[[int], tuple[int, int, int]] | None = None) -> None:
        super().__init__()
        self.module = module
        self._zero3 = zero3
        self._config = config
        self._train_batch_size, self._micro_batch, self._accumulation = batch
        self._replan = replan
        # The batch sizes of the world joined in place, from the step after
        # the one in progress (which ends with the micro-batches it began with).
        self._next_batch: tuple[int, int, int] | None = None
        zero3._after_rejoin = self._rejoined
        self._steps_per_print = training["steps_per_print"]
        self._wall_clock_breakdown = training["wall_clock_breakdown"]
        _progress_logger(training["log_level"])
        # Steps are timed only for the lines that print the times.
        self._timed = self._wall_clock_breakdown or self._steps_per_print is not None
        self.optimizer = zero3.optimizer
        zero3.lr_scheduler = lr_scheduler  # stepped by zero3's step()
        self.training_dataloader = training_dataloader
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        # A round that resumed from a snapshot in memory (`ductile agent`)
        # counts on from the snapshot's step.
        restored = getattr(zero3, "restored_from_memory", None)
        if restored is not None:
            self.global_steps = restored
            self.global_samples = restored * self._train_batch_size
            self.micro_steps = restored * self._accumulation
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        self._timers = _Timers()
        self._lines = owned_lines(self)  # the progress lines taken, not yet written
        # DeepSpeed's engine reports the gradient norm of every step.
        zero3.measure_grad_norm = True

    # --- what DeepSpeed's engine is -------------------------------------------------

    @property
    def zero3(self) -> Zero3Engine:
        """The ductile ZeRO-3 engine underneath (``stats()``, ``units()``,
        ``full_parameters()``, ...)."""
        return self._zero3

    @property
    def lr_scheduler(self) -> Any:
        """The scheduler stepped after each applied optimizer step (the
        config's, or the one given to initialize), or None."""
        return self._zero3.lr_scheduler

    @property
    def config(self) -> dict[str, Any] | None:
        """The DeepSpeed config as given (a dict)."""
        return self._config

    @property
    def global_rank(self) -> int:
        return self._zero3.rank

    @property
    def world_size(self) -> int:
        return self._zero3.world_size

    @property
    def dp_world_size(self) -> int:
        return self._zero3.world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def device(self) -> torch.device:
        return self._zero3.device

    def train_batch_size(self) -> int:
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self._accumulation

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Changes the global batch by changing gradient_accumulation_steps,
        as DeepSpeed's does (the micro-batch and the world stay)."""
        per_step = self._micro_batch * self.world_size
        if not isinstance(train_batch_size, int) or train_batch_size <= 0 \
                or train_batch_size % per_step:
            raise InvalidArgumentError(
                f"set_train_batch_size: train_batch_size {train_batch_size!r} is not a positive "
                f"multiple of micro-batch x world size = {per_step}")
        self._train_batch_size = train_batch_size
        self._accumulation = train_batch_size // per_step

    def zero_optimization(self) -> bool:
        return True

    def zero_optimization_stage(self) -> int:
        return 3

    def zero_optimization_partition_weights(self) -> bool:
        return True

    def zero_optimization_partition_gradients(self) -> bool:
        return True

    def fp16_enabled(self) -> bool:
        precision = self._zero3.mixed_precision
        return precision is not None and precision.param_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        precision = self._zero3.mixed_precision
        return precision is not None and precision.param_dtype == torch.bfloat16

    def gradient_clipping(self) -> float:
        return self._zero3.gradient_clipping or 0.0

    def steps_per_print(self) -> int | None:
        return self._steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._wall_clock_breakdown

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def get_mom(self) -> list[tuple[float, float] | float | None]:
        if self.optimizer is None:
            return []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in
                self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last step, as a
        float; None before the first step."""
        norm = self._zero3.grad_norm
        return None if norm is None else float(norm)

    def was_step_applied(self) -> bool:
        """Whether the last boundary's optimizer step changed the model
        (False after an fp16 overflow skipped it)."""
        return self._zero3.step_applied

    @property
    def loss_scale(self) -> float:
        return self._zero3.loss_scale

    # --- the training loop ---------------------------------------------------------

    def _timing(self, name):
        return self._timers.timed(name) if self._timed else contextlib.nullcontext()

    def _require_optimizer(self, what):
        if self.optimizer is None:
            raise InvalidArgumentError(
                f"DeepSpeedEngine.{what}: the engine has no optimizer; give initialize() an "
                "optimizer or an \"optimizer\" section in the config")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._zero3.log_interval and self.module.training:
            tokens = _tokens_of(args, kwargs)
            if tokens is not None:
                self._zero3.count_batch(0, tokens)
        with self._timing("fwd"):
            return self._zero3(*args, **kwargs)  # kept, to run again after a rejoin

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Back-propagates ``loss`` divided by gradient_accumulation_steps
        (with ``scale_wrt_gas``, as DeepSpeed does); returns that loss.
        The gradient shards are complete when it returns."""
        self._require_optimizer("backward")
        divisor = self._accumulation if scale_wrt_gas else 1
        with self._timing("bwd"):
            return self._zero3._divided_backward(loss, divisor, {"retain_graph": retain_graph})

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self._accumulation == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Overrides the micro-step count's boundary (DeepSpeed's manual
        boundary, used by pipelines of micro-batches of their own)."""
        self._boundary = bool(is_boundary)

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        """At an accumulation boundary: clips, steps the optimizer on the
        shards and the scheduler (unless an fp16 overflow skipped the step),
        clears the gradients, counts the step and prints progress every
        steps_per_print steps. Always counts the micro-step."""
        self._require_optimizer("step")
        if self._lines:
            self._lines.poll()  # earlier steps' lines whose values have arrived
        if self.is_gradient_accumulation_boundary():
            # This rank's share of the step's samples, as DeepSpeed counts
            # them (train_batch_size a step).
            self._zero3.count_batch(self._train_batch_size // self.world_size)
            with self._timing("step"):
                self._zero3.step(lr_kwargs)  # the scheduler too, unless skipped
            if not self._zero3.step_applied:
                self.skipped_steps += 1
            if self._timed:
                self._report(self._timers.end_step())
            self.global_steps += 1
            self.global_samples += self._train_batch_size
            if self._next_batch is not None:
                self._take_next_batch()
                return
        self.micro_steps += 1

    def _rejoined(self, restored: int) -> None:
        """After the zero3 engine rejoined a round in place at the snapshot
        of step `restored`: the steps after it are taken back from the
        counters, and the new world's batch sizes apply from the next step:
        the one in progress ends with the micro-batches it began with."""
        lost = self.global_steps - restored
        if lost > 0:
            self.global_steps = restored
            self.global_samples -= lost * self._train_batch_size
            self.micro_steps -= lost * self._accumulation
        if self._replan is not None:
            self._next_batch = self._replan(self.world_size)
        sampler = getattr(self.training_dataloader, "sampler", None)
        if isinstance(sampler, torch.utils.data.distributed.DistributedSampler):
            _follow_world(sampler, self.world_size, self.global_rank)

    def _take_next_batch(self) -> None:
        assert self._next_batch is not None
        self._train_batch_size, self._micro_batch, self._accumulation = self._next_batch
        self._next_batch = None
        self.micro_steps = self.global_steps * self._accumulation

    def _report(self, step_seconds):
        """Takes the step's lines (rank 0): written at a later step, once
        a learning rate given as a tensor reached the host."""
        step = self.global_steps + 1
        self._timers.trained_time += step_seconds
        self._timers.trained_steps += 1
        spent = self._timers.take()
        if self.global_rank != 0:
            return
        values: dict[str, Any] = {"spent": spent if self._wall_clock_breakdown else None}
        if self._steps_per_print is not None and step % self._steps_per_print == 0:
            average = self._timers.trained_steps * self._train_batch_size / max(
                self._timers.trained_time, 1e-9)
            current = self._train_batch_size / max(step_seconds, 1e-9)
            values["progress"] = (step, self.skipped_steps, self.micro_steps + 1, average,
                                  current, *self._memory_gb())
            values["lr"] = self.get_lr()
            values["mom"] = self.get_mom()
        if len(values) > 1 or values["spent"] is not None:
            self._lines.add(values, _write_report)

    def _memory_gb(self):
        device = self._zero3.device
        if device.type == "cuda":
            return (round(torch.cuda.memory_allocated(device) / 1024**3, 2),
                    round(torch.cuda.max_memory_allocated(device) / 1024**3, 2))
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return round(resident / 1024**3, 2), round(peak / 1024**3, 2)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep full gradients locally; the first
        backward after it reduces their sum (``Zero3Engine.no_sync``).
        DeepSpeed refuses this under ZeRO-3; ductile can do it."""
        with self._zero3.no_sync():
            yield

    def zero_grad(self) -> None:
        self._zero3.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self._zero3.clip_grad_norm_(max_norm, norm_type)

    # --- checkpoints and weights ------------------------------------------------------

    def save_checkpoint(self, save_dir: StrPath, tag: str | int | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Writes a checkpoint into ``save_dir/tag`` (tag: "global_step<N>")
        and points ``save_dir/latest`` at it (the commit of
        ``Zero3Engine.save``): shards, optimizer state, the scheduler's
        state, the counters and ``client_state`` (a JSON-able dict, empty
        when None). Loadable at any world size. Collective; returns True."""
        if not save_latest:
            warnings.warn("save_checkpoint: save_latest=False is accepted, has no effect in "
                          "ductile: a save commits by pointing 'latest' at it", UserWarning,
                          stacklevel=2)
        if exclude_frozen_parameters:
            warnings.warn("save_checkpoint: exclude_frozen_parameters=True is accepted, has no "
                          "effect in ductile: every parameter's shard is saved", UserWarning,
                          stacklevel=2)
        if tag is None:
            tag = f"global_step{self.global_steps}"
        state = {
            "client_state": {} if client_state is None else client_state,
            "global_steps": self.global_steps, "global_samples": self.global_samples,
            "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps,
        }
        self._zero3.save(save_dir, client_state={"deepspeed_engine": state}, tag=str(tag))
        if self._zero3.rank == 0:
            # DeepSpeed's folder holds the converter to whole weights: so does ours.
            write_script(os.fspath(save_dir))
        return True

    def load_checkpoint(self, load_dir: StrPath, tag: str | int | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: None = None
                        ) -> tuple[str, dict[str, Any]] | tuple[None, None]:
        """Restores a checkpoint of ``save_checkpoint`` (``load_dir/latest``,
        or ``load_dir/tag``), saved at any world size. Returns
        ``(path, client_state)``, or ``(None, None)`` with a warning when
        ``load_dir`` holds no checkpoint, as DeepSpeed does. Collective."""
        if custom_load_fn is not None:
            raise InvalidArgumentError(
                "load_checkpoint: custom_load_fn is not supported by ductile; valid: None")
        if not load_optimizer_states or load_module_only:
            raise InvalidArgumentError(
                "load_checkpoint: load_optimizer_states=False / load_module_only=True are not "
                "supported by ductile: a load restores shards and optimizer state together; "
                "for weights alone load a save_16bit_model() file into the model before "
                "initialize")
        path = load_dir if tag is None else os.path.join(load_dir, str(tag))
        if tag is None and not os.path.lexists(os.path.join(load_dir, "latest")):
            _logger.warning(f"Unable to find latest file at {os.path.join(load_dir, 'latest')}, "
                            "if trying to load latest checkpoint please ensure this file exists "
                            "or pass an explicit checkpoint tag when loading a checkpoint.")
            return None, None
        saved = self._zero3.load(path, lr_scheduler=load_lr_scheduler_states)
        if not isinstance(saved, dict) or "deepspeed_engine" not in saved:
            raise IoError(f"{path}: a checkpoint of Zero3Engine.save, not of save_checkpoint "
                          "(no engine state); load it with engine.zero3.load()")
        state = saved["deepspeed_engine"]
        self.global_steps = state["global_steps"]
        self.global_samples = state["global_samples"]
        self.micro_steps = state["micro_steps"]
        self.skipped_steps = state["skipped_steps"]
        return os.path.abspath(path), state["client_state"]

    def save_16bit_model(self, save_dir: StrPath, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Writes the whole model's state dict (in the model's dtype) to
        ``save_dir/save_filename`` with torch.save on rank 0, as DeepSpeed
        does; ``.safetensors`` file names are written as safetensors.
        Collective; returns True."""
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            if save_filename.endswith(".safetensors"):
                from safetensors.torch import save_file
                save_file({k: v.contiguous() for k, v in state.items()}, path)
            else:
                torch.save(state, path)
        return True

    def module_state_dict(self, destination: Any = None, prefix: str = "",
                          keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The model's whole state dict (collective)."""
        return self._zero3.state_dict()

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.stage3_gather_16bit_weights_on_model_save: HF
        Accelerate and the Trainer save the whole model only when true."""
        zero = (self._config or {}).get("zero_optimization") or {}
        value = zero.get("stage3_gather_16bit_weights_on_model_save",
                         zero.get("gather_16bit_weights_on_model_save", False))
        return value is True

    def _zero3_consolidated_16bit_state_dict(
            self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's state dict on rank 0 (an empty dict elsewhere),
        as HF Accelerate's get_state_dict takes it. Collective."""
        state = self._zero3.state_dict(rank0_only=True)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    _consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict

    def destroy(self) -> None:
        """Writes the progress lines not written yet, removes the hooks and
        gives the model its whole parameters back (``Zero3Engine.close``).
        Collective."""
        self._lines.flush()
        self._zero3.close()
