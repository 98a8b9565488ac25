"""A training loop on Hugging Face Accelerate moves to ductile's ZeRO-3 by
changing its Accelerator import line alone: accelerate_loop_script.py (in
the shape of transformers' run_clm_no_trainer.py: a DeepSpeedPlugin from a
ZeRO-3 config, a GPT-2 from AutoModelForCausalLM.from_config, AdamW and a
linear schedule through prepare, accumulate, backward, clip_grad_norm_,
save_state, load_state, and save_pretrained with get_state_dict) runs on
DeepSpeed's engine as it is, and on ductile's with the line changed, 2
ranks under torchrun, in the same test. The losses of all 24 micro-batches
and the rates and gradient norms of all 12 steps are equal; a run resumed
from step 6's save_state in a new process trains steps 7-12 as the whole
run does; the models saved at the end load with from_pretrained and are
equal.

DeepSpeed's side runs once (dropin_support.py says why that is enough),
and ductile's resumed run is held to its whole run and to DeepSpeed's."""

import json
import os
import shutil
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import DATA  # noqa: E402
from zero3_launch import one_line_changed, torchrun_script  # noqa: E402

SCRIPT = os.path.join(HERE, "accelerate_loop_script.py")
RIVAL_IMPORT = "from accelerate import Accelerator\n"
DUCTILE_IMPORT = "from ductile.accelerate import Accelerator\n"
TEXT = os.path.join(DATA, "text", "gpl-3.0.txt")
STEPS, SAVED_AT, ACCUMULATION = 12, 6, 2

# train_batch_size is left to Accelerate (micro-batch x accumulation x
# world size). No optimizer or scheduler: the script's AdamW and linear
# schedule are used.
CONFIG = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUMULATION,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
}


def run(script, config, output_dir, resume=None, rival=False):
    """The script on 2 ranks (`rival`: DeepSpeed's run of it as it is):
    rank 0's {"losses": [...], "steps": [...]}."""
    args = ["--train_file", TEXT, "--output_dir", str(output_dir), "--deepspeed_config",
            str(config), "--max_train_steps", str(STEPS), "--checkpointing_steps", str(SAVED_AT)]
    out = torchrun_script(script, args + (["--resume_from_checkpoint", str(resume)]
                                          if resume else []), rival=rival)
    lines = [line for line in out.splitlines() if line.startswith('{"losses"')]
    assert len(lines) == 1, out[-3000:]
    return json.loads(lines[0])


def differences(theirs, ours):
    """Where `ours` differs from `theirs` (the losses of the same
    micro-batches, the same steps' rates and gradient norms): a message,
    or None."""
    if [s["step"] for s in ours["steps"]] != [s["step"] for s in theirs["steps"]]:
        return f"steps {ours['steps']} against {theirs['steps']}"
    if len(ours["losses"]) != len(theirs["losses"]):
        return f"{len(ours['losses'])} losses against {len(theirs['losses'])}"
    for i, (a, b) in enumerate(zip(theirs["losses"], ours["losses"])):
        if b != pytest.approx(a, rel=1e-5):
            return f"loss of micro-batch {i}: {b} against {a}"
    for a, b in zip(theirs["steps"], ours["steps"]):
        if b["lr"] != pytest.approx(a["lr"], rel=1e-9, abs=1e-15) \
                or b["grad_norm"] != pytest.approx(a["grad_norm"], rel=1e-4):
            return f"step {b} against {a}"
    return None


def after(result, step):
    """The part of a run's record after optimizer step `step`."""
    steps = [s for s in result["steps"] if s["step"] > step]
    return {"steps": steps, "losses": result["losses"][-len(steps) * ACCUMULATION:]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ductile's whole run, its run resumed from the whole run's step-6
    state in a folder of its own, and DeepSpeed's whole run, with their
    output folders."""
    tmp = tmp_path_factory.mktemp("accelerate")
    config = tmp / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    changed = one_line_changed(SCRIPT, RIVAL_IMPORT, DUCTILE_IMPORT, tmp)
    out = {"ductile_dir": tmp / "ductile", "resumed_dir": tmp / "ductile-resumed"}
    out["ductile"] = run(changed, config, out["ductile_dir"])
    state = f"step_{SAVED_AT}"
    shutil.copytree(out["ductile_dir"] / state, out["resumed_dir"] / state)
    out["resumed"] = run(changed, config, out["resumed_dir"], resume=out["resumed_dir"] / state)
    out["deepspeed_dir"] = tmp / "deepspeed"
    out["deepspeed"] = run(SCRIPT, config, out["deepspeed_dir"], rival=True)
    return out


def test_training_matches_deepspeed(runs):
    theirs, ours = runs["deepspeed"], runs["ductile"]
    assert [s["step"] for s in theirs["steps"]] == list(range(1, STEPS + 1))
    assert len(theirs["losses"]) == STEPS * ACCUMULATION
    assert differences(theirs, ours) is None, differences(theirs, ours)
    # The schedule and the clipping really acted: warm-up then decay to 0,
    # gradient norms above the clipping threshold.
    rates = [s["lr"] for s in theirs["steps"]]
    assert rates[0] < rates[2] and rates[-1] == 0.0
    assert all(s["grad_norm"] > 1.0 for s in theirs["steps"])


def test_resumed_run_matches_whole_run(runs):
    resumed = runs["resumed"]
    assert [s["step"] for s in resumed["steps"]] == list(range(SAVED_AT + 1, STEPS + 1))
    assert len(resumed["losses"]) == (STEPS - SAVED_AT) * ACCUMULATION
    for whole in (runs["ductile"], runs["deepspeed"]):
        assert differences(after(whole, SAVED_AT), resumed) is None, \
            differences(after(whole, SAVED_AT), resumed)
    # save_state wrote the engine's checkpoint beside Accelerate's own files.
    saved = set(os.listdir(runs["ductile_dir"] / f"step_{SAVED_AT}"))
    assert {"latest", "pytorch_model", "scheduler.bin", "random_states_0.pkl",
            "random_states_1.pkl"} <= saved, saved


def test_saved_model_matches(runs):
    reference = AutoModelForCausalLM.from_pretrained(runs["deepspeed_dir"]).state_dict()
    for folder in (runs["ductile_dir"], runs["resumed_dir"]):
        ours = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert sorted(ours) == sorted(reference)
        for key, value in reference.items():
            # atol for values near 0: an attention bias DeepSpeed's run ends
            # at -2.9e-7 differs by 1.1e-6 (Adam's steps on gradients of ~0).
            torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, key=key: f"{key}: {m}")
