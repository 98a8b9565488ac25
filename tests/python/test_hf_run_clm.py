"""transformers' run_clm.py shape on ductile's ZeRO-3 with one line changed:
hf_run_clm_script.py (HfArgumentParser, TrainingArguments with --deepspeed
made before the model, AutoModelForCausalLM.from_config with new tokens and
resize_token_embeddings, or .from_pretrained of a model saved here) runs on
HF's DeepSpeed integration as it is and with its Trainer import line alone
changed to ductile's, 2 ranks under torchrun, in the same test.

Under ZeRO-3 transformers makes the model inside ``deepspeed.zero.Init``:
with ductile's line the model is partitioned by ductile's from its first
parameter, initialised and loaded through ductile's GatheredParameters (a
safetensors checkpoint slice by slice), and adopted by the engine. The
losses, rates and gradient norms of every step are DeepSpeed's, a run
resumed from a checkpoint trains the same later steps, and the saved model
is DeepSpeed's and loads with from_pretrained.

DeepSpeed's side runs with the batch keys given (micro-batch and
accumulation, no train_batch_size): under --use_cpu its own zero.Init
computes the batch with a world size of 1 and refuses a train_batch_size
that counts both ranks. ductile's side runs with every batch key "auto",
train_batch_size included, which it resolves with the Trainer's world size.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import DATA  # noqa: E402
from hf_clm_script import build_tokenizer  # noqa: E402
import dropin_support  # noqa: E402
from dropin_support import (assert_same_models, assert_same_steps,  # noqa: E402
                            script_result, steps_of)
from zero3_launch import environment, free_port, one_line_changed, torchrun_script  # noqa: E402

SCRIPT = os.path.join(HERE, "hf_run_clm_script.py")
RIVAL_IMPORT = "from transformers import Trainer\n"
DUCTILE_IMPORT = "from ductile.hf import DuctileTrainer as Trainer\n"
TEXT = os.path.join(DATA, "text", "gpl-3.0.txt")
STEPS, SAVE_STEPS = 6, 3

AUTO_CONFIG = dict(dropin_support.AUTO_CONFIG, train_batch_size="auto")
RIVAL_CONFIG: dict = {k: v for k, v in AUTO_CONFIG.items() if k != "train_batch_size"}
RIVAL_CONFIG.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)

TRAINING = ["--use_cpu", "--ddp_backend", "gloo", "--per_device_train_batch_size", "2",
            "--per_device_eval_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--max_steps", str(STEPS), "--learning_rate", "3e-3", "--weight_decay", "0.01",
            "--warmup_steps", "2", "--max_grad_norm", "1.0", "--logging_steps", "1",
            "--save_steps", str(SAVE_STEPS), "--report_to", "none", "--disable_tqdm", "true",
            "--dataloader_drop_last", "true", "--seed", "42", "--train_file", TEXT]
FROM_CONFIG = ["--model_type", "gpt2", "--extra_tokens", "3", "--config_overrides",
               "n_embd=32,n_layer=2,n_head=4,n_positions=32,vocab_size=258,resid_pdrop=0.0,"
               "embd_pdrop=0.0,attn_pdrop=0.0"]


def run(script, config, output_dir, model_args, resume=None, rival=False):
    """A run's result, with its output folder as "dir"."""
    args = TRAINING + model_args + ["--deepspeed", config, "--output_dir", str(output_dir)]
    args += ["--resume_from_checkpoint", resume] if resume else []
    return dict(script_result(script, args, rival=rival), dir=output_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_run_clm")
    tokenizer = build_tokenizer(TEXT)
    tokenizer.save_pretrained(tmp / "tokenizer")
    # The "pretrained" model: a small GPT-2 saved as from_pretrained reads it.
    torch.manual_seed(0)
    pretrained = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    pretrained.save_pretrained(tmp / "pretrained")
    tokenizer.save_pretrained(tmp / "pretrained")
    configs = {}
    for name, config in (("rival", RIVAL_CONFIG), ("auto", AUTO_CONFIG)):
        configs[name] = str(tmp / f"ds_{name}.json")
        with open(configs[name], "w") as f:
            json.dump(config, f)
    changed = one_line_changed(SCRIPT, RIVAL_IMPORT, DUCTILE_IMPORT, tmp)
    from_config = FROM_CONFIG + ["--tokenizer_name", str(tmp / "tokenizer")]
    from_pretrained = ["--model_name_or_path", str(tmp / "pretrained")]
    out: dict = {"tmp": tmp, "pretrained": tmp / "pretrained"}
    for shape, model_args in (("config", from_config), ("pretrained", from_pretrained)):
        out["ductile", shape] = run(changed, configs["auto"], tmp / f"ductile-{shape}",
                                    model_args)
        out["deepspeed", shape] = run(SCRIPT, configs["rival"], tmp / f"deepspeed-{shape}",
                                      model_args, rival=True)
    # ductile's from_config run resumed from its checkpoint in a new process.
    checkpoint = f"checkpoint-{SAVE_STEPS}"
    resumed = tmp / "ductile-config-resumed"
    shutil.copytree(tmp / "ductile-config" / checkpoint, resumed / checkpoint)
    out["resumed"] = run(changed, configs["auto"], resumed, from_config,
                         resume=str(resumed / checkpoint))
    return out


@pytest.mark.parametrize("shape", ["config", "pretrained"])
def test_steps_match_deepspeed(runs, shape):
    theirs, ours = runs["deepspeed", shape], runs["ductile", shape]
    assert len(steps_of(theirs)) == STEPS
    assert_same_steps(steps_of(theirs), steps_of(ours))
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5)
    assert ours["files"] == theirs["files"]


