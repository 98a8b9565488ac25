"""ductile for the Hugging Face ``Trainer``: ductile's ZeRO-3 engine under
the Trainer's DeepSpeed integration, and optionally token-budget
micro-batches, padding-free packs and the variable-batch learning rate in
place of the Trainer's fixed-size batches and its scheduler.

    from ductile.hf import DuctileTrainer as Trainer      # the one changed line
    args = TrainingArguments(..., deepspeed="ds.json")     # or --deepspeed ds.json
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()

**ZeRO-3.** With ``args.deepspeed`` (a DeepSpeed config with ZeRO stage 3),
the Trainer runs its DeepSpeed integration as it always does (Accelerate
fills the config's "auto" values, builds the optimizer and scheduler it
names, saves ``save_steps`` checkpoints, resumes, gathers the model for
``save_model``), but the engine it gets is ductile's: during ``train``,
``evaluate`` and ``predict``, ``deepspeed.initialize`` is
``ductile.deepspeed.initialize`` (docs/deepspeed.md).

**Packs** (with ``max_tokens``), in place of the Trainer's own:

- ``get_train_dataloader``: a ``DynamicBatchSampler`` over the dataset's
  lengths, ``args.gradient_accumulation_steps`` micro-batches per rank and
  step, rank and world size from ``args`` (torchrun), seed ``args.seed``;
  collated by ``FlattenCollate`` (padding-free; the model is run with
  ``use_cache=False``, see ``FlattenCollate``) unless a ``data_collator`` is
  given;
- ``create_scheduler``: a ``VariableBatchLRScheduler`` whose base schedule
  follows ``args.lr_scheduler_type`` ("constant", "constant_with_warmup",
  "linear", "cosine"), ``args.get_warmup_steps`` and the number of training
  steps, scaled every step by ``lr_rule`` for the step's real batch size.

**Logs** (with ``max_tokens``): every training log adds, over the steps
since the previous one, ``batch_samples``, ``batch_tokens``,
``tokens_per_second``, ``padding_fraction`` and ``lr_scale`` (the factor of
the logged ``learning_rate`` over the base schedule's); training starts by
drawing the epoch's batch plan into ``output_dir`` (_hf_logging.py).

The Trainer's own gradient accumulation and token-weighted loss
(``num_items_in_batch``) apply unchanged. The steps are the sampler's: each
epoch runs its own step count (a packing's epochs differ by a few steps), and
``max_steps`` is the sum over ``args.num_train_epochs`` epochs (or
``args.max_steps``).

**Resume.** Every checkpoint holds ``ductile_sampler.json``: the sampler's
state after the checkpoint's step (epoch, micro-batches done in it, the steps
run at earlier world sizes) and the settings the data depends on.
``trainer.train(resume_from_checkpoint=...)`` restores the sampler from it,
not from the Trainer's skip (which counts this rank's micro-batches in the
checkpoint's world size):

- at the same world size and ``gradient_accumulation_steps``, the run goes
  on with exactly the micro-batches, rates and losses of an uninterrupted
  run (tests/python/test_hf_resume.py);
- at another world size or ``gradient_accumulation_steps`` (an elastic
  re-form), the samples the checkpoint's epoch has not trained are packed
  again for the new layout (``DynamicBatchSampler.load_state_dict``); later
  epochs are packed whole at the new layout. No sample is repeated or
  skipped (tests/python/test_hf_elastic_resume.py, 2 ranks -> 1 and 1 -> 2);
- with more ``num_train_epochs`` or a larger ``max_steps`` (training longer),
  the run goes on into the new epochs.

In each case the Trainer's ``global_step`` continues from the checkpoint's,
``max_steps`` is planned again from the sampler, and ``state.epoch`` counts
the sampler's steps. The learning rate continues from the checkpoint's step;
its schedule's total (and ``args.get_warmup_steps`` of it) is the new plan.
So every later step gets the base schedule's rate at its global step for the
new total, scaled by ``lr_rule`` for its real batch size: at the resume step a
linear or cosine decay moves from the old plan's rate to the new plan's (up
when the run got more steps: fewer ranks, more epochs), then decays to end at
the new last step, as the Trainer's own schedulers do when a run is extended.
A checkpoint whose run had another ``max_tokens``, ``args.seed``, ``order``,
number of samples or sample lengths, learning rate or schedule is refused
(``ductile.IncompatibleError`` naming the setting and both values), as is one
without ``ductile_sampler.json``. ``args.ignore_data_skip`` does not apply to
packs.
"""

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import accelerate.scheduler
import numpy as np
import torch
import transformers

