"""What a DuctileTrainer with packs adds to the Trainer's training logs, and
the epoch's batch plan it draws when training starts.

Each training log (every ``logging_steps`` steps, through ``Trainer.log``,
so every ``report_to`` backend gets them) covers the steps since the
previous one (the interval):

- ``batch_samples``: the samples the interval's steps trained, over all
  ranks (the packing's batch sizes; with logging_steps 1, the step's real
  global batch);
- ``batch_tokens``: their tokens (the samples' lengths: no padding);
- ``tokens_per_second``: batch_tokens over the interval's wall time;
- ``padding_fraction``: the share of the positions the model ran that were
  padding (1 - batch_tokens / the micro-batches' ``input_ids`` positions
  over all ranks; 0 with FlattenCollate), when the inputs have input_ids;
- ``lr_scale``: the factor ``lr_rule`` gave the step whose
  ``learning_rate`` the log shows (for "sqrt": sqrt(batch size /
  base_batch_size)); ``learning_rate`` is the base schedule's rate at that
  step times lr_scale.
"""

import dataclasses
import os
import time

import numpy as np
import torch
import transformers

PLOT_FILE = "batch_plan.png"

_logger = transformers.utils.logging.get_logger("ductile.hf")


class StepReport(transformers.TrainerCallback):
    """The interval's counts of one DuctileTrainer with packs."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.lr_step = None  # the scheduler's step when the Trainer read the learning rate
        self.plot_path = None
        self._restart(0)

    def on_train_begin(self, args, state, control, **kwargs):
        self._restart(state.global_step)
        if state.is_world_process_zero:
            self._draw_plan(args.output_dir)

    def _restart(self, step):
        self._start_step = step
        self._start_time = time.perf_counter()
        self._positions = 0

    def count_inputs(self, inputs):
        """A training micro-batch of this rank: its positions (no sync)."""
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        if isinstance(ids, torch.Tensor):
            self._positions += ids.numel()

    def add_to(self, logs):
        """Adds the interval's keys to a training log (``logs`` has
        learning_rate) and starts the next interval. Every rank calls it
        (Trainer.log runs on all): the positions are summed over ranks."""
        trainer = self.trainer
        end = trainer.state.global_step
        seconds = max(time.perf_counter() - self._start_time, 1e-9)
        samples, tokens = self._plan_totals(self._start_step, end)
        positions = self._positions
        if trainer.args.world_size > 1:
            counted = torch.tensor([positions], dtype=torch.int64, device=trainer.args.device)
            positions = int(trainer.accelerator.reduce(counted, reduction="sum").item())
        logs["batch_samples"] = samples
        logs["batch_tokens"] = tokens
        logs["tokens_per_second"] = round(tokens / seconds, 3)
        if positions:
            logs["padding_fraction"] = max(0.0, 1.0 - tokens / positions)
        scale = self.lr_scale(self.lr_step if self.lr_step is not None else end - 1)
        if scale is not None:
            logs["lr_scale"] = scale
        self._restart(end)

    def _plan_totals(self, first, end):
        """Samples and tokens of global steps first..end-1, from the
        packing (every rank knows them, no communication)."""
        sampler = self.trainer.ductile_sampler
        samples = tokens = 0
        step = first
        while step < end:
            epoch = sampler.epoch_of(step)
            start = sampler.first_step(epoch)
            totals = sampler.step_totals(epoch)
            stop = min(end, start + len(totals["samples"]))
            samples += int(totals["samples"][step - start:stop - start].sum())
            tokens += int(totals["tokens"][step - start:stop - start].sum())
            step = stop
        return samples, tokens

    def lr_scale(self, step):
        """lr_rule's factor for global step `step`'s batch size."""
        scheduler = self.trainer._ductile_scheduler
        if scheduler is None or step < 0:
            return None
        return scheduler.rule.scale(1.0, float(scheduler.batch_size(step)),
                                    scheduler.base_batch_size)

    def _draw_plan(self, output_dir):
        """The current epoch's packing (ductile.batching.plot) with each
        step's learning rate, into output_dir/PLOT_FILE."""
        from . import batching
        trainer = self.trainer
        sampler = trainer.ductile_sampler
        epoch = sampler.epoch
        plan = sampler.plan(epoch)
        scheduler = trainer._ductile_scheduler
        if scheduler is not None and scheduler.lr_scheduler is None:
            first = sampler.first_step(epoch) + len(sampler.batch_sizes(epoch)) - plan.step_count
            shown = min(plan.step_count, 60)  # plot's max_steps
            lrs = np.array([scheduler.lr_at(first + k)[0] for k in range(shown)])
            plan = dataclasses.replace(plan, lrs=lrs)
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, PLOT_FILE)
        batching.plot(plan, path, title=(
            f"epoch {epoch}: {plan.step_count} steps, max_tokens {sampler.max_tokens}, "
            f"{sampler.gradient_accumulation_steps} micro-batches per rank and step, "
            f"{sampler.world_size} ranks"))
        _logger.info(f"DuctileTrainer: the batch plan of epoch {epoch} is drawn in {path}")
        self.plot_path = path


def is_training_log(logs):
    """A log of the training loop's (loss and learning_rate), not an
    evaluation's or the run's summary."""
    return "learning_rate" in logs and "loss" in logs
