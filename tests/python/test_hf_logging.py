"""What a DuctileTrainer with packs logs (python/ductile/_hf_logging.py):
every training log has batch_samples, batch_tokens, tokens_per_second,
padding_fraction and lr_scale, equal to what the steps really trained and
the rates they ran with; training starts by drawing the epoch's batch plan
into output_dir. One process, a tiny Llama on the CPU."""

import math
import os
import sys

import matplotlib.image
import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

import ductile.batching
from ductile.hf import DuctileTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_models import tiny_model  # noqa: E402
from hf_trainer_worker import SAMPLES  # noqa: E402

DATA = SAMPLES[:120]
BASE_LR, BASE_BATCH, WARMUP = 1e-2, 8, 2
KEYS = ["batch_samples", "batch_tokens", "tokens_per_second", "padding_fraction", "lr_scale"]


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return len(DATA)

    def __getitem__(self, i):
        return {"input_ids": torch.tensor(DATA[i])}


def pad_collate(samples):
    """Pads each micro-batch to its longest sample (attention mask, labels
    -100 on the padding)."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, :len(s["input_ids"])] = s["input_ids"]
        mask[i, :len(s["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


class Trained(TrainerCallback):
    """Per optimizer step: the rate it ran with."""

    def __init__(self):
        self.lrs = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


class RecordingTrainer(DuctileTrainer):
    """Records what every micro-batch held, by the step it trained in:
    samples, their tokens and the positions the model ran."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = {}

    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self.state.global_step
        seen = self.steps.setdefault(step, {"samples": 0, "tokens": 0, "positions": 0})
        ids = inputs["input_ids"]
        if "attention_mask" in inputs:  # padded rows
            seen["samples"] += ids.shape[0]
            seen["tokens"] += int(inputs["attention_mask"].sum())
        else:  # one flattened row: each sample's positions start at 0
            seen["samples"] += int((inputs["position_ids"] == 0).sum())
            seen["tokens"] += ids.numel()
        seen["positions"] += ids.numel()
        return super().training_step(model, inputs, num_items_in_batch)


def train(tmp_path, logging_steps=1, collate=None):
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, num_train_epochs=2,
        learning_rate=BASE_LR, lr_scheduler_type="linear", warmup_steps=WARMUP,
        gradient_accumulation_steps=2, seed=5, logging_steps=logging_steps,
        save_strategy="no", report_to=[], disable_tqdm=True)
    trained = Trained()
    trainer = RecordingTrainer(model=tiny_model("llama", "sdpa"), args=args,
                               train_dataset=Samples(), data_collator=collate,
                               callbacks=[trained], max_tokens=96, lr_rule="sqrt",
                               base_batch_size=BASE_BATCH)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "learning_rate" in h]
    return trainer, trained.lrs, logs


def base_rate(step, total):
    """The base schedule's rate at a step (no batch-size scaling)."""
    schedule = ductile.batching.LrSchedule(
        ductile.batching.LrRule("none"), BASE_BATCH, [1], base_lr=BASE_LR,
        schedule="warmup_linear", warmup_steps=WARMUP, total_steps=total)
    return schedule.lr_at(step)


def assert_scaled(lr, base, scale):
    """lr = base x scale (warm-up starts at a base rate of 0)."""
    if base == 0:
        assert lr == 0
    else:
        assert lr / base == pytest.approx(scale, rel=1e-9)


def test_every_step_logs_what_it_trained_and_its_rate(tmp_path):
    trainer, lrs, logs = train(tmp_path)
    total = trainer.state.max_steps
    assert [h["step"] for h in logs] == list(range(1, total + 1))
    epochs = {int(h["epoch"] - 1e-9) for h in logs}
    assert epochs == {0, 1}, "the run crosses an epoch boundary"
    for h in logs:
        assert set(KEYS) <= set(h), h
        step = h["step"] - 1  # the step's index: it ran with lrs[step]
        seen = trainer.steps[step]
        assert h["batch_samples"] == seen["samples"]
        assert h["batch_tokens"] == seen["tokens"]
        assert h["padding_fraction"] == 0.0  # FlattenCollate: one row, no padding
        assert h["tokens_per_second"] > 0
        # The logged rate is the step's; it is the base schedule's times the
        # rule's factor for the step's real batch.
        assert h["learning_rate"] == pytest.approx(lrs[step], rel=1e-12)
        assert h["lr_scale"] == pytest.approx(math.sqrt(seen["samples"] / BASE_BATCH), rel=1e-12)
        assert_scaled(h["learning_rate"], base_rate(step, total), h["lr_scale"])
    assert len({h["batch_samples"] for h in logs}) > 1, "the packs' batches vary"


def test_an_interval_sums_its_steps_and_pads_are_counted(tmp_path):
    trainer, lrs, logs = train(tmp_path, logging_steps=3, collate=pad_collate)
    total = trainer.state.max_steps
    assert [h["step"] for h in logs] == list(range(3, total + 1, 3))
    previous = 0
    for h in logs:
        steps = range(previous, h["step"])
        seen = [trainer.steps[s] for s in steps]
        samples = sum(s["samples"] for s in seen)
        tokens = sum(s["tokens"] for s in seen)
        positions = sum(s["positions"] for s in seen)
        assert h["batch_samples"] == samples
        assert h["batch_tokens"] == tokens
        assert 0 < h["padding_fraction"] == pytest.approx(1 - tokens / positions, rel=1e-12)
        # lr_scale belongs to the interval's last step, whose rate is logged.
        last = h["step"] - 1
        assert h["learning_rate"] == pytest.approx(lrs[last], rel=1e-12)
        assert h["lr_scale"] == pytest.approx(
            math.sqrt(trainer.steps[last]["samples"] / BASE_BATCH), rel=1e-12)
        assert_scaled(h["learning_rate"], base_rate(last, total), h["lr_scale"])
        previous = h["step"]


def test_the_batch_plan_is_drawn_into_output_dir(tmp_path):
    trainer, _, _ = train(tmp_path, logging_steps=1000)
    path = tmp_path / "out" / "batch_plan.png"
    assert trainer._step_report.plot_path == str(path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
