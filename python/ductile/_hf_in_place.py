"""DuctileTrainer under ``ductile agent``: training goes on from the step a
round resumed from memory, in the same process when the worker goes on in
place.

The Trainer's loop holds the world size in many places (its DataLoader,
sharded by Accelerate; ``num_items_in_batch``, gathered over the ranks; its
loss, multiplied in place by the world size), so a step cannot be run again
micro-batch by micro-batch in a new world, as the zero3 engine does for a
plain loop. DuctileTrainer instead leaves its training loop and enters it
again, as a resume from a checkpoint does, from the step of the snapshot
restored:

- **In place** (the engine's Recovery with ``unwinds``): a collective that
  fails because a peer is gone (the engine's, or the Trainer's own: the
  gather of ``num_items_in_batch``, of the logged loss), a pause the agent
  asks for when a node joins, or a newer round's notice at a step's first
  forward, makes the engine rejoin the new round (the same engine, module,
  optimizer and scheduler, re-sharded and loaded from the snapshot) and the
  Trainer leave its loop. ``train()`` then sets Accelerate's world (process
  count and index) to the new round's and enters the loop again at the
  restored step: a new DataLoader over the new world, the Trainer's
  ``global_step`` the restored one, the micro-batches of the steps done in
  the epoch skipped as a resume from a checkpoint skips them, and the
  ``TrainerState`` kept (its log history up to the restored step).
- **Restarted** (a worker the agent started in a round that resumed from
  memory): the engine loads the snapshot when the Trainer makes it; the
  Trainer then enters its loop again at that step, as above (its
  ``TrainerState`` begins with that step: the log history of the steps
  before is in the old workers' output, not here).

Without the agent nothing here runs. What it needs: the Trainer on
ductile's ZeRO-3 engine (``args.deepspeed`` with stage 3, as
``ductile.deepspeed`` takes it), no ``model_init`` and no ``max_tokens`` (a
worker with either takes back its readiness, and the agent restarts it:
with ``max_tokens`` the sampler's position at the restored step is not in
the snapshot).
"""

import dataclasses
import logging
import os
from typing import Any

import torch

from .torch.zero3._rejoin import RoundRejoined

_logger = logging.getLogger("ductile.hf")

# The checkpoint argument the Trainer's loop is given when it enters again
# in place: it skips the epoch's done micro-batches as for a checkpoint,
# and reads no file (DuctileTrainer._load_rng_state).
IN_PLACE = "<ductile: the snapshot restored in memory>"


@dataclasses.dataclass
class Resume:
    """Where the Trainer's loop enters again: `step`, the snapshot's; the
    TrainerState of the loop it left (None: a fresh worker's); the
    Accelerate wrapper of the engine, which the loop's free_memory() would
    destroy."""

    step: int
    state: Any
    wrapped: Any


class _Restored(Exception):
    """The engine the Trainer just made was restored from memory at `step`."""

    def __init__(self, step):
        super().__init__(f"restored from the snapshot of step {step}")
        self.step = step


def recovery_of(trainer):
    """The zero3 engine's Recovery under the Trainer (None without the agent's
    notices, or before the engine exists)."""
    from .deepspeed._engine import DeepSpeedEngine

    engine = getattr(trainer, "model_wrapped", None)
    if not isinstance(engine, DeepSpeedEngine):
        return None
    return engine.zero3._recovery