from . import _hf_in_place
from ._errors import IncompatibleError, InvalidArgumentError
from ._hf_logging import StepReport, is_training_log
from ._hf_zero3 import ductile_engine, use_ductile_zero3
from .torch import DynamicBatchSampler, FlattenCollate, VariableBatchLRScheduler
from .torch._sampler import Lengths

_logger = transformers.utils.logging.get_logger(__name__)

# A script imports this module before it makes its model: from here on,
# transformers' ZeRO-3 builds and loads models into ductile's partitions.
use_ductile_zero3()

# In every checkpoint of a run with packs: where the data stands (the
# sampler's state at the checkpoint's step) and the settings it depends on.
RESUME_FILE = "ductile_sampler.json"
_RESUME_FORMAT = "ductile.hf.DuctileTrainer"


__all__ = ["DuctileTrainer"]

# args.lr_scheduler_type -> (base schedule, uses warm-up)
_SCHEDULES = {"constant": ("constant", False), "constant_with_warmup": ("constant", True),
              "linear": ("warmup_linear", True), "cosine": ("warmup_cosine", True)}


def _sample_length(sample):
    ids = sample["input_ids"] if isinstance(sample, dict) else sample
    return len(ids)


class _StepScheduler(VariableBatchLRScheduler):
    """The Trainer loads a checkpoint's scheduler state with
    ``load_state_dict(state)``; the run's steps may have been planned again
    since (another world size, more epochs), so the state's totals give way
    to this run's."""

    def load_state_dict(self, state, *, replan=True):
        super().load_state_dict(state, replan=replan)


class _EpochProgress(transformers.TrainerCallback):
    """``state.epoch`` from the sampler's steps: the Trainer's own fraction
    counts the micro-batches of this call's loop, which in a resumed epoch
    are not the epoch's."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer.ductile_sampler is not None and trainer._ductile_epoch is not None:
            epoch = trainer._ductile_epoch
            sampler = trainer.ductile_sampler
            state.epoch = epoch + (state.global_step - sampler.first_step(epoch)) / len(
                sampler.batch_sizes(epoch))


class _EpochDataLoader(torch.utils.data.DataLoader):
    """The Trainer stops taking micro-batches once an epoch's steps are done,
    before the sampler's iterator ends, and moves to the next epoch by
    calling the loader's set_epoch."""

    def set_epoch(self, epoch):
        self.batch_sampler.set_epoch(epoch)


