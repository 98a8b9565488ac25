"""A DeepSpeed ZeRO-3 script (deepspeed_script.py: a JSON config with an
AdamW optimizer, a WarmupDecayLR scheduler, gradient clipping and CPU
optimizer offload; engine(batch), backward, step, save_checkpoint, and a
second run that load_checkpoints and goes on) moves to ductile by changing
its import line alone: run as it is (DeepSpeed) and with that one line
changed (ductile), on 2 ranks under torchrun, in the same test, the losses,
learning rates, counters and gradient norms of every step are equal.
DeepSpeed's side runs once, in processes whose gloo groups have one worker
thread (ordered_gloo/sitecustomize.py says why); ductile's keep gloo's
default threads."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_launch import (environment, one_line_changed, rival_environment,  # noqa: E402
                          torchrun_script)

SCRIPT = os.path.join(HERE, "deepspeed_script.py")
RIVAL_IMPORT = "import deepspeed\n"
DUCTILE_IMPORT = "import ductile.deepspeed as deepspeed\n"
TRAINED, RESUMED = 12, 10

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 5,
                             "total_num_steps": 40}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
}


def run(script, config, save_dir, steps, resume=False, rival=False):
    """The script on 2 ranks under torchrun (`rival`: DeepSpeed's run of it
    as it is): its JSON lines of rank 0."""
    args = ["--deepspeed_config", config, "--save_dir", save_dir, "--steps", str(steps)]
    out = torchrun_script(script, args + (["--resume"] if resume else []), rival=rival)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def matches(a, b):
    """Whether step records `b` equal `a`: a problem, or None."""
    if [r["step"] for r in b] != [r["step"] for r in a]:
        return f"steps {[r['step'] for r in b]} against {[r['step'] for r in a]}"
    for x, y in zip(a, b):
        same = (y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-6)
                and y["lr"] == pytest.approx(x["lr"], rel=1e-12, abs=1e-15)
                and y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
                and (y["global_steps"], y["global_samples"]) == (x["global_steps"],
                                                                  x["global_samples"]))
        if not same:
            return f"{y} against {x}"
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepspeed_script")
    config = tmp / "ds_config.json"
    config.write_text(json.dumps(CONFIG))

    def trained_and_resumed(name, script, rival=False):
        save_dir = str(tmp / f"checkpoints_{name}")
        return (run(script, str(config), save_dir, TRAINED, rival=rival)
                + run(script, str(config), save_dir, RESUMED, resume=True, rival=rival))

    ours = trained_and_resumed(
        "ductile", one_line_changed(SCRIPT, RIVAL_IMPORT, DUCTILE_IMPORT, tmp))
    return {"deepspeed": trained_and_resumed("deepspeed", SCRIPT, rival=True), "ductile": ours}


def test_steps_match_deepspeed(runs):
    theirs, ours = runs["deepspeed"], runs["ductile"]
    assert [r["step"] for r in theirs] == list(range(1, TRAINED + RESUMED + 1))
    assert matches(theirs, ours) is None, matches(theirs, ours)
    # The scheduler really moved the rate: warm-up, then decay.
    rates = [r["lr"] for r in theirs]
    assert rates[0] < rates[4] and rates[-1] < rates[4]


# One rank's gloo group: its worker threads and timeout as the group has them.
GLOO_THREADS = """
import datetime, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
options = dist.group.WORLD._get_backend(torch.device("cpu")).options
print("threads", options._threads, "timeout", options._timeout.total_seconds())
"""


@pytest.mark.parametrize("rival", [True, False])
def test_only_deepspeeds_runs_have_one_gloo_thread(tmp_path, rival):
    """The processes of DeepSpeed's runs make their gloo groups with one
    worker thread and the timeout asked for; ductile's keep gloo's two."""
    env = rival_environment() if rival else environment()
    done = subprocess.run([sys.executable, "-c", GLOO_THREADS, str(tmp_path / "store")],
                          check=False, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    threads = 1 if rival else 2
    assert done.stdout.splitlines()[-1] == f"threads {threads} timeout 60.0", done.stdout
