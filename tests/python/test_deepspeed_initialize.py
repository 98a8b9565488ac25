"""ductile.deepspeed.initialize and `ductile config check` read a DeepSpeed
config with one C++ check: the same values refused with the same message,
the same keys warned about, naming the file and the key. Both read its JSON
by the same rules (at most 64 levels, nothing after the value, a UTF-8 byte
order mark skipped), in load_config too, for a file, a text and a dict."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import CLI  # noqa: E402
from zero3_launch import free_port  # noqa: E402

import ductile  # noqa: E402
import ductile.deepspeed as ds  # noqa: E402

BASE = {"zero_optimization": {"stage": 3}}
BATCH = "valid: an integer from 1 to 2147483647"


@pytest.fixture(scope="module", autouse=True)
def world():
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(name, None)
    ds.init_distributed()
    yield
    torch.distributed.destroy_process_group()


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def check(path):
    return subprocess.run([CLI, "config", "check", str(path)], capture_output=True, text=True,
                          timeout=60)


def write(tmp_path, text, name="ds.json"):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return path


@pytest.mark.parametrize("entry, message", [
    ('"train_batch_size": -8', f"train_batch_size = -8; {BATCH}"),
    ('"train_batch_size": 1e30', f"train_batch_size = 1e+30; {BATCH}"),
    ('"train_batch_size": 2147483648', f"train_batch_size = 2147483648; {BATCH}"),
    ('"gradient_accumulation_steps": 18446744073709551616',
     f"gradient_accumulation_steps = 1.8446744073709552e+19; {BATCH}"),
    ('"train_micro_batch_size_per_gpu": true', f"train_micro_batch_size_per_gpu = true; {BATCH}"),
    ('"train_micro_batch_size_per_gpu": 2.5', f"train_micro_batch_size_per_gpu = 2.5; {BATCH}"),
    ('"train_micro_batch_size_per_gpu": "2"',
     f'train_micro_batch_size_per_gpu = "2"; {BATCH}'),
    ('"steps_per_print": -1', "steps_per_print = -1; valid: an integer from 1 to 1000000000"),
    ('"steps_per_print": 9223372036854775808',
     "steps_per_print = 9223372036854775808; valid: an integer from 1 to 1000000000"),
    ('"gradient_clipping": -1', "gradient_clipping = -1; valid: a number >= 0 (0: no clipping)"),
])
def test_initialize_and_config_check_refuse_the_same_values(tmp_path, entry, message):
    path = write(tmp_path, '{"zero_optimization": {"stage": 3}, ' + entry + "}")
    with pytest.raises(ductile.ConfigError) as error:
        ds.initialize(model=model(), config=str(path))
    assert str(error.value) == f"{path}: {message}"
    done = check(path)
    assert done.returncode == 2, done.stdout
    assert f"{path}: {message}" in done.stderr


def test_initialize_and_config_check_warn_about_the_same_keys(tmp_path):
    config = dict(BASE, train_micro_batch_size_per_gpu=2,
                  fp16={"enabled": True, "loss_scale_windo": 100},
                  optimizer={"type": "AdamW", "params": {"lr": 1e-3, "betaz": [0.9, 0.99]}},
                  scheduler={"type": "WarmupLR", "params": {"warmup_num_stepz": 10}})
    path = write(tmp_path, json.dumps(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds.initialize(model=model(), config=str(path))
    warned = [str(w.message) for w in caught if str(w.message).startswith(f"{path}: ")]
    for key in ("fp16.loss_scale_windo", "optimizer.params.betaz",
                "scheduler.params.warmup_num_stepz"):
        assert any(w.startswith(f"{path}: {key} ") for w in warned), (key, warned)
    done = check(path)
    assert done.returncode == 0, done.stderr
    said = [line.removeprefix("  warning: ") for line in done.stdout.splitlines()
            if line.startswith("  warning: ")]
    assert sorted(said) == sorted(warned)


DEEP = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"


def test_json_nested_too_deep_is_a_config_error_naming_the_file(tmp_path):
    path = write(tmp_path, DEEP)
    done = check(path)
    assert done.returncode == 2
    expected = f"{path}: JSON nested deeper than 64 levels (at byte 69); ductile accepts at most 64"
    assert expected in done.stderr
    for call in (lambda: ductile.load_config(path), lambda: ductile.load_config(str(path)),
                 lambda: ds.initialize(model=model(), config=str(path))):
        with pytest.raises(ductile.ConfigError) as error:
            call()
        assert str(error.value) == expected
    with pytest.raises(ductile.ConfigError) as error:
        ductile.load_config(DEEP)
    assert str(error.value) == expected.replace(str(path), "<string>")
    deep = {}
    inner = deep
    for _ in range(100_000):
        inner["a"] = {}
        inner = inner["a"]
    for call in (lambda: ductile.load_config(deep),
                 lambda: ds.initialize(model=model(), config=deep)):
        with pytest.raises(ductile.ConfigError) as error:
            call()
        assert str(error.value) == "<dict>: JSON nested deeper than 64 levels; ductile accepts " \
                                   "at most 64"


def test_text_after_the_json_value_is_a_config_error_naming_the_file(tmp_path):
    path = write(tmp_path, json.dumps(dict(BASE, train_batch_size=1)) + " }garbage")
    done = check(path)
    assert done.returncode == 2
    with pytest.raises(ductile.ConfigError) as error:
        ductile.load_config(path)
    message = str(error.value)
    assert message.startswith(f"{path}: invalid JSON: ")
    assert message in done.stderr
    with pytest.raises(ductile.ConfigError) as error:
        ds.initialize(model=model(), config=str(path))
    assert str(error.value) == message


def test_a_byte_order_mark_is_skipped_as_the_cli_does(tmp_path):
    config = dict(BASE, train_batch_size=1)
    for name in ("ds.json", "ds.conf"):  # by extension, and by content
        path = write(tmp_path, b"\xef\xbb\xbf" + json.dumps(config).encode(), name)
        done = check(path)
        assert done.returncode == 0 and "valid (DeepSpeed JSON)" in done.stdout, done.stderr
        assert ductile.load_config(path).format == "deepspeed"
        engine, *_ = ds.initialize(model=model(), config=str(path))
        assert engine.train_batch_size() == 1
    assert ductile.load_config("\ufeff" + json.dumps(config)).format == "deepspeed"
