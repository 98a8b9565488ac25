"""Hugging Face Trainers on ductile's engine under ``ductile agent``
(DuctileTrainer, ductile.trl's trainers: InPlaceTrainer ahead of theirs):
training goes on from the step a round resumed from memory, in the same
process when the worker goes on in place.

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
  the epoch skipped as a resume from a checkpoint skips them, the random
  generators as they were at the end of the restored step (where such a
  resume loads its rng_state files), and the ``TrainerState`` kept (its log
  history up to the restored step).
- **Restarted** (a worker the agent started in a round that resumed from
  memory): the engine loads the snapshot when the Trainer makes it; the
  Trainer then enters its loop again at that step, as above (its
  ``TrainerState`` begins with that step: the log history of the steps
  before is in the old workers' output, not here).

Without the agent nothing here runs. What it needs: the Trainer on
ductile's ZeRO-3 engine (``args.deepspeed`` with stage 3, as
``ductile.deepspeed`` takes it), no ``model_init`` and no engine beside it
(TRL's DPO reference model: ``_in_place_refused``); a worker without them
takes back its readiness, and the agent restarts it (it then enters its
loop at the restored step as a restarted one). With ``max_tokens``,
each snapshot keeps where the data stands after its step (the sampler's
record, as a checkpoint's RESUME_FILE: ``engine.snapshot_client_state``):
the loop enters again there, the rest of the epoch packed again at the new
world size, and the learning-rate schedule planned again over the new
step count.
"""

import dataclasses
import logging
import os
import random
from typing import Any

import numpy as np
import torch
import transformers

from ._errors import IncompatibleError
from .torch.zero3._rejoin import RoundRejoined
from .torch.zero3._snapshots import RESTORE_ENV

_logger = logging.getLogger("ductile.hf")

# The checkpoint argument the Trainer's loop is given when it enters again
# in place: it skips the epoch's done micro-batches as for a checkpoint,
# and reads no file (InPlaceTrainer._load_rng_state).
IN_PLACE = "<ductile: the snapshot restored in memory>"


