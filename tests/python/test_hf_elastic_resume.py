"""ductile.hf.DuctileTrainer resumed from a Trainer checkpoint at another
world size (2 ranks under torchrun -> 1 process, and 1 -> 2) and with more
epochs: every sample of every epoch is fetched exactly once across the
stopped run and the resumed one (the few an epoch's packing leaves over, to
fill whole steps, are the packing's leftover_ids), the step plan and the
learning rates follow the re-planned sampler, and a resume whose data
settings changed is refused by name.

Also a worker: ``python test_hf_elastic_resume.py OUT TAG EPOCHS STOP_AT RESUME``
(under torchrun or alone) trains, and writes OUT/TAG_rank<r>.json.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import TrainingArguments

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_models import tiny_model  # noqa: E402
from hf_trainer_worker import (SAMPLES, SETTINGS, Recorded, StepRates, StopAt,  # noqa: E402
                               exit_rank)

import ductile  # noqa: E402
from ductile.hf import RESUME_FILE, DuctileTrainer  # noqa: E402
from ductile.torch import DynamicBatchSampler, VariableBatchLRScheduler  # noqa: E402

STOP = 3  # the checkpoint's step: in epoch 0 at either world size


def train(out, epochs, stop_at=None, resume=None, samples=SAMPLES, **changed):
    """A run of the Trainer on SAMPLES (in this process, or one rank of
    torchrun); `changed` overrides max_tokens or seed."""
    torch.set_num_threads(1)
    settings = dict(SETTINGS, **changed)
    distributed = "LOCAL_RANK" in os.environ
    args = TrainingArguments(
        output_dir=os.path.join(str(out), "trainer"), use_cpu=True, num_train_epochs=epochs,
        ddp_backend="gloo" if distributed else None, learning_rate=settings["learning_rate"],
        lr_scheduler_type="linear", warmup_steps=settings["warmup_steps"],
        gradient_accumulation_steps=settings["gradient_accumulation_steps"],
        seed=settings["seed"], logging_steps=1, save_strategy="no", report_to=[],
        disable_tqdm=True)
    dataset, rates = Recorded(), StepRates()
    callbacks = [rates] + ([StopAt(stop_at)] if stop_at else [])
    trainer = DuctileTrainer(model=tiny_model("llama", "sdpa"), args=args,
                             train_dataset=_Subset(dataset, len(samples)), callbacks=callbacks,
                             lengths=[len(s) for s in samples],
                             max_tokens=settings["max_tokens"], lr_rule=settings["lr_rule"],
                             base_batch_size=settings["base_batch_size"])
    dataset.epoch = lambda: trainer.ductile_sampler.epoch
    trainer.train(resume_from_checkpoint=resume)
    sampler = trainer.ductile_sampler
    first = sampler.resume_epoch
    # What each epoch's packing (after a resume: the re-packing of the rest
    # of the resumed epoch) leaves over or drops.
    unpacked = {e: sorted(sampler.plan(e).leftover_ids.tolist()
                          + sampler.plan(e).dropped_ids.tolist()) for e in range(first, epochs)}
    return {"seen": dataset.seen, "lrs": rates.lrs, "steps": trainer.state.global_step,
            "max_steps": trainer.state.max_steps, "epoch": trainer.state.epoch,
            "world_size": args.world_size, "unpacked": unpacked,
            "first_steps": [sampler.first_step(e) for e in range(first, epochs + 1)]}


class _Subset(torch.utils.data.Dataset):
    """The first `count` samples of a Recorded dataset."""

    def __init__(self, recorded, count):
        self.recorded, self.count = recorded, count

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        return self.recorded[i]


def torchrun(out, tag, epochs, stop_at=0, resume=""):
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", os.path.abspath(__file__), str(out), tag,
                          str(epochs), str(stop_at), resume], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:]
    return [json.load(open(os.path.join(out, f"{tag}_rank{r}.json"))) for r in range(2)]


def seen_by_epoch(records):
    """epoch -> sample indices fetched in it, over every record."""
    seen = {}
    for record in records:
        for epoch, i in record["seen"]:
            seen.setdefault(epoch, []).append(i)
    return seen


def assert_every_sample_once(records, epochs):
    """Over the records of a stopped run and of its resumed one, in order."""
    seen = seen_by_epoch(records)
    assert sorted(seen) == list(range(epochs))
    unpacked = {}  # the last packing of each epoch: the resumed run's re-packing
    for record in records:
        unpacked.update({int(e): ids for e, ids in record["unpacked"].items()})
    for epoch in range(epochs):
        fetched = seen[epoch]
        assert len(fetched) == len(set(fetched)), f"epoch {epoch}: a sample was fetched twice"
        left = unpacked[epoch]
        # Every sample is fetched, or its packing reports it (at most a
        # step's worth, trimmed to whole steps; none dropped here).
        assert not set(fetched) & set(left)
        assert sorted(fetched + left) == list(range(len(SAMPLES))), f"epoch {epoch}"
        assert len(left) < len(SAMPLES) // 20


def reference_rates(checkpoint, world_size, total_steps, steps):
    """The rates of steps `steps` at `world_size` after resuming from the
    checkpoint's sampler state: the schedule planned over `total_steps`."""
    state = json.load(open(os.path.join(checkpoint, RESUME_FILE)))["sampler"]
    sampler = DynamicBatchSampler([len(s) for s in SAMPLES], max_tokens=SETTINGS["max_tokens"],
                                  gradient_accumulation_steps=SETTINGS[
                                      "gradient_accumulation_steps"],
                                  rank=0, world_size=world_size, seed=SETTINGS["seed"])
    sampler.load_state_dict(state)
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=SETTINGS["learning_rate"])
    scheduler = VariableBatchLRScheduler(
        optimizer, sampler, lr_rule=SETTINGS["lr_rule"],
        base_batch_size=SETTINGS["base_batch_size"], schedule="warmup_linear",
        warmup_steps=SETTINGS["warmup_steps"], total_steps=total_steps)
    return [scheduler.lr_at(k)[0] for k in steps], sampler


