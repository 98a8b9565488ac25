"""from_pretrained under ZeRO-3 with ductile's one line never holds the model
whole on a rank: a saved GPT-2 of 128 MiB in fp32 is loaded on 2 ranks, each
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
from zero3_launch import MEMORY_ENV, command, environment  # noqa: E402

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


def run_worker(tmp, mode, ranks):
    args = [str(tmp / "model"), str(tmp), str(tmp / "ds.json"), mode]
    env = dict(environment(), **MEMORY_ENV, DS_ACCELERATOR="cpu")
    done = subprocess.run(command(ranks, "torchrun", WORKER, *args), env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return results(tmp, mode, ranks or 1)


def test_each_rank_holds_and_reads_its_slices_only(saved):
    tmp, whole = saved
    for r, rank in enumerate(run_worker(tmp, "ductile", 2)):
        print(f"rank {r}: peak {rank['grown'] / 2**20:.1f} MiB above its start over the load, "
              f"keeps {rank['kept'] / 2**20:.1f} MiB; the model is {whole / 2**20:.1f} MiB")
        # Each rank keeps half the model (rounded up a parameter at a time).
        assert rank["kept"] == pytest.approx(whole / 2, rel=0.01), rank
        assert rank["grown"] < 0.8 * whole, (rank, whole)


def test_whole_model_is_seen_whole(saved):
    """The control: the same measurement sees a whole model when there is one."""
    tmp, whole = saved
    (plain,) = run_worker(tmp, "plain", None)
    print(f"made whole: peak {plain['grown'] / 2**20:.1f} MiB above its start")
    assert plain["kept"] == whole
    assert plain["grown"] > whole, (plain, whole)
