"""A real training loop on CPU through ductile.torch: a small causal byte-level
transformer LM on the lines of a real text (tests/data/text/gpl-3.0.txt),
2 data-parallel ranks (torch.distributed, gloo, launched here as 2
processes), token-budget packing with sqrt LR scaling and warm-up.

Checks: each packed sample seen exactly once per epoch across the ranks;
every step's LR equals the C++ schedule; the loss falls; a run stopped at
step k and resumed from the state_dicts continues with identical batches,
LRs and losses."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import torch

from ductile import batching
from conftest import data

WORKER = os.path.join(os.path.dirname(__file__), "train_worker.py")
WORLD = 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out):
    os.makedirs(out, exist_ok=True)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), str(WORLD), str(port), str(out)],
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{outputs[r]}"
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(WORLD)]


def corpus_lengths():
    with open(data("text", "gpl-3.0.txt"), "rb") as f:
        lines = [line for line in f.read().split(b"\n") if line.strip()]
    return np.array([len(line) + 1 for line in lines], dtype=np.int64)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ranks = launch(tmp_path_factory.mktemp("training"))
    return ([r["full"] for r in ranks], [r["first"] for r in ranks],
            [r["second"] for r in ranks], ranks[0]["stop"])


def test_each_sample_seen_once_per_epoch_across_ranks(runs):
    full = runs[0]
    lengths = corpus_lengths()
    assert len(full[0]) == len(full[1])  # same number of steps on both ranks
    for epoch in (0, 1):
        seen = [i for rank in full for r in rank if r["epoch"] == epoch for i in r["ids"]]
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample was seen twice"
        plan = batching.pack(lengths, max_tokens=512, order="random", seed=7 + epoch,
                             effective_batch_size=WORLD, ranks=WORLD)
        assert sorted(seen) == sorted(plan.sample_ids.tolist())
        missing = set(range(len(lengths))) - set(seen)
        assert missing == set(plan.leftover_ids.tolist()) | set(plan.dropped_ids.tolist())
        assert len(missing) < len(lengths) // 50
        # Every micro-batch within the token budget, lengths as packed.
        for rank in full:
            for r in rank:
                if r["epoch"] == epoch:
                    assert sum(r["lengths"]) <= 512
                    assert r["lengths"] == lengths[r["ids"]].tolist()
    # The two epochs are shuffled differently (seed + epoch).
    assert [r["ids"] for r in full[0] if r["epoch"] == 0][:5] != \
        [r["ids"] for r in full[0] if r["epoch"] == 1][:5]


def test_every_lr_equals_the_cpp_schedule(runs):
    full = runs[0]
    lengths = corpus_lengths()
    plans = [batching.pack(lengths, max_tokens=512, order="random", seed=7 + e,
                           effective_batch_size=WORLD, ranks=WORLD, lr_rule="sqrt",
                           base_batch_size=16, base_lr=4e-3, schedule="warmup_linear",
                           warmup_steps=10, total_steps=200, min_lr=1e-4) for e in (0, 1)]
    sizes = plans[0].batch_sizes.tolist() + plans[1].batch_sizes.tolist()
    schedule = batching.LrSchedule(batching.LrRule("sqrt"), 16, sizes, schedule="warmup_linear",
                                   base_lr=4e-3, warmup_steps=10, total_steps=200, min_lr=1e-4)
    records = full[0]
    assert [r["step"] for r in records] == list(range(len(sizes)))
    for r in records:
        assert r["lr"] == full[1][r["step"]]["lr"]
        assert r["batch_size"] == sizes[r["step"]]
        assert r["lr"] == schedule.lr_at(r["step"])
    # Epoch 0 as pipeline::pack_plan computes it in one call.
    n0 = plans[0].step_count
    assert [r["lr"] for r in records[:n0]] == plans[0].lrs.tolist()
    # Warm-up, then scaled by sqrt(batch / 16): not constant.
    assert records[0]["lr"] < records[9]["lr"]
    assert len({round(r["lr"], 12) for r in records[10:]}) > 5


def test_loss_falls(runs):
    losses = [r["loss"] for r in runs[0][0]]
    assert losses[0] == pytest.approx(np.log(256), rel=0.1)
    assert np.mean(losses[-10:]) < 0.75 * np.mean(losses[:5]), losses


def test_stop_and_resume_reproduces_the_run(runs):
    full, first, second, k = runs
    for rank in range(WORLD):
        assert len(first[rank]) == k
        resumed = first[rank] + second[rank]
        assert [r["step"] for r in resumed] == [r["step"] for r in full[rank]]
        for a, b in zip(resumed, full[rank]):
            assert (a["ids"], a["lr"], a["loss"]) == (b["ids"], b["lr"], b["loss"]), a["step"]
