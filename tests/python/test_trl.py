"""TRL's trainers on ductile's ZeRO-3 with one line changed: an SFT script
(the model as a path string), a DPO script (the model as an object made by
from_pretrained; TRL loads and prepares the reference model itself) and a
reward-model script run on TRL's DeepSpeed integration as they are, and
with their trainer's import line alone changed to ``from ductile.trl
import ...``, 2 ranks under torchrun, in the same test. Every step's loss,
rate and gradient norm are DeepSpeed's; SFT and DPO save checkpoints at
steps 3 and 6 whose models are DeepSpeed's, a run resumed from step 3
trains the same steps 4-6, and the model save_model writes at the end is
DeepSpeed's and loads with from_pretrained. DeepSpeed's side runs once
(dropin_support.py says why that is enough).
"""

import json
import math
import os
import shutil
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import DATA  # noqa: E402
from hf_clm_script import build_tokenizer  # noqa: E402
from dropin_support import (AUTO_CONFIG, assert_same_models, assert_same_steps,  # noqa: E402
                            differs, script_result, steps_of)
from zero3_launch import one_line_changed  # noqa: E402

TEXT = os.path.join(DATA, "text", "gpl-3.0.txt")
SCRIPTS = {"sft": ("trl_sft_script.py", "SFTTrainer"), "dpo": ("trl_dpo_script.py", "DPOTrainer"),
           "reward": ("trl_reward_script.py", "RewardTrainer")}
LAST = "checkpoint-6"  # the SFT and DPO scripts' last step and checkpoint


class Runs:
    def __init__(self, tmp):
        self.tmp = tmp
        tokenizer = build_tokenizer(TEXT)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(
            vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
            pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id))
        self.model = tmp / "model"
        model.save_pretrained(self.model)
        tokenizer.pad_token = tokenizer.eos_token
        tokenizer.save_pretrained(self.model)
        self.config = tmp / "ds.json"
        self.config.write_text(json.dumps(AUTO_CONFIG))

    def run(self, script, out, resume=None, rival=False):
        args = [self.model, TEXT, out, self.config] + ([resume] if resume else [])
        return dict(script_result(script, args, rival=rival), dir=out)

    def compared(self, kind):
        """The changed script, ductile's run of `kind` and DeepSpeed's."""
        name, trainer = SCRIPTS[kind]
        script = os.path.join(HERE, name)
        changed = one_line_changed(script, f"from trl import {trainer}\n",
                                   f"from ductile.trl import {trainer}\n", self.tmp)
        ours = self.run(changed, self.tmp / f"ductile-{kind}")
        theirs = self.run(script, self.tmp / f"deepspeed-{kind}", rival=True)
        return changed, ours, theirs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("trl"))


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trains_saves_and_resumes_as_deepspeed(runs, kind):
    changed, ours, theirs = runs.compared(kind)
    assert len(steps_of(ours)) == 6
    if kind == "dpo":
        # The policy starts as its reference: the first loss is ln 2.
        assert steps_of(ours)[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert len(steps_of(theirs)) == 6
    assert_same_steps(steps_of(theirs), steps_of(ours))
    assert ours["files"] == theirs["files"]
    for checkpoint in ("checkpoint-3", LAST):
        assert_same_models(theirs["dir"] / checkpoint, ours["dir"] / checkpoint)
    assert_same_models(theirs["dir"], ours["dir"])
    _, info = AutoModelForCausalLM.from_pretrained(ours["dir"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # Resumed from step 3 in a new process: the same steps 4-6.
    resumed_dir = runs.tmp / f"ductile-{kind}-resumed"
    shutil.copytree(ours["dir"] / "checkpoint-3", resumed_dir / "checkpoint-3")
    resumed = runs.run(changed, resumed_dir, resume=resumed_dir / "checkpoint-3")
    assert_same_steps(steps_of(ours, after=3), steps_of(resumed, after=3))
    assert_same_models(ours["dir"], resumed_dir)


def test_reward_trainer_trains(runs):
    """RewardTrainer (the model as a path string: a sequence classifier whose
    score head transformers initialises through GatheredParameters) trains
    on ductile, finite losses and rewards that move, as on DeepSpeed."""
    name, trainer = SCRIPTS["reward"]
    script = os.path.join(HERE, name)
    changed = one_line_changed(script, f"from trl import {trainer}\n",
                               f"from ductile.trl import {trainer}\n", runs.tmp)
    ours = runs.run(changed, runs.tmp / "ductile-reward")
    steps = steps_of(ours)
    assert len(steps) == 4
    for step in steps:
        assert step["loss"] > 0 and step["loss"] == step["loss"], step
        assert step["mean_reward"] == step["mean_reward"], step
    assert steps[-1]["loss"] != steps[0]["loss"]
    theirs = runs.run(script, runs.tmp / "deepspeed-reward", rival=True)
    assert len(steps_of(theirs)) == 4
    assert differs(theirs, ours) is None, differs(theirs, ours)
