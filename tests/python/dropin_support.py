"""What the Trainer-shaped drop-in tests share (not a test by itself): a
DeepSpeed ZeRO-3 config of "auto" values as HF's examples give it, a
script's run on 2 ranks, the step records of a run's log history, and
where two runs or their saved models differ.

DeepSpeed's own runs have gloo groups of one worker thread
(ordered_gloo/sitecustomize.py says why): so run, DeepSpeed's side of a
script gives the same losses, rates, gradient norms and saved weights every
time, and each test runs it once and holds ductile's run to it.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from zero3_launch import torchrun_script

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


def script_result(script, args, rival=False):
    """`script args` on 2 ranks under torchrun (`rival`: DeepSpeed's run of
    the unchanged script): the one JSON line it prints that starts with
    '{"log"' (its log history and results), parsed."""
    out = torchrun_script(script, [str(a) for a in args], rival=rival)
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
