"""ductile.hf.DuctileTrainer: a Hugging Face Trainer run on 2 ranks under
torchrun (gloo, CPU) trains on ductile's packs (every sample once per epoch
across ranks) with ductile's variable-batch learning rates."""

import json
import os
import subprocess
import sys

import pytest
import torch

import ductile
from ductile.torch import DynamicBatchSampler, VariableBatchLRScheduler

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    # --standalone: torchrun's own rendezvous on a free port it picks.
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={WORLD}", os.path.join(HERE, "hf_trainer_worker.py"),
                          str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(WORLD)]


def reference_sampler():
    sys.path.insert(0, HERE)
    from hf_trainer_worker import SAMPLES, SETTINGS
    return DynamicBatchSampler([len(s) for s in SAMPLES], max_tokens=SETTINGS["max_tokens"],
                               gradient_accumulation_steps=SETTINGS["gradient_accumulation_steps"],
                               rank=0, world_size=WORLD, order="random",
                               seed=SETTINGS["seed"]), SETTINGS


def test_every_sample_is_trained_once_per_epoch_across_ranks(ranks):
    sampler, _ = reference_sampler()
    assert all(r["world_size"] == WORLD for r in ranks)
    steps = [len(sampler.batch_sizes(e)) for e in (0, 1)]
    # The Trainer plans epochs x the first epoch's steps; it runs that many,
    # or stops at the end of the second epoch when that comes first.
    assert ranks[0]["max_steps"] == 2 * steps[0]
    assert ranks[0]["steps"] == min(2 * steps[0], sum(steps))
    for epoch in (0, 1):
        seen = [i for r in ranks for e, i in r["seen"] if e == epoch]
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample was fetched twice"
        plan = sampler.plan(epoch)
        if epoch == 0 or ranks[0]["steps"] == sum(steps):
            assert sorted(seen) == sorted(plan.sample_ids.tolist())
        else:
            assert set(seen) < set(plan.sample_ids.tolist())


def test_the_learning_rates_are_ductiles(ranks):
    sampler, settings = reference_sampler()
    steps, total = ranks[0]["steps"], ranks[0]["max_steps"]
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=settings["learning_rate"])
    expected = VariableBatchLRScheduler(
        optimizer, sampler, lr_rule=settings["lr_rule"], base_batch_size=settings["base_batch_size"],
        schedule="warmup_linear", warmup_steps=settings["warmup_steps"], total_steps=total)
    want = [expected.lr_at(k)[0] for k in range(steps)]
    for r in ranks:
        assert r["lrs"] == pytest.approx(want, rel=1e-12, abs=0)
    # The rates follow each step's real batch size, not only the schedule:
    # rate / schedule = sqrt(batch size / base batch size).
    warmup = settings["warmup_steps"]
    sizes = list(sampler.batch_sizes(0)) + list(sampler.batch_sizes(1))
    for k in range(warmup, steps):
        schedule = settings["learning_rate"] * (1 - (k - warmup) / (total - warmup))
        scale = (sizes[k] / settings["base_batch_size"]) ** 0.5
        assert want[k] == pytest.approx(schedule * scale, rel=1e-9)
    assert len(set(sizes[:steps])) > 1


def test_the_loss_falls(ranks):
    losses = ranks[0]["losses"]
    assert len(losses) == ranks[0]["steps"]
    assert all(l == l for l in losses)  # no NaN
    # Counting sequences: from ln(97) = 4.57 towards the few next tokens a
    # sequence allows.
    assert losses[0] > 4.3
    assert max(losses[-3:]) < 0.8 * min(losses[:3])


def test_bad_settings_are_refused_by_name(tmp_path):
    from transformers import TrainingArguments
    from hf_models import tiny_model
    from ductile.hf import DuctileTrainer
    data = [{"input_ids": torch.tensor([1, 2, 3])}] * 4
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             lr_scheduler_type="polynomial")
    with pytest.raises(ductile.InvalidArgumentError,
                       match="args.lr_scheduler_type 'polynomial' has no variable-batch "
                             "schedule; valid: constant, constant_with_warmup, linear, cosine"):
        DuctileTrainer(model=tiny_model("llama", "sdpa"), args=args, train_dataset=data,
                       max_tokens=8, base_batch_size=4)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ductile.InvalidArgumentError, match="lr_rule 'sqrt' needs base_batch_size"):
        DuctileTrainer(model=tiny_model("llama", "sdpa"), args=args, train_dataset=data,
                       max_tokens=8)