def test_two_ranks_resumed_in_one_process_see_every_sample_once(tmp_path):
    stopped = torchrun(tmp_path, "two", epochs=2, stop_at=STOP)
    assert [r["steps"] for r in stopped] == [STOP, STOP]
    checkpoint = tmp_path / "trainer" / f"checkpoint-{STOP}"
    resumed = train(tmp_path, epochs=2, resume=str(checkpoint))
    assert resumed["world_size"] == 1
    assert_every_sample_once(stopped + [resumed], epochs=2)
    # The plan is the re-planned sampler's: the rest of epoch 0 re-packed
    # for 1 rank, then epoch 1 whole; the rates follow it.
    want, sampler = reference_rates(checkpoint, 1, resumed["max_steps"],
                                    range(STOP, resumed["max_steps"]))
    assert resumed["max_steps"] == sampler.first_step(2) == resumed["steps"]
    assert resumed["first_steps"] == [sampler.first_step(0), sampler.first_step(1),
                                      sampler.first_step(2)]
    assert resumed["lrs"] == pytest.approx(want, rel=1e-12, abs=0)
    assert resumed["epoch"] == pytest.approx(2.0)


def test_one_process_resumed_on_two_ranks_sees_every_sample_once(tmp_path):
    stopped = train(tmp_path, epochs=2, stop_at=STOP)
    assert stopped["steps"] == STOP
    checkpoint = tmp_path / "trainer" / f"checkpoint-{STOP}"
    resumed = torchrun(tmp_path, "resumed", epochs=2, resume=str(checkpoint))
    assert [r["world_size"] for r in resumed] == [2, 2]
    assert resumed[0]["unpacked"] == resumed[1]["unpacked"]
    assert_every_sample_once([stopped] + resumed, epochs=2)
    want, sampler = reference_rates(checkpoint, 2, resumed[0]["max_steps"],
                                    range(STOP, resumed[0]["max_steps"]))
    for r in resumed:
        assert r["steps"] == r["max_steps"] == sampler.first_step(2)
        assert r["lrs"] == pytest.approx(want, rel=1e-12, abs=0)


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
    """A whole 2-epoch run in one process, checkpointed at its last step."""
    out = tmp_path_factory.mktemp("longer")
    sampler = DynamicBatchSampler([len(s) for s in SAMPLES], max_tokens=SETTINGS["max_tokens"],
                                  gradient_accumulation_steps=SETTINGS[
                                      "gradient_accumulation_steps"],
                                  rank=0, world_size=1, seed=SETTINGS["seed"])
    last = sampler.first_step(2)
    record = train(out, epochs=2, stop_at=last)
    assert record["steps"] == record["max_steps"] == last
    return out, record, out / "trainer" / f"checkpoint-{last}"


def test_more_epochs_continue_with_every_sample_of_the_new_one(two_epochs):
    out, first, checkpoint = two_epochs
    resumed = train(out, epochs=3, resume=str(checkpoint))
    assert_every_sample_once([first, resumed], epochs=3)
    assert {e for e, _ in resumed["seen"]} == {2}
    assert resumed["steps"] == resumed["max_steps"] == resumed["first_steps"][-1]
    want, _ = reference_rates(checkpoint, 1, resumed["max_steps"],
                              range(first["steps"], resumed["max_steps"]))
    assert resumed["lrs"] == pytest.approx(want, rel=1e-12, abs=0)
    assert resumed["lrs"][0] > 0  # the decay goes on over the new epoch


@pytest.mark.parametrize("changed, saved, new", [
    ({"max_tokens": 128}, SETTINGS["max_tokens"], 128),
    ({"seed": 6}, SETTINGS["seed"], 6),
    ({"samples": SAMPLES[:200]}, len(SAMPLES), 200),
])
def test_a_resume_with_other_data_settings_is_refused_by_name(two_epochs, changed, saved, new):
    out, _, checkpoint = two_epochs
    name = {"max_tokens": "max_tokens", "seed": "args.seed",
            "samples": "train_dataset samples"}[next(iter(changed))]
    with pytest.raises(ductile.IncompatibleError,
                       match=f"saved with {name} = {saved}, this run has {new}: "):
        train(out, epochs=3, resume=str(checkpoint), **changed)


def test_a_resume_that_would_not_train_or_cannot_know_its_data_is_refused(two_epochs, tmp_path):
    out, first, checkpoint = two_epochs
    with pytest.raises(ductile.IncompatibleError,
                       match=rf"args.num_train_epochs 1 \(\d+ steps\) ends at or before the "
                             rf"checkpoint, which has run {first['steps']} steps"):
        train(out, epochs=1, resume=str(checkpoint))
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(checkpoint):
        if name != RESUME_FILE:
            os.symlink(checkpoint / name, bare / name)
    with pytest.raises(ductile.IncompatibleError, match=f"has no {RESUME_FILE}"):
        train(out, epochs=3, resume=str(bare))


def main():
    out, tag, epochs, stop_at, resume = sys.argv[1:6]
    record = train(out, int(epochs), stop_at=int(stop_at) or None, resume=resume or None)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"{tag}_rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
    exit_rank()
