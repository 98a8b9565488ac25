"""zero3's training-loop semantics and mixed precision on 2 ranks, under
torchrun and under mpirun, against plain torch on the whole batch
(zero3_training_worker.py runs the scenarios):

- gradient accumulation, both ways (every micro-batch reduce-scattered into
  the shards, or full gradients kept until the last with no_sync): the same
  losses and parameters as one big batch, and the reduce-scatters counted;
- clip_grad_norm_ returns the norm of the whole gradient, over every rank's
  shards, and clips as torch.nn.utils.clip_grad_norm_ does on the whole model;
- GatheredParameters(modifier_rank=0): rank 0's change reaches every shard;
- state_dict() is plain torch's state dict, key for key;
- fp16 from a DeepSpeed config: dynamic loss scaling skips overflowing
  steps and halves the scale, doubles it after its window;
- bf16 from a DeepSpeed config: bf16 shards (half the bytes), fp32 masters
  and fp32 Adam state."""

import os
import statistics
import sys

import pytest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_launch import launch  # noqa: E402
from zero3_model import Windows, loss_of, make_model  # noqa: E402
from zero3_training_worker import ACCUMULATION, CLIP, LR, MODEL, STEPS  # noqa: E402

SCENARIOS = ["accumulate", "accumulate_no_sync", "clip", "gathered", "state_dict", "fp16",
             "bf16_json"]
RANKS = 2


@pytest.fixture(scope="module", params=["torchrun", "mpirun"])
def job(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"training_{request.param}")
    result, _, _ = launch(tmp, "run", {"scenarios": SCENARIOS}, ranks=RANKS, launcher=request.param,
                          worker=os.path.join(HERE, "zero3_training_worker.py"), timeout=500)
    return request.param, tmp / "run", result


def plain(name, autocast=None):
    """Plain torch on the whole batch: (losses, norms, model). The accumulate
    scenarios sum the gradients of the ranks' micro-batches (RANKS x
    ACCUMULATION of them, rank-major, as the windows are cut): the same sums
    one big batch computes, in the order the job adds them. Summed in the big
    batch's order instead, Adam's near-zero elements move by up to 2.8 times
    the tolerance of assert_close_params on an AMD EPYC, in plain torch
    alone."""
    model = make_model(seed=0, **MODEL)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    windows = Windows(batch=4 * ACCUMULATION if name.startswith("accumulate") else 4,
                      context=MODEL["context"])
    losses, norms = [], []
    for s in range(STEPS):
        x, y = windows.step(s)
        if name.startswith("accumulate"):
            parts = RANKS * ACCUMULATION
            per = x.shape[0] // parts
            loss = torch.tensor(0.0)
            for m in range(parts):
                part = loss_of(model(x[m * per:(m + 1) * per]), y[m * per:(m + 1) * per]) / parts
                part.backward()
                loss += part.detach()
        else:
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = loss_of(model(x), y)
            loss.backward()
        if name == "clip":
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if name == "gathered" and s == 1:
            with torch.no_grad():
                model.ln_f.weight.fill_(0.5)
    return losses, norms, model