def train(trainer, train_once, resume_from_checkpoint, trial, ignore_keys_for_eval, kwargs):
    """transformers' ``Trainer.train`` (`train_once`), entered again at the
    restored step each time the round changes under it."""
    while True:
        try:
            return train_once(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                              ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        except (RoundRejoined, _Restored) as left:
            restored = left.step
        except Exception as error:
            recovery = recovery_of(trainer)
            if recovery is None or not recovery.unwinds:
                raise
            restored = recovery.recover(error, "trainer")  # `error` again when not a lost peer
        accelerator = trainer.accelerator
        wrapped, accelerator.deepspeed_engine_wrapped = accelerator.deepspeed_engine_wrapped, None
        state = trainer._ductile_resume.state if trainer._ductile_resume is not None else None
        trainer._ductile_resume = Resume(restored, state if state is not None else trainer.state,
                                         wrapped)
        _follow_world(accelerator)
        resume_from_checkpoint = None
        _logger.warning(
            f"DuctileTrainer: rank {torch.distributed.get_rank()} of "
            f"{torch.distributed.get_world_size()} enters its training loop again at step "
            f"{restored}, the snapshot restored in memory")


def _follow_world(accelerator):
    """Accelerate's process count and index (which its DataLoaders, gathers
    and the Trainer's arguments read) from the round joined."""
    from accelerate.state import AcceleratorState, PartialState

    world = {"num_processes": torch.distributed.get_world_size(),
             "process_index": torch.distributed.get_rank(),
             "local_process_index": int(os.environ.get("LOCAL_RANK", "0"))}
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if shared:
            shared.update(world)
    gradients = accelerator.gradient_state
    for loader in list(gradients.dataloader_references):
        if loader is not None:  # the old world's, left mid-epoch
            gradients._remove_dataloader(loader)


def prepared(trainer, model, train_dataloader, fresh):
    """After `_prepare_for_training` made the engine (`fresh`) or, entering
    again, instead of it: the engine's recovery set to unwind, and the
    loop's objects those of the engine that goes on."""
    resume = trainer._ductile_resume
    recovery = recovery_of(trainer)
    if fresh:
        engine = trainer.model_wrapped
        if recovery is not None:
            _unwind(trainer, engine, recovery)
        restored = getattr(getattr(engine, "zero3", None), "restored_from_memory", None)
        if restored is not None and resume is None and trainer.ductile_sampler is None:
            raise _Restored(restored)
        return model, train_dataloader
    assert resume is not None  # entering again
    engine = trainer.model_wrapped
    accelerator = trainer.accelerator
    accelerator.deepspeed_engine_wrapped = resume.wrapped
    accelerator._models.append(engine)
    accelerator._optimizers.append(trainer.optimizer)
    accelerator._schedulers.append(trainer.lr_scheduler)
    trainer.deepspeed = engine
    if engine._next_batch is not None:
        engine._take_next_batch()  # the loop starts a step: the new world's sizes now
    for attr in ("model", "optimizer", "lr_scheduler"):
        setattr(trainer.callback_handler, attr, getattr(trainer, attr))
    trainer.callback_handler.train_dataloader = train_dataloader
    return engine, train_dataloader


def _unwind(trainer, engine, recovery):
    """Sets the engine's recovery to leave the Trainer's loop at a new
    round; takes back the worker's readiness when the Trainer cannot enter
    its loop again from memory."""
    from .torch.zero3 import _round_notice

    why = None
    if trainer.model_init is not None:
        why = "model_init is set (train() would make a new model)"
    elif trainer.ductile_sampler is not None:
        why = ("max_tokens is set (the sampler's position at the restored step is not in the "
               "snapshot)")
    if why is not None:
        if not recovery.withdrawn:
            recovery.withdrawn = True
            _round_notice.withdraw_ready(recovery.watch.path)
            _logger.warning(f"DuctileTrainer: {why}: at a lost node the agent restarts this "
                            "worker")
        return
    recovery.unwinds = True
    # The Trainer's arguments fix the micro-batch and the accumulation
    # steps; the global batch follows the world size.
    _, micro, accumulation = engine._train_batch_size, engine._micro_batch, engine._accumulation
    engine._replan = lambda world: (micro * accumulation * world, micro, accumulation)


def training_state(trainer, epochs_trained, skipped, num_update_steps_per_epoch):
    """`_init_training_state`'s result, entering again at the restored step:
    the kept TrainerState up to it, and the epoch and micro-batches done as
    a resume from a checkpoint of that step computes them."""
    resume = trainer._ductile_resume
    if resume is None:
        return epochs_trained, skipped
    step = resume.step
    fresh, kept = trainer.state, resume.state
    if kept is not fresh and kept is not None and kept.global_step >= step:
        for field in ("log_history", "total_flos", "num_input_tokens_seen", "best_metric",
                      "best_global_step", "best_model_checkpoint", "stateful_callbacks"):
            setattr(fresh, field, getattr(kept, field))
        fresh.log_history = [e for e in kept.log_history if e.get("step", 0) <= step]
    fresh.global_step = step
    epochs_trained = step // num_update_steps_per_epoch
    skipped = 0
    if not trainer.args.ignore_data_skip:
        skipped = (step % num_update_steps_per_epoch) * trainer.args.gradient_accumulation_steps
    fresh.epoch = float(epochs_trained)
    return epochs_trained, skipped

