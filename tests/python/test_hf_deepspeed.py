"""The Hugging Face Trainer on ductile's ZeRO-3: a run_clm.py-shaped script
(hf_clm_script.py: GPT-2 from a config, a local text, a tokenizer trained
here, TrainingArguments(deepspeed=ds.json) with "auto" values, an AdamW and
a WarmupDecayLR from the config, gradient accumulation and clipping,
save_steps checkpoints, evaluation, save_model) runs on HF's DeepSpeed
integration as it is, and on ductile's engine with its Trainer import line
alone changed, 2 ranks under torchrun, in the same test. The losses, rates
and gradient norms of every step are equal, and so are a
resume_from_checkpoint's, the evaluation loss and the saved model.

DeepSpeed's side runs once, whole and resumed (dropin_support.py says why
that is enough)."""

import json
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import DATA  # noqa: E402
from dropin_support import (AUTO_CONFIG, assert_same_steps, script_result,  # noqa: E402
                            steps_of)
from zero3_launch import one_line_changed  # noqa: E402

SCRIPT = os.path.join(HERE, "hf_clm_script.py")
RIVAL_IMPORT = "from transformers import Trainer\n"
DUCTILE_IMPORT = "from ductile.hf import DuctileTrainer as Trainer\n"
TEXT = os.path.join(DATA, "text", "gpl-3.0.txt")

# No optimizer offload here: test_deepspeed_script.py has it.
CONFIG = dict(AUTO_CONFIG, train_batch_size="auto")


def run(script, config, output_dir, resume=None, rival=False):
    args = ["--train_file", TEXT, "--output_dir", output_dir, "--deepspeed", config]
    args += ["--resume_from_checkpoint", resume] if resume else []
    return script_result(script, args, rival=rival)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """For each of DeepSpeed and ductile: the whole run's result and output
    folder, and those of a run resumed from the whole run's checkpoint-10
    in a folder of its own."""
    tmp = tmp_path_factory.mktemp("hf_deepspeed")
    config = tmp / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    out = {}
    changed = one_line_changed(SCRIPT, RIVAL_IMPORT, DUCTILE_IMPORT, tmp)
    for name, script in (("deepspeed", SCRIPT), ("ductile", changed)):
        whole_dir, resumed_dir = tmp / name, tmp / (name + "-resumed")
        rival = name == "deepspeed"
        whole = run(script, str(config), str(whole_dir), rival=rival)
        shutil.copytree(whole_dir / "checkpoint-10", resumed_dir / "checkpoint-10")
        resumed = run(script, str(config), str(resumed_dir),
                      resume=str(resumed_dir / "checkpoint-10"), rival=rival)
        out[name] = {"whole": whole, "whole_dir": whole_dir, "resumed": resumed,
                     "resumed_dir": resumed_dir}
    return out


def model_of(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def after_checkpoint(result):
    """The steps trained after checkpoint-10 (a resumed run's log history
    starts with the checkpoint's)."""
    return [h for h in steps_of(result) if h["step"] > 10]


def assert_same_models(theirs, ours):
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5)


def test_training_matches_hf_deepspeed(runs):
    theirs, ours = runs["deepspeed"], runs["ductile"]
    assert len(steps_of(theirs["whole"])) == 20
    assert_same_steps(steps_of(theirs["whole"]), steps_of(ours["whole"]))
    assert ours["whole"]["eval_loss"] == pytest.approx(theirs["whole"]["eval_loss"], rel=1e-5)
    # The same files in the output folder: checkpoints, the model, its
    # config and the tokenizer.
    assert ours["whole"]["files"] == theirs["whole"]["files"]


def test_resume_from_checkpoint_matches(runs):
    theirs, ours = runs["deepspeed"], runs["ductile"]
    assert len(after_checkpoint(theirs["resumed"])) == 10
    assert_same_steps(after_checkpoint(theirs["resumed"]), after_checkpoint(ours["resumed"]))
    assert ours["resumed"]["train_loss"] == pytest.approx(theirs["resumed"]["train_loss"],
                                                          rel=1e-5)
    assert ours["resumed"]["eval_loss"] == pytest.approx(theirs["resumed"]["eval_loss"], rel=1e-5)
    # DeepSpeed's resumed run trains the steps its whole run trained.
    assert_same_steps(after_checkpoint(theirs["whole"]), after_checkpoint(theirs["resumed"]))
    # ductile's resumed run trains the steps its whole run trained.
    assert_same_steps(after_checkpoint(ours["whole"]), after_checkpoint(ours["resumed"]))
    assert ours["resumed"]["eval_loss"] == pytest.approx(ours["whole"]["eval_loss"], rel=1e-6)
    assert ours["resumed"]["files"] == theirs["resumed"]["files"]


def test_saved_model_matches(runs):
    theirs, ours = runs["deepspeed"], runs["ductile"]
    assert_same_models(model_of(theirs["whole_dir"] / "checkpoint-10"),
                       model_of(ours["whole_dir"] / "checkpoint-10"))
    for folder in ("checkpoint-20", "."):
        reference = model_of(theirs["whole_dir"] / folder)
        for run_dir in (theirs["resumed_dir"], ours["whole_dir"], ours["resumed_dir"]):
            assert_same_models(reference, model_of(run_dir / folder))