class DuctileTrainer(_hf_in_place.InPlaceTrainer, transformers.Trainer):
    """A ``transformers.Trainer`` on ductile's ZeRO-3 engine (with
    ``args.deepspeed``) and, with ``max_tokens``, on ductile's variable
    batches. Keyword arguments beyond the Trainer's, all optional:

    - ``max_tokens``: the token budget of a micro-batch (None: the Trainer's
      own batches and scheduler);
    - ``lengths``: one length per training sample (default: the length of
      each sample's ``input_ids``, read once);
    - ``lr_rule`` ("sqrt", "linear", "none" or another lr plugin) and
      ``base_batch_size`` (the batch size ``args.learning_rate`` is tuned
      for; required with max_tokens unless ``lr_rule="none"``);
    - ``order`` ("random", "seqlen", "dataloader") and any other keyword of
      ``DynamicBatchSampler`` as ``sampler_options``.
    """

    # The Trainer's attribute, set by create_scheduler below too; declared for
    # the type check, which does not read transformers.
    lr_scheduler: Any

    def __init__(self, *args: Any, max_tokens: int | None = None,
                 lengths: Lengths | None = None, lr_rule: str = "sqrt",
                 base_batch_size: float | None = None, order: str = "random",
                 sampler_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if len(args) > 2:
            raise InvalidArgumentError(
                "DuctileTrainer: pass the Trainer's arguments after model and args by keyword "
                "(data_collator=..., train_dataset=...)")
        packs = max_tokens is not None
        if not packs:
            given = [name for name, value in (("lengths", lengths), ("base_batch_size",
                                                                     base_batch_size),
                                              ("sampler_options", sampler_options))
                     if value is not None]
            if given:
                raise InvalidArgumentError(
                    f"DuctileTrainer: {', '.join(given)} configure ductile's packs, which are "
                    "on only with max_tokens: give max_tokens (the token budget of a "
                    "micro-batch) too")
        if packs and kwargs.get("data_collator") is None:
            kwargs["data_collator"] = FlattenCollate()
        super().__init__(*args, **kwargs)
        self.ductile_sampler: DynamicBatchSampler | None = None
        self._flatten = False
        self._ductile_epoch: int | None = None  # the epoch the training loop is in
        self._step_report: StepReport | None = None
        if packs:
            self._set_up_packs(max_tokens, lengths, lr_rule, base_batch_size, order,
                               sampler_options)

    def _set_up_packs(self, max_tokens, lengths, lr_rule, base_batch_size, order,
                      sampler_options):
        if lr_rule != "none" and base_batch_size is None:
            raise InvalidArgumentError(
                f"DuctileTrainer: lr_rule '{lr_rule}' needs base_batch_size (the batch size "
                "args.learning_rate is tuned for), or lr_rule='none'")
        schedule = getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)
        if schedule not in _SCHEDULES:
            raise InvalidArgumentError(
                f"DuctileTrainer: args.lr_scheduler_type '{schedule}' has no variable-batch "
                f"schedule; valid: {', '.join(_SCHEDULES)}")
        self._schedule = _SCHEDULES[schedule]
        if lengths is None:
            lengths = [_sample_length(self.train_dataset[i])
                       for i in range(len(self.train_dataset))]
        elif len(lengths) != len(self.train_dataset):
            raise InvalidArgumentError(
                f"DuctileTrainer: lengths has {len(lengths)} entries but train_dataset has "
                f"{len(self.train_dataset)} samples: give one length per sample")
        # What makes the sampler again at another world size (in place).
        self._sampler_args = dict(
            lengths=np.asarray(lengths, dtype=np.int64), max_tokens=max_tokens,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps, order=order,
            seed=self.args.seed, **(sampler_options or {}))
        self.ductile_sampler = self._new_sampler()
        self._lr_rule = lr_rule
        self._base_batch_size = 1.0 if base_batch_size is None else base_batch_size
        self._flatten = isinstance(self.data_collator, FlattenCollate)
        # What a checkpoint's data position depends on: a resume with any
        # of them changed would not continue the same run.
        self._resume_settings = {
            "train_dataset samples": len(self.ductile_sampler.lengths),
            "max_tokens": self.ductile_sampler.max_tokens, "args.seed": self.args.seed,
            "order": order, "args.lr_scheduler_type": schedule,
            "args.learning_rate": self.args.learning_rate, "lr_rule": lr_rule,
            "base_batch_size": base_batch_size,
            "sampler_options": {k: v for k, v in (sampler_options or {}).items()
                                if isinstance(v, (bool, int, float, str, type(None)))}}
        self.callback_handler.callbacks.insert(0, _EpochProgress(self))
        self._step_report = StepReport(self)
        self.callback_handler.callbacks.insert(1, self._step_report)
        self._snapshot_record = self._sampler_record
        self._fresh_sampler_state = self.ductile_sampler.state_dict()
        self._resumed_step = 0

    def _new_sampler(self):
        return DynamicBatchSampler(**self._sampler_args, rank=self.args.process_index,
                                   world_size=self.args.world_size)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        with ductile_engine(self.is_deepspeed_enabled):
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        with ductile_engine(self.is_deepspeed_enabled):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with ductile_engine(self.is_deepspeed_enabled):
            return super().predict(*args, **kwargs)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        if self.ductile_sampler is None:
            return super().get_train_dataloader()
        # Not through accelerator.prepare: the sampler already gives this
        # rank its own micro-batches, and sharding them again would lose some.
        return _EpochDataLoader(
            self.train_dataset, batch_sampler=self.ductile_sampler,
            collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory)

    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None) -> Any:
        if self.ductile_sampler is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            warmup, total = self._planned_steps(num_training_steps)
            self.lr_scheduler = _StepScheduler(
                optimizer or self.optimizer, self.ductile_sampler, lr_rule=self._lr_rule,
                base_batch_size=self._base_batch_size, base_lr=self.args.learning_rate,
                schedule=self._schedule[0], warmup_steps=warmup, total_steps=total)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _planned_steps(self, num_training_steps):
        """The variable-batch schedule's (warm-up steps, total steps) for a
        run of `num_training_steps`."""
        warmup = self.args.get_warmup_steps(num_training_steps) if self._schedule[1] else 0
        return warmup, max(num_training_steps, warmup + 1)

    @property
    def _ductile_scheduler(self):
        """The variable-batch scheduler create_scheduler made, or None. Under
        DeepSpeed the integration calls create_scheduler on a copy of the
        Trainer, and Accelerate wraps the scheduler the engine returns."""
        scheduler = self.lr_scheduler
        if isinstance(scheduler, accelerate.scheduler.AcceleratedScheduler):
            scheduler = scheduler.scheduler
        return scheduler if isinstance(scheduler, _StepScheduler) else None

    # -- Resume. The sampler, not the Trainer, knows which samples a step
    # took: the Trainer's own skip counts this rank's micro-batches in the
    # checkpoint's world size, and its epoch length is the first epoch's.

    def _inner_training_loop(self, batch_size=None, args=None, resume_from_checkpoint=None,
                             trial=None, ignore_keys_for_eval=None):
        if self.ductile_sampler is not None:
            self._ductile_epoch = None
            self._resumed_step = 0
            if self._ductile_resume is not None:
                # The sampler of this world, where the restored snapshot's
                # step left the data.
                self.ductile_sampler = self._new_sampler()
                self._apply_sampler_record(_hf_in_place.sampler_record_of(self),
                                           _hf_in_place.IN_PLACE)
            elif resume_from_checkpoint is None:
                self.ductile_sampler.load_state_dict(self._fresh_sampler_state)
            else:
                self._resume_sampler(resume_from_checkpoint)
        return super()._inner_training_loop(
            batch_size=batch_size, args=args, resume_from_checkpoint=resume_from_checkpoint,
            trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)

    def _resume_sampler(self, checkpoint):
        """Restores the sampler's position from the checkpoint's RESUME_FILE,
        re-packing the rest of its epoch when the world size or the
        micro-batches per step changed."""
        path = os.path.join(checkpoint, RESUME_FILE)
        if not os.path.isfile(path):
            raise IncompatibleError(
                f"DuctileTrainer: resume_from_checkpoint '{checkpoint}' has no {RESUME_FILE} "
                "(which samples its steps took): it was not saved by a DuctileTrainer with "
                "max_tokens. "
                "Resume from a checkpoint of such a run, or train without resume_from_checkpoint")
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError) as error:
            raise InvalidArgumentError(
                f"DuctileTrainer: {path} cannot be read ({error}): the checkpoint is damaged") \
                from error
        keys = {"format", "version", "global_step", "world_size", "gradient_accumulation_steps",
                "max_steps", "num_train_epochs", "settings", "sampler"}
        if (not isinstance(saved, dict) or saved.get("format") != _RESUME_FORMAT
                or saved.get("version") != 1 or not keys <= saved.keys()
                or not isinstance(saved["settings"], dict)
                or not isinstance(saved["sampler"], dict)):
            raise InvalidArgumentError(
                f"DuctileTrainer: {path} is not a version 1 {_RESUME_FORMAT} record (with "
                f"{', '.join(sorted(keys))}): the checkpoint is damaged")
        self._apply_sampler_record(saved, checkpoint, path)
        trainer_state = os.path.join(checkpoint, "trainer_state.json")
        if os.path.isfile(trainer_state):
            with open(trainer_state, encoding="utf-8") as f:
                recorded = json.load(f).get("global_step")
            if recorded != saved["global_step"]:
                raise InvalidArgumentError(
                    f"DuctileTrainer: {trainer_state} has global_step {recorded!r} and {path} "
                    f"{saved['global_step']}: they are of different checkpoints")

    def _apply_sampler_record(self, saved, checkpoint, path=None):
        """Puts the sampler where a record of _sampler_record (from
        `checkpoint`: its file `path`, or the snapshot in memory) says, and
        the step it was taken after into _resumed_step; re-packs the rest
        of its epoch when the world size or the micro-batches per step
        changed."""
        path = checkpoint if path is None else path
        for key, value in self._resume_settings.items():
            was = saved["settings"].get(key)
            if was != value:
                raise IncompatibleError(
                    f"DuctileTrainer: resume_from_checkpoint '{checkpoint}' was saved with {key} "
                    f"= {was!r}, this run has {value!r}: its steps took their samples and rates "
                    f"by that setting, so the rest of the run can be planned only with {key} = "
                    f"{was!r}; give that, or train without resume_from_checkpoint")
        sampler = self.ductile_sampler
        assert sampler is not None  # only resumed with max_tokens
        state = dict(saved["sampler"])
        if state.get("lengths_sha256") != self._fresh_sampler_state["lengths_sha256"]:
            raise IncompatibleError(
                f"DuctileTrainer: resume_from_checkpoint '{checkpoint}' was saved for samples "
                f"of other lengths (train_dataset or lengths changed; both runs have "
                f"{len(sampler.lengths)} samples): resume with the checkpoint's data")
        if (state.get("world_size") == sampler.world_size
                and state.get("effective_batch_size") == sampler.effective_batch_size):
            # At a step's end every rank has taken as many micro-batches, so
            # rank 0's position is every rank's.
            state["rank"] = sampler.rank
        sampler.load_state_dict(state)
        epoch, step = sampler.epoch, saved["global_step"]
        left = (len(sampler) - sampler.position) // sampler.gradient_accumulation_steps
        if sampler.first_step(epoch) + len(sampler.batch_sizes(epoch)) - left != step:
            raise InvalidArgumentError(
                f"DuctileTrainer: {path} has global_step {step!r}, but its sampler state "
                f"ends epoch {epoch} {left} steps after step {sampler.first_step(epoch)}: "
                "the checkpoint is damaged")
        self._resumed_step = step
        if (saved["world_size"], saved["gradient_accumulation_steps"]) != (
                sampler.world_size, sampler.gradient_accumulation_steps):
            _logger.warning(
                f"DuctileTrainer: resuming at world size {sampler.world_size} with "
                f"{sampler.gradient_accumulation_steps} micro-batches per rank and step ("
                + ("the snapshot" if checkpoint == _hf_in_place.IN_PLACE else "the checkpoint")
                + f": {saved['world_size']} and {saved['gradient_accumulation_steps']}): "
                f"the samples epoch {epoch} has left after step {step} are packed again, and "
                "the learning-rate schedule is planned again over the new step count")

    def set_initial_training_values(self, args: transformers.TrainingArguments,
                                    dataloader: torch.utils.data.DataLoader) -> tuple:
        values = super().set_initial_training_values(args, dataloader)
        if self.ductile_sampler is None:
            return values
        _, _, num_examples, num_train_samples, total_batch_size, _, _ = values
        sampler, done = self.ductile_sampler, self._resumed_step
        # Each epoch of a packing has its own step count: the plan adds
        # them up, from where the sampler stands.
        if args.max_steps > 0:
            max_steps = args.max_steps
            planned = f"args.max_steps {max_steps}"
        else:
            whole = math.floor(args.num_train_epochs)
            max_steps = sampler.first_step(whole) if whole >= sampler.resume_epoch else 0
            if args.num_train_epochs > whole and whole >= sampler.resume_epoch:
                max_steps += math.ceil((args.num_train_epochs - whole)
                                       * len(sampler.batch_sizes(whole)))
            planned = f"args.num_train_epochs {args.num_train_epochs} ({max_steps} steps)"
        if max_steps <= done:
            raise IncompatibleError(
                f"DuctileTrainer: {planned} ends at or before the checkpoint, which has run "
                f"{done} steps (into epoch {sampler.epoch}): to train longer give more epochs, "
                f"or max_steps above {done}")
        try:
            num_train_epochs = sampler.epoch_of(max_steps - 1) + 1
        except InvalidArgumentError as error:
            raise InvalidArgumentError(
                f"DuctileTrainer: {planned} reaches further than the sampler plans ahead "
                f"({error}); give fewer steps, or train in parts") from error
        steps = len(sampler.batch_sizes(sampler.epoch))
        return (num_train_epochs, steps, num_examples, num_train_samples, total_batch_size,
                steps * sampler.gradient_accumulation_steps, max_steps)

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs,
                             resume_from_checkpoint, trial):
        epochs_trained, skipped = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
            trial)
        if self.ductile_sampler is None:
            return epochs_trained, skipped
        # Nothing for the Trainer to skip: the sampler starts where the
        # checkpoint was.
        return self.ductile_sampler.epoch, 0

    def _run_epoch(self, model, epoch, train_dataloader, steps_in_epoch,
                   num_update_steps_per_epoch, trial, ignore_keys_for_eval, start_time,
                   resume_from_checkpoint, epochs_trained, steps_trained_in_current_epoch):
        if self.ductile_sampler is not None:
            # This epoch's own steps (all of them, or those a resume left).
            sampler = self.ductile_sampler
            self._ductile_epoch = epoch
            num_update_steps_per_epoch = len(sampler.batch_sizes(epoch)) - max(
                self.state.global_step - sampler.first_step(epoch), 0)
            steps_in_epoch = num_update_steps_per_epoch * sampler.gradient_accumulation_steps
            steps_trained_in_current_epoch = 0
        return super()._run_epoch(
            model=model, epoch=epoch, train_dataloader=train_dataloader,
            steps_in_epoch=steps_in_epoch, num_update_steps_per_epoch=num_update_steps_per_epoch,
            trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, start_time=start_time,
            resume_from_checkpoint=resume_from_checkpoint, epochs_trained=epochs_trained,
            steps_trained_in_current_epoch=steps_trained_in_current_epoch)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        scheduler = self._ductile_scheduler
        if self._ductile_resume is not None and scheduler is not None:
            # Entering the loop again in place: the steps planned again
            # over the new sampler, from the restored step on.
            scheduler.sampler = self.ductile_sampler
            warmup, total = self._planned_steps(max_steps)
            scheduler._schedule_args.update(warmup_steps=warmup, total_steps=total)
            scheduler.load_state_dict(scheduler.state_dict(), replan=True)
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        if self.ductile_sampler is not None and self.args.should_save:
            self._save_sampler_state(output_dir)

    def _sampler_record(self, step):
        """Where the data stands after `step` (the sampler's state, counted
        from the Trainer's steps: DataLoader workers may have fetched ahead
        of them) and the settings it depends on; the same on every rank."""
        sampler = self.ductile_sampler
        assert sampler is not None  # only recorded with max_tokens
        epoch = sampler.epoch if self._ductile_epoch is None else self._ductile_epoch
        done = step - sampler.first_step(epoch)
        if done >= len(sampler.batch_sizes(epoch)):
            epoch, done = epoch + 1, 0
        state = sampler.state_dict(consumed=done * sampler.gradient_accumulation_steps,
                                   epoch=epoch)
        # Any rank's position is every rank's at a step's end.
        state["rank"] = 0
        return {"format": _RESUME_FORMAT, "version": 1, "global_step": step,
                "world_size": sampler.world_size,
                "gradient_accumulation_steps": sampler.gradient_accumulation_steps,
                "max_steps": self.state.max_steps,
                "num_train_epochs": self.state.num_train_epochs,
                "settings": self._resume_settings, "sampler": state}

    def _save_sampler_state(self, output_dir):
        """Writes RESUME_FILE: _sampler_record of the checkpoint's step."""
        record = self._sampler_record(self.state.global_step)
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, RESUME_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)

    # -- What a training log shows (_hf_logging.py).

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        if self._step_report is not None:
            self._step_report.count_inputs(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def _get_learning_rate(self):
        # The step whose rate the log shows: the Trainer reads it after the
        # optimizer step, before its scheduler steps (under DeepSpeed the
        # engine has stepped the scheduler already).
        scheduler = self._ductile_scheduler
        if scheduler is not None:
            # made only with max_tokens, which adds the report
            assert self._step_report is not None
            self._step_report.lr_step = scheduler.last_step
        return super()._get_learning_rate()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._step_report is not None and is_training_log(logs):
            self._step_report.add_to(logs)
        super().log(logs, start_time)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any],
                     return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        if self._flatten:
            # transformers builds the per-sample mask of a flattened row only
            # without a cache (FlattenCollate's docstring).
            inputs = dict(inputs, use_cache=False)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)
