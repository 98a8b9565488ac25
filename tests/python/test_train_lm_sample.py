"""run.sh's main job (samples/train_lm/train_lm.py), smaller: the script as
the README runs it, under `ductile agent --standalone --nproc-per-node 2
--config ds_config.json`, on 320 passages. The agent starts it at a world
size the elastic plan allows, the script trains every passage once on
ductile's ZeRO-3 engine with packed batches, the Trainer's log carries
ductile's batch keys, the batch plan is drawn, and the summary adds up."""

import ast
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import CLI, SOURCE  # noqa: E402
from zero3_launch import environment  # noqa: E402

SAMPLE = os.path.join(SOURCE, "samples", "train_lm")
sys.path.insert(0, SAMPLE)
import train_lm  # noqa: E402

SAMPLES = 320


def test_train_lm_sample(tmp_path):
    env = environment()
    env["PYTHON_EXEC"] = sys.executable
    out_dir = tmp_path / "out"
    command = [CLI, "agent", "--standalone", "--nproc-per-node", "2", "--config",
               os.path.join(SAMPLE, "ds_config.json"), os.path.join(SAMPLE, "train_lm.py"),
               "--samples", str(SAMPLES), "--output-dir", str(out_dir)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-6000:]

    assert "global batch 24 = micro 4 x accumulation 3 x 2" in console, console[-6000:]
    assert ("elastic plan: global batch 24 samples, valid world sizes [1, 2, 3, 4, 6]; at world "
            "size 2") in console, console[-6000:]

    logs = [ast.literal_eval(line[line.index("{'loss'"):])
            for line in console.splitlines() if "{'loss'" in line]
    assert logs, console[-6000:]
    for log in logs:
        assert int(log["batch_samples"]) > 0 and int(log["batch_tokens"]) > 0, log
        assert float(log["padding_fraction"]) == 0.0, log  # flattened: no padding
        # The rate is the cosine schedule's (from 2e-3 down to 0 after the
        # last step) scaled for the batch.
        assert 0 <= float(log["learning_rate"]) / float(log["lr_scale"]) <= 2e-3 * (1 + 1e-6), log
    assert float(logs[0]["learning_rate"]) > 0

    summary = re.search(r"trained (\d+) steps, ([\d,]+) tokens in [\d.]+ s: [\d,]+ tokens/s; "
                        r"loss ([\d.]+) -> ([\d.]+)", console)
    assert summary, console[-6000:]
    steps, tokens, first, last = summary.groups()
    assert int(tokens.replace(",", "")) == int(train_lm.real_lengths(SAMPLES, seed=0).sum())
    assert int(steps) >= len(logs) * 5
    assert float(last) < float(first)

    with open(out_dir / "batch_plan.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
