"""from_pretrained under ZeRO-3 with ductile's one line never holds the model
whole on a rank: a saved GPT-2 of 135 MB in fp32 is loaded on 2 ranks, each
building its parameters straight into its slices and reading from the
safetensors file only the bytes of its own slices. Each rank's peak
resident memory grows by less than 80 % of the model over the load (so
the load fits under a per-rank cap the whole model does not fit under),
where the same model made whole (the control, one process) grows by more
than the whole model; hf_load_memory_worker.py measures it."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_launch import environment, torchrun_script  # noqa: E402

WORKER = os.path.join(HERE, "hf_load_memory_worker.py")
CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A GPT-2 of about 34 M parameters saved with save_pretrained, and its
    fp32 size in bytes."""
    tmp = tmp_path_factory.mktemp("hf_load_memory")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=4096, n_embd=512, n_layer=10, n_head=8,
                                       n_positions=64))
    model.save_pretrained(tmp / "model")
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    config = tmp / "ds.json"
    config.write_text(json.dumps(CONFIG))
    return tmp, whole


def results(folder, mode, ranks):
    return [json.loads((folder / f"{mode}-rank{r}.json").read_text()) for r in range(ranks)]


def test_each_rank_holds_and_reads_its_slices_only(saved):
    tmp, whole = saved
    torchrun_script(WORKER, [str(tmp / "model"), str(tmp), str(tmp / "ds.json"), "ductile"])
    ranks = results(tmp, "ductile", 2)
    for rank in ranks:
        # Each rank keeps half the model (rounded up a parameter at a time).
        assert rank["kept"] == pytest.approx(whole / 2, rel=0.01), rank
        assert rank["grown"] < 0.8 * whole, (rank, whole)


def test_whole_model_is_seen_whole(saved):
    """The control: the same measurement sees a whole model when there is one."""
    tmp, whole = saved
    done = subprocess.run([sys.executable, WORKER, str(tmp / "model"), str(tmp), "", "plain"],
                          env=environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (plain,) = results(tmp, "plain", 1)
    assert plain["kept"] == whole
    assert plain["grown"] > whole, (plain, whole)
