"""What the Trainer-shaped drop-in tests share (not a test by itself): a
DeepSpeed ZeRO-3 config of "auto" values as HF's examples give it, the
step records of a run's log history, where two runs differ, and DeepSpeed's
run held to ours.

DeepSpeed's side of these scripts is not repeatable on the CPU, most of
all under load: the models its zero.Init builds differ from run to run
(first losses of 5.393159, 5.371468, 0.0 and 5.390567 for one command
whose ductile runs all gave 5.390567). So DeepSpeed's side is run until
one of its runs equals ours in every step (a match of every loss, rate and
gradient norm to 1e-5 is no coincidence), and the test fails, saying
whether two of DeepSpeed's runs agreed with each other, when none does.
Nor are its saves: after a run whose every step equalled ours had written
its last checkpoint (whose model.safetensors held our weights), its
save_model in the same process wrote, in 2 of 3 such runs, a LayerNorm
weight whose second half (rank 1's part) held zeros, denormals and -1.7e38.
So a run's saved model is compared where DeepSpeed wrote it first, and a
DeepSpeed run may be held to ours in such a model too.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from zero3_launch import torchrun_script

DEEPSPEED_RUNS = 4

AUTO_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
}


def script_result(script, args):
    """`script args` on 2 ranks under torchrun: the one JSON line it prints
    that starts with '{"log"' (its log history and results), parsed."""
    out = torchrun_script(script, [str(a) for a in args])
    lines = [line for line in out.splitlines() if line.startswith('{"log"')]
    assert len(lines) == 1, out[-3000:]
    return json.loads(lines[0])


def steps_of(result, after=0):
    """The training steps of a run's log history after step `after`."""
    return [h for h in result["log"] if "loss" in h and "step" in h and h["step"] > after]


def differs(a, b):
    """Where run `b` differs from run `a` (each step's loss, rate and
    gradient norm; the evaluation loss when both have one), or None."""
    if [h["step"] for h in steps_of(a)] != [h["step"] for h in steps_of(b)]:
        return f"steps {[h['step'] for h in steps_of(b)]}"
    for x, y in zip(steps_of(a), steps_of(b)):
        if not (y["loss"] == pytest.approx(x["loss"], rel=1e-5)
                and y["learning_rate"] == pytest.approx(x["learning_rate"], rel=1e-9)
                and y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)):
            return f"step {y['step']}: {y} against {x}"
    if "eval_loss" in a and "eval_loss" in b and \
            b["eval_loss"] != pytest.approx(a["eval_loss"], rel=1e-5):
        return f"evaluation {b['eval_loss']} against {a['eval_loss']}"
    return None


def assert_same_steps(theirs, ours):
    """Two runs' step records are equal: loss to 1e-5, rate to 1e-9,
    gradient norm to 1e-4."""
    problem = differs({"log": theirs}, {"log": ours})
    assert problem is None, problem


def rival_run_like(ours, run_rival, what, model_in=None):
    """DeepSpeed's run that equals `ours`: run_rival(i) makes DeepSpeed's
    i-th run (its result), at most DEEPSPEED_RUNS times. With `model_in` (a
    folder in each run's output folder, results with a "dir": that output
    folder) the model saved there must equal ours too."""
    def unlike(a, b):
        return differs(a, b) or (models_differ(a["dir"] / model_in, b["dir"] / model_in)
                                 if model_in is not None else None)

    done = []
    for i in range(DEEPSPEED_RUNS):
        theirs = run_rival(i)
        if unlike(theirs, ours) is None:
            return theirs
        done.append(theirs)
    agreeing = [(i, j) for i in range(len(done)) for j in range(i + 1, len(done))
                if unlike(done[i], done[j]) is None]
    pytest.fail(f"{what}: none of DeepSpeed's {DEEPSPEED_RUNS} runs equals ductile's ("
                + "; ".join(unlike(r, ours) or "" for r in done)
                + f"); DeepSpeed's runs that agree with each other: {agreeing or 'none'}")


def models_differ(theirs_dir, ours_dir):
    """Where the model.safetensors of two output folders differ (rtol 1e-4),
    or None."""
    theirs = load_file(os.path.join(theirs_dir, "model.safetensors"))
    ours = load_file(os.path.join(ours_dir, "model.safetensors"))
    if sorted(ours) != sorted(theirs):
        return f"model keys {sorted(ours)} against {sorted(theirs)}"
    for key in theirs:
        try:
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5)
        except AssertionError as error:
            return f"model {key}: {error}"
    return None


def assert_same_models(theirs_dir, ours_dir):
    """The model.safetensors of two output folders hold the same weights."""
    unlike = models_differ(theirs_dir, ours_dir)
    assert unlike is None, unlike
