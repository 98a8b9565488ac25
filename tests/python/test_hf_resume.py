"""ductile.hf.DuctileTrainer resumed from a Trainer checkpoint (one process,
no torch.distributed): the resumed run fetches exactly the samples, and runs
exactly the learning rates and losses, that the uninterrupted run had after
the checkpoint's step."""

import os
import sys

import pytest
import torch
from transformers import TrainingArguments

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_models import tiny_model  # noqa: E402
from hf_trainer_worker import SAMPLES, SETTINGS, Recorded, StepRates, StopAt  # noqa: E402

from ductile.hf import DuctileTrainer  # noqa: E402


def train(out, stop_at=None, resume=None):
    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=str(out), use_cpu=True, num_train_epochs=2,
        learning_rate=SETTINGS["learning_rate"], lr_scheduler_type="linear",
        warmup_steps=SETTINGS["warmup_steps"],
        gradient_accumulation_steps=SETTINGS["gradient_accumulation_steps"], seed=SETTINGS["seed"],
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
    dataset, rates = Recorded(), StepRates()
    callbacks = [rates] + ([StopAt(stop_at)] if stop_at else [])
    trainer = DuctileTrainer(model=tiny_model("llama", "sdpa"), args=args, train_dataset=dataset,
                             callbacks=callbacks, lengths=[len(s) for s in SAMPLES],
                             max_tokens=SETTINGS["max_tokens"], lr_rule=SETTINGS["lr_rule"],
                             base_batch_size=SETTINGS["base_batch_size"])
    dataset.epoch = lambda: trainer.ductile_sampler.epoch
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "step" in h]
    return dataset.seen, rates.lrs, losses, trainer


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    seen, lrs, losses, trainer = train(tmp_path_factory.mktemp("whole"))
    steps_of_epoch0 = len(trainer.ductile_sampler.batch_sizes(0))
    return seen, lrs, losses, steps_of_epoch0


@pytest.mark.parametrize("where", ["in the first epoch", "in the second epoch"])
def test_a_resumed_trainer_continues_with_the_same_samples_and_rates(whole_run, tmp_path, where):
    seen, lrs, losses, steps_of_epoch0 = whole_run
    stop = 3 if where == "in the first epoch" else steps_of_epoch0 + 2
    first_seen, first_lrs, first_losses, _ = train(tmp_path, stop_at=stop)
    assert len(first_lrs) == stop
    checkpoint = tmp_path / f"checkpoint-{stop}"
    assert checkpoint.is_dir()
    rest_seen, rest_lrs, rest_losses, trainer = train(tmp_path, resume=str(checkpoint))
    assert first_seen + rest_seen == seen
    assert first_lrs + rest_lrs == pytest.approx(lrs, rel=1e-12, abs=0)
    # The log history of the resumed run holds the first run's losses too.
    assert rest_losses == pytest.approx(losses, rel=1e-4)
    assert trainer.state.global_step == len(lrs)