@pytest.mark.parametrize("shape", ["config", "pretrained"])
def test_saved_model_matches_and_loads(runs, shape):
    theirs, ours = runs["deepspeed", shape]["dir"], runs["ductile", shape]["dir"]
    assert_same_models(theirs, ours)
    assert_same_models(theirs / f"checkpoint-{STEPS}", ours / f"checkpoint-{STEPS}")
    model, info = AutoModelForCausalLM.from_pretrained(ours, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if shape == "config":
        # The 3 new tokens: the resized embeddings were trained and saved.
        assert model.get_input_embeddings().weight.shape[0] == 258 + 3


def test_pretrained_weights_were_loaded(runs):
    """from_pretrained's values reached the shards: the first loss is
    DeepSpeed's from the same saved model, not a freshly initialised one's."""
    first = steps_of(runs["ductile", "pretrained"])[0]["loss"]
    assert first == pytest.approx(steps_of(runs["deepspeed", "pretrained"])[0]["loss"], rel=1e-5)
    assert first != pytest.approx(steps_of(runs["ductile", "config"])[0]["loss"], rel=1e-3)


def test_resume_trains_the_same_steps(runs):
    whole, resumed = runs["ductile", "config"], runs["resumed"]
    assert_same_steps(steps_of(whole, after=SAVE_STEPS), steps_of(resumed, after=SAVE_STEPS))
    assert_same_steps(steps_of(runs["deepspeed", "config"], after=SAVE_STEPS),
                      steps_of(resumed, after=SAVE_STEPS))
    assert resumed["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)
    assert_same_models(whole["dir"], resumed["dir"])


REFUSED_SCRIPT = """
import json, sys
import deepspeed
from transformers import GPT2Config, GPT2LMHeadModel
config = json.loads(sys.argv[1])
deepspeed.init_distributed(dist_backend="gloo")
with deepspeed.zero.Init(config_dict_or_path=config):
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64,
                                       n_positions=16))
import ductile.deepspeed
from ductile import InvalidArgumentError
try:
    ductile.deepspeed.initialize(model=model, config=config)
except InvalidArgumentError as error:
    print("refused:", error)
"""


def test_model_partitioned_by_deepspeed_is_refused():
    """A model DeepSpeed's own zero.Init partitioned (made before ductile was
    imported) is refused with the cause and the fix, not adopted wrongly."""
    env = environment()
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    done = subprocess.run([sys.executable, "-c", REFUSED_SCRIPT, json.dumps(config)],
                          check=False, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    refused = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    message = refused[0]
    assert "parameter 'transformer.wte.weight'" in message
    assert "DeepSpeed's deepspeed.zero.Init" in message and "import ductile.hf" in message


DEEPSPEED_HF_SCRIPT = os.path.join(HERE, "deepspeed_hf_script.py")


def test_deepspeed_script_with_a_transformers_model(runs):
    """A DeepSpeed script whose model transformers makes under ZeRO-3
    (HfDeepSpeedConfig, from_pretrained), with ``import deepspeed`` alone
    changed to ``import ductile.deepspeed as deepspeed``: DeepSpeed's losses."""
    changed = one_line_changed(DEEPSPEED_HF_SCRIPT, "import deepspeed\n",
                               "import ductile.deepspeed as deepspeed\n", runs["tmp"])

    def losses(script, rival=False):
        out = torchrun_script(script, [str(runs["pretrained"])], rival=rival)
        lines = [line for line in out.splitlines() if line.startswith('{"losses"')]
        assert len(lines) == 1, out[-3000:]
        return json.loads(lines[0])["losses"]

    ours = losses(changed)
    assert len(ours) == 4
    assert ours == pytest.approx(losses(DEEPSPEED_HF_SCRIPT, rival=True), rel=1e-5)