def relative(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def assert_close_params(got, model):
    """Within 1e-5 of each tensor's largest value, plus 0.2 % of one Adam
    step: Adam divides by the root of the squared gradient, so a gradient
    summed in another order (micro-batches, shards) moves its near-zero
    elements by a visible fraction of a step."""
    for name, ref in model.named_parameters():
        diff = (got[name] - ref.detach()).abs().max().item()
        assert diff <= 1e-5 * ref.abs().max().item() + 2e-3 * LR, f"{name}: {diff}"


def gradient_params():
    return len(list(make_model(seed=0, **MODEL).parameters()))  # the tied weight once


@pytest.mark.parametrize("name", ["accumulate", "accumulate_no_sync"])
def test_gradient_accumulation_equals_one_big_batch(job, name):
    launcher, out, result = job
    r = result[name]
    losses, _, model = plain(name)
    for s, (a, b) in enumerate(zip(r["losses"], losses)):
        assert relative(a, b) <= 1e-5, f"{name} step {s}: {a} vs {b}"
    assert_close_params(torch.load(out / f"{name}.pt"), model)
    n = gradient_params()
    # Each parameter group's gradients reduced once a micro-batch (with sync)
    # or once a step (no_sync), small groups sharing a reduce-scatter.
    if name == "accumulate":
        assert r["reduced_params"] == STEPS * ACCUMULATION * n
        assert r["reduced_groups"] == STEPS * ACCUMULATION * r["groups"]
        assert r["accumulated_grads"] == 0
    else:
        assert r["reduced_params"] == STEPS * n
        assert r["reduced_groups"] == STEPS * r["groups"]
        assert r["accumulated_grads"] == STEPS * (ACCUMULATION - 1) * n
    print(f"{launcher} {name}: {statistics.median(r['seconds']) * 1e3:.1f} ms per step of "
          f"{ACCUMULATION} micro-batches")


def test_clip_grad_norm_returns_the_global_norm_and_clips_like_torch(job):
    _, out, result = job
    r = result["clip"]
    losses, norms, model = plain("clip")
    assert len(r["norms"]) == STEPS
    for s, (a, b) in enumerate(zip(r["norms"], norms)):
        assert relative(a, b) <= 1e-5, f"step {s}: norm {a} vs torch's {b}"
        assert b > CLIP  # clipping was active
    for a, b in zip(r["losses"], losses):
        assert relative(a, b) <= 1e-5
    assert_close_params(torch.load(out / "clip.pt"), model)


def test_gathered_parameters_broadcast_the_modifier_ranks_change(job):
    _, out, result = job
    r = result["gathered"]
    assert r["gathered"] == [0.5] * MODEL["d"]
    losses, _, model = plain("gathered")
    for a, b in zip(r["losses"], losses):
        assert relative(a, b) <= 1e-5
    assert_close_params(torch.load(out / "gathered.pt"), model)


def test_state_dict_is_plain_torchs(job):
    _, out, result = job
    state = torch.load(out / "state_dict.pt")
    _, _, model = plain("state_dict")
    reference = model.state_dict()
    assert list(state) == list(reference)
    for key, value in reference.items():
        assert state[key].shape == value.shape and state[key].dtype == value.dtype, key
        diff = (state[key] - value).abs().max().item()
        assert diff <= 1e-5 * max(value.abs().max().item(), 1e-3), f"{key}: {diff}"
    assert torch.equal(state["head.weight"], state["embed.weight"])  # tied


def test_fp16_dynamic_loss_scaling_skips_overflows(job):
    r = job[2]["fp16"]
    scales = r["scales"]
    assert r["skipped"] >= 1
    # Each step: an overflow halves the scale (hysteresis 1), two good steps
    # in a row double it (window 2); the scale starts at 2^15.
    scale, good = 2.0 ** 15, 0
    overflowed = 0
    for s, after in enumerate(scales):
        if after == scale / 2:
            overflowed += 1
            good = 0
        else:
            good += 1
            expected = scale * 2 if good % 2 == 0 else scale
            assert after == expected, (s, scales)
        scale = after
    assert overflowed == r["skipped"]
    assert all(v == v and abs(v) != float("inf") for v in r["losses"][-2:]), r["losses"]
    assert r["optimizer_dtypes"] == ["torch.float32"]


def test_bf16_from_a_deepspeed_config_keeps_fp32_masters_and_state(job):
    r = job[2]["bf16_json"]
    model = make_model(seed=0, **MODEL)
    shard_numel = sum(-(-p.numel() // 2) for p in model.parameters())
    assert r["shard_bytes"] == 2 * shard_numel   # gathered in bf16
    assert r["master_bytes"] == 4 * shard_numel  # the optimizer's fp32 masters
    assert r["optimizer_dtypes"] == ["torch.float32"]
    losses, _, _ = plain("bf16_json", autocast=torch.bfloat16)
    worst = max(relative(a, b) for a, b in zip(r["losses"], losses))
    assert worst <= 2e-2, (r["losses"], losses)
