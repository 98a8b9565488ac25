"""Checkpoints a user can take away: a ZeRO-3 checkpoint that
ductile.deepspeed's save_checkpoint wrote on 2 ranks holds zero_to_fp32.py,
which with DeepSpeed's command line writes, in one process (another world
size, no torch.distributed), the engine's whole fp32 weights as files
from_pretrained loads: pytorch_model.bin, model.safetensors, or numbered
files with an index past --max_shard_size. `ductile zero-to-fp32` does the
same, and a user's mistake (no such folder, tag or size) exits 2 naming it.
zero_to_fp32_worker.py trains and saves."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import CLI  # noqa: E402
from zero3_launch import environment, torchrun_script  # noqa: E402

WORKER = os.path.join(HERE, "zero_to_fp32_worker.py")


def trained(folder, *extra):
    torchrun_script(WORKER, [str(folder), *extra])
    assert json.loads((folder / "done.json").read_text()) == {"world": 2}
    return folder / "checkpoint", torch.load(folder / "expected.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("zero_to_fp32"))


def converter(*args, cli=False):
    """Runs the checkpoint's zero_to_fp32.py (or `ductile zero-to-fp32`)."""
    env = environment()
    env["DUCTILE_CONSOLE_PYTHON"] = sys.executable
    command = [CLI, "zero-to-fp32", *map(str, args)] if cli else [
        sys.executable, str(args[0] / "zero_to_fp32.py"), *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def assert_weights(tensors, expected):
    # The parameters, tied ones once (lm_head.weight is transformer.wte.weight).
    assert sorted(tensors) == sorted(k for k in expected if k != "lm_head.weight"
                                     and not k.endswith(".attn.bias")), sorted(tensors)
    for key, value in tensors.items():
        assert value.dtype == torch.float32
        assert torch.equal(value, expected[key]), key


def assert_loads(folder, expected):
    model, info = GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(model.lm_head.weight, expected["transformer.wte.weight"])
    for key, value in model.state_dict().items():
        if key in expected:
            assert torch.equal(value, expected[key]), key


def test_the_script_is_in_the_checkpoint_and_writes_bin(saved, tmp_path):
    checkpoint, expected = saved
    assert os.access(checkpoint / "zero_to_fp32.py", os.X_OK)
    done = converter(checkpoint, tmp_path / "bin")
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path / "bin")) == ["config.json", "pytorch_model.bin"]
    assert_weights(torch.load(tmp_path / "bin" / "pytorch_model.bin"), expected)
    assert_loads(tmp_path / "bin", expected)


def test_safetensors_with_a_tag(saved, tmp_path):
    checkpoint, expected = saved
    tag = (checkpoint / "latest").read_text().split()[0]
    done = converter(checkpoint, tmp_path / "st", "--safe_serialization", "--tag", tag)
    assert done.returncode == 0, done.stderr
    assert_weights(load_file(tmp_path / "st" / "model.safetensors"), expected)
    assert_loads(tmp_path / "st", expected)


def test_cli_splits_past_max_shard_size(saved, tmp_path):
    checkpoint, expected = saved
    done = converter(checkpoint, tmp_path / "split", "--safe_serialization",
                     "--max_shard_size", "20KB", cli=True)
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    tensors = {}
    for name in files:
        tensors.update(load_file(tmp_path / "split" / name))
    assert_weights(tensors, expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    assert_loads(tmp_path / "split", expected)


@pytest.mark.parametrize("args, message", [
    (["{missing}", "{out}"], "checkpoint_dir '{missing}' is not a folder"),
    (["{checkpoint}", "{out}", "--tag", "global_step99"],
     "--tag 'global_step99': no such save in '{checkpoint}'; valid: global_step3"),
    (["{checkpoint}", "{out}", "--max_shard_size", "5XB"],
     "--max_shard_size '5XB' is not a size; valid:"),
])
@pytest.mark.parametrize("cli", [False, True], ids=["script", "cli"])
def test_user_errors_exit_2_naming_the_argument(saved, tmp_path, args, message, cli):
    checkpoint, _ = saved
    names = {"missing": tmp_path / "missing", "out": tmp_path / "out", "checkpoint": checkpoint}
    done = converter(*[a.format(**names) for a in args], cli=cli) if cli else subprocess.run(
        [sys.executable, str(checkpoint / "zero_to_fp32.py"),
         *[a.format(**names) for a in args]],
        env=dict(environment()), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message.format(**names) in done.stderr, done.stderr


def test_exclude_frozen_parameters(tmp_path):
    checkpoint, expected = trained(tmp_path / "frozen", "frozen")
    done = converter(checkpoint, tmp_path / "out", "--exclude_frozen_parameters")
    assert done.returncode == 0, done.stderr
    tensors = torch.load(tmp_path / "out" / "pytorch_model.bin")
    assert "transformer.wpe.weight" not in tensors
    assert "transformer.wte.weight" in tensors