@dataclasses.dataclass
class Resume:
    """Where the Trainer's loop enters again: `step`, the snapshot's; the
    TrainerState of the loop it left (training_state keeps what it says of
    the steps up to `step`); the Accelerate wrapper of the engine, which the
    loop's free_memory() would destroy."""

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
        trainer._ductile_resume = Resume(restored, trainer.state, wrapped)
        _follow_world(accelerator)
        resume_from_checkpoint = None
        _logger.warning(
            f"{type(trainer).__name__}: rank {torch.distributed.get_rank()} of "
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
    from .deepspeed._engine import DeepSpeedEngine

    resume = trainer._ductile_resume
    if fresh:
        engine = trainer.model_wrapped
        if not isinstance(engine, DeepSpeedEngine):
            return model, train_dataloader
        engine.zero3.snapshot_client_state = lambda step: _client_state(trainer, step)
        recovery = recovery_of(trainer)
        if recovery is not None:
            _unwind(trainer, engine, recovery)
        restored = engine.zero3.restored_from_memory
        if restored is not None and resume is None:
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
    _restore_scheduler(trainer, engine)
    for attr in ("model", "optimizer", "lr_scheduler"):
        setattr(trainer.callback_handler, attr, getattr(trainer, attr))
    trainer.callback_handler.train_dataloader = train_dataloader
    return engine, train_dataloader


_CLIENT_FORMAT = "ductile.hf.InPlaceTrainer"


def _own_scheduler(trainer, engine):
    """The Trainer's scheduler when the Trainer steps it itself (a scheduler
    made for the Trainer's own optimizer: Accelerate does not give it to the
    engine), else None (the engine steps it and its snapshots keep it)."""
    scheduler = trainer.lr_scheduler
    if engine.zero3.lr_scheduler is not None or scheduler is None:
        return None
    return getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper, if any


def _client_state(trainer, step):
    """What each snapshot keeps of the Trainer: the state of a scheduler the
    Trainer steps itself (as the engine writes the snapshot inside its step,
    before the Trainer's scheduler.step() of that step) and
    `_snapshot_record(step)` (DuctileTrainer's sampler record), else None."""
    scheduler = _own_scheduler(trainer, trainer.model_wrapped)
    record = trainer._snapshot_record
    return {"format": _CLIENT_FORMAT, "version": 1,
            "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
            "data": None if record is None else record(step)}


def _restored_client_state(trainer):
    state = trainer.model_wrapped.zero3.restored_client_state
    if not isinstance(state, dict) or state.get("format") != _CLIENT_FORMAT or \
            state.get("version") != 1:
        raise IncompatibleError(
            f"{type(trainer).__name__}: the snapshot restored in memory does not say where the "
            f"Trainer stood (its client state is not a version 1 {_CLIENT_FORMAT} record): it "
            "was written by another script; restore it with the same script and arguments")
    return state


def _restore_scheduler(trainer, engine):
    """A scheduler the Trainer steps itself at the restored step: the
    snapshot's state (taken before that step's scheduler step), stepped."""
    scheduler = _own_scheduler(trainer, engine)
    if scheduler is None:
        return
    state = _restored_client_state(trainer)["lr_scheduler"]
    if state is None:
        raise IncompatibleError(
            f"{type(trainer).__name__}: the snapshot restored in memory holds no state of the "
            "learning-rate scheduler the Trainer steps: it was written by another script; "
            "restore it with the same script and arguments")
    scheduler.load_state_dict(state)
    scheduler.step()


def _unwind(trainer, engine, recovery):
    """Sets the engine's recovery to leave the Trainer's loop at a new
    round; takes back the worker's readiness when the Trainer cannot enter
    its loop again from memory."""
    from .torch.zero3 import _round_notice

    why = trainer._in_place_refused
    if trainer.model_init is not None:
        why = "model_init is set (train() makes a new model)"
    if why is not None:
        if not recovery.withdrawn:
            recovery.withdrawn = True
            _round_notice.withdraw_ready(recovery.watch.path)
            _logger.warning(f"{type(trainer).__name__}: {why}: at a lost node the agent "
                            "restarts this worker")
        return
    recovery.unwinds = True
    if trainer._step_rng is None:
        # The random generators at each step's end, for the loop that
        # enters again at a restored step: as a checkpoint's rng_state files.
        trainer._step_rng = _StepRng(2 * max(engine.zero3._snapshots.interval, 1) + 2)
        trainer.add_callback(trainer._step_rng)
    # The Trainer's arguments fix the micro-batch and the accumulation
    # steps; the global batch follows the world size.
    micro, accumulation = engine._micro_batch, engine._accumulation
    engine._replan = lambda world: (micro * accumulation * world, micro, accumulation)


class _StepRng(transformers.TrainerCallback):
    """The random generators' states (Python's, NumPy's, torch's and, once
    used, CUDA's) at the end of each of the last `keep` steps."""

    def __init__(self, keep):
        self.keep = keep
        self.states: dict[int, dict[str, Any]] = {}

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        taken = {"python": random.getstate(), "numpy": np.random.get_state(),
                 "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_initialized():
            taken["cuda"] = torch.cuda.random.get_rng_state_all()
        self.states[step] = taken
        for old in [s for s in self.states if s <= step - self.keep]:
            del self.states[old]

    def restore(self, step):
        """Sets the generators as they were at the end of `step`, when kept."""
        taken = self.states.get(step)
        if taken is None:
            return
        random.setstate(taken["python"])
        np.random.set_state(taken["numpy"])
        torch.random.set_rng_state(taken["cpu"])
        if "cuda" in taken:
            torch.cuda.random.set_rng_state_all(taken["cuda"])


def sampler_record_of(trainer):
    """The sampler's record (DuctileTrainer._sampler_record) in the snapshot
    restored."""
    record = _restored_client_state(trainer)["data"]
    if not isinstance(record, dict) or "sampler" not in record:
        raise IncompatibleError(
            "DuctileTrainer: the snapshot restored in memory does not say where the data stood "
            "(its client state holds no sampler record): it was written by a run without "
            "max_tokens; restore it with the same script and arguments")
    return record


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


class InPlaceTrainer:
    """The Trainer's methods that enter its training loop again at a
    restored step (a mixin ahead of ``transformers.Trainer``; see the
    module's docstring)."""

    # Where the loop enters again (None: from the start, or the checkpoint
    # given), and a callable of the step whose value each snapshot keeps
    # (DuctileTrainer's sampler record), or None.
    _ductile_resume: Resume | None = None
    _snapshot_record: Any = None
    # Why this Trainer cannot go on in place (its workers are restarted,
    # and enter their loop at the restored step), or None.
    _in_place_refused: str | None = None
    _step_rng: _StepRng | None = None

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None,
              **kwargs):
        self._ductile_resume = None
        return train(self, super().train, resume_from_checkpoint, trial,  # type: ignore[misc]
                     ignore_keys_for_eval, kwargs)

    def _inner_training_loop(self, batch_size=None, args=None, resume_from_checkpoint=None,
                             trial=None, ignore_keys_for_eval=None):
        if self._ductile_resume is not None:
            resume_from_checkpoint = IN_PLACE
        elif self.is_deepspeed_enabled and os.environ.get(RESTORE_ENV):  # type: ignore[attr-defined]
            # The round resumes from a snapshot in memory (ductile agent),
            # newer than any checkpoint on disk: the loop enters again at
            # its step once the engine loaded it.
            resume_from_checkpoint = None
        return super()._inner_training_loop(  # type: ignore[misc]
            batch_size=batch_size, args=args, resume_from_checkpoint=resume_from_checkpoint,
            trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs,
                             resume_from_checkpoint, trial):
        if self._ductile_resume is None:
            return super()._init_training_state(  # type: ignore[misc]
                max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                trial)
        epochs_trained, skipped = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial)
        return training_state(self, epochs_trained, skipped, num_update_steps_per_epoch)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self._ductile_resume is not None:  # the engine goes on: nothing to make or load
            return prepared(self, None, train_dataloader, fresh=False)
        model, train_dataloader = super()._prepare_for_training(  # type: ignore[misc]
            max_steps, train_dataloader, resume_from_checkpoint)
        return prepared(self, model, train_dataloader, fresh=True)

    def _load_rng_state(self, checkpoint):
        if checkpoint != IN_PLACE:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
        elif self._step_rng is not None and self._ductile_resume is not None:
            # Where a resume from a checkpoint of the step loads its files;
            # a worker that did not train that step goes on with its own.
            self._step_rng.restore(self._ductile_resume.step)
