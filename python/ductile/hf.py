"""ductile for the Hugging Face ``Trainer``: token-budget micro-batches,
padding-free packs and the variable-batch learning rate, in place of the
Trainer's fixed-size batches and its scheduler.

    from ductile.hf import DuctileTrainer                 # instead of transformers.Trainer
    trainer = DuctileTrainer(model=model, args=args, train_dataset=dataset,
                             max_tokens=4096, lr_rule="sqrt", base_batch_size=64)
    trainer.train()

``DuctileTrainer`` overrides two methods of ``transformers.Trainer`` and
nothing else:

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

The Trainer's own gradient accumulation and token-weighted loss
(``num_items_in_batch``) apply unchanged. ``trainer.train(resume_from_checkpoint=...)``
at the same world size continues with exactly the micro-batches, rates and
losses of an uninterrupted run: the sampler's packing is a function of its
seed and epoch, the Trainer skips the micro-batches the checkpoint had done,
and the scheduler's state is in the checkpoint (tests/python/test_hf_resume.py).
Resuming at another world size (an elastic re-form) is not the Trainer's:
its skip counts this rank's micro-batches; use ``DynamicBatchSampler.state_dict``
and ``load_state_dict`` in your own loop for that.
"""

import numpy as np
import torch
import transformers

from ._errors import InvalidArgumentError
from .torch import DynamicBatchSampler, FlattenCollate, VariableBatchLRScheduler

__all__ = ["DuctileTrainer"]

# args.lr_scheduler_type -> (base schedule, uses warm-up)
_SCHEDULES = {"constant": ("constant", False), "constant_with_warmup": ("constant", True),
              "linear": ("warmup_linear", True), "cosine": ("warmup_cosine", True)}


def _sample_length(sample):
    ids = sample["input_ids"] if isinstance(sample, dict) else sample
    return len(ids)


class _EpochDataLoader(torch.utils.data.DataLoader):
    """The Trainer stops taking micro-batches once an epoch's steps are done,
    before the sampler's iterator ends, and moves to the next epoch by
    calling the loader's set_epoch."""

    def set_epoch(self, epoch):
        self.batch_sampler.set_epoch(epoch)


class DuctileTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` on ductile's variable batches. Keyword
    arguments beyond the Trainer's:

    - ``max_tokens`` (required): the token budget of a micro-batch;
    - ``lengths``: one length per training sample (default: the length of
      each sample's ``input_ids``, read once);
    - ``lr_rule`` ("sqrt", "linear", "none" or another lr plugin) and
      ``base_batch_size`` (the batch size ``args.learning_rate`` is tuned
      for; required unless ``lr_rule="none"``);
    - ``order`` ("random", "seqlen", "dataloader") and any other keyword of
      ``DynamicBatchSampler`` as ``sampler_options``.
    """

    def __init__(self, *args, max_tokens, lengths=None, lr_rule="sqrt", base_batch_size=None,
                 order="random", sampler_options=None, **kwargs):
        if len(args) > 2:
            raise InvalidArgumentError(
                "DuctileTrainer: pass the Trainer's arguments after model and args by keyword "
                "(data_collator=..., train_dataset=...)")
        if kwargs.get("data_collator") is None:
            kwargs["data_collator"] = FlattenCollate()
        super().__init__(*args, **kwargs)
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
        self.ductile_sampler = DynamicBatchSampler(
            np.asarray(lengths, dtype=np.int64), max_tokens=max_tokens,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            rank=self.args.process_index, world_size=self.args.world_size, order=order,
            seed=self.args.seed, **(sampler_options or {}))
        self._lr_rule = lr_rule
        self._base_batch_size = 1.0 if base_batch_size is None else base_batch_size
        self._flatten = isinstance(self.data_collator, FlattenCollate)

    def get_train_dataloader(self):
        # Not through accelerator.prepare: the sampler already gives this
        # rank its own micro-batches, and sharding them again would lose some.
        return _EpochDataLoader(
            self.train_dataset, batch_sampler=self.ductile_sampler,
            collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory)

    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.lr_scheduler is None:
            schedule, warms_up = self._schedule
            warmup = self.args.get_warmup_steps(num_training_steps) if warms_up else 0
            self.lr_scheduler = VariableBatchLRScheduler(
                optimizer or self.optimizer, self.ductile_sampler, lr_rule=self._lr_rule,
                base_batch_size=self._base_batch_size, base_lr=self.args.learning_rate,
                schedule=schedule, warmup_steps=warmup,
                total_steps=max(num_training_steps, warmup + 1))
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._flatten:
            # transformers builds the per-sample mask of a flattened row only
            # without a cache (FlattenCollate's docstring).
            inputs = dict(inputs, use_cache=False)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)
