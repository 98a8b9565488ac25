"""ductile.deepspeed in one process (a world of one, gloo): DeepSpeed's
engine contract method by method, with DeepSpeed's own engine class beside
it for the names and signatures; the batch triple against DeepSpeed's
DeepSpeedConfig; the config keys ductile warns about or refuses, by name;
progress lines, checkpoints and the 16-bit model file."""

import argparse
import inspect
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import CLI  # noqa: E402
from zero3_launch import free_port  # noqa: E402

import ductile  # noqa: E402
import ductile.deepspeed as ds  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import deepspeed  # noqa: E402
    from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402

# What training scripts, HF Accelerate (accelerator.py, utils/deepspeed.py)
# and the HF Trainer (trainer.py, integrations/deepspeed.py) call on
# DeepSpeed's engine: methods and their parameters.
ENGINE_METHODS = [
    "forward", "backward", "step", "train", "eval", "save_checkpoint", "load_checkpoint",
    "save_16bit_model", "get_lr", "get_mom", "gradient_accumulation_steps",
    "is_gradient_accumulation_boundary", "set_gradient_accumulation_boundary",
    "train_batch_size", "train_micro_batch_size_per_gpu", "set_train_batch_size",
    "zero_optimization", "zero_optimization_stage", "zero_optimization_partition_weights",
    "zero_optimization_partition_gradients", "fp16_enabled", "bfloat16_enabled",
    "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "get_global_grad_norm",
    "was_step_applied", "no_sync", "zero_grad", "module_state_dict", "destroy",
    "zero_gather_16bit_weights_on_model_save", "_zero3_consolidated_16bit_state_dict",
]
ENGINE_ATTRIBUTES = ["module", "optimizer", "lr_scheduler", "global_steps", "global_samples",
                     "micro_steps", "skipped_steps", "global_rank", "world_size", "dp_world_size",
                     "local_rank", "device", "training_dataloader"]

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3}}


@pytest.fixture(scope="module", autouse=True)
def world():
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(name, None)
    ds.init_distributed()
    assert torch.distributed.get_world_size() == 1
    yield
    torch.distributed.destroy_process_group()


def model_of(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def train(engine, steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x = torch.randn(2, 8, generator=generator)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_engine_contract_names_and_signatures():
    ours, theirs = ds.DeepSpeedEngine, deepspeed.DeepSpeedEngine
    assert issubclass(ours, torch.nn.Module)
    for name in ENGINE_METHODS:
        assert callable(getattr(ours, name, None)), name
        # DeepSpeed's parameters, in its order (self and **kwargs aside: a
        # decorated method of DeepSpeed's shows no self).
        mine = [p for p in inspect.signature(getattr(ours, name)).parameters
                if p not in ("self", "kwargs")]
        rival = [p for p in inspect.signature(getattr(theirs, name)).parameters
                 if p not in ("self", "kwargs")]
        if rival != ["args"]:  # a decorator of DeepSpeed's hides the signature
            assert mine[:len(rival)] == rival, (name, mine, rival)
    for top in ("initialize", "init_distributed", "add_config_arguments"):
        mine = list(inspect.signature(getattr(ds, top)).parameters)
        rival = list(inspect.signature(getattr(deepspeed, top)).parameters)
        assert mine == rival, (top, mine, rival)
    for name in ("Init", "GatheredParameters", "register_external_parameter"):
        assert hasattr(ds.zero, name), name
    for name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"):
        assert hasattr(ds.lr_schedules, name), name


def test_initialize_returns_deepspeeds_tuple_and_module():
    model = model_of()
    engine, optimizer, loader, scheduler = ds.initialize(model=model, config=CONFIG)
    for name in ENGINE_ATTRIBUTES:
        assert hasattr(engine, name), name
    assert engine.module is model and isinstance(engine, torch.nn.Module)
    assert optimizer is engine.optimizer and isinstance(optimizer, torch.optim.Adam)
    assert loader is None and scheduler is None
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (4, 2, 2)
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training
    before = [p.clone() for p in engine.zero3.shard_parameters()]
    assert not engine.is_gradient_accumulation_boundary()
    train(engine, 3)
    assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (3, 12, 6)
    assert engine.was_step_applied() and engine.get_global_grad_norm() > 0
    after = engine.zero3.shard_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    engine.destroy()


def test_backward_scales_by_accumulation_as_deepspeed():
    engine, *_ = ds.initialize(model=model_of(), config=CONFIG)
    loss = engine(torch.ones(2, 8)).sum()
    scaled = engine.backward(loss)
    assert scaled.item() == pytest.approx(loss.item() / 2)
    engine.step()
    loss = engine(torch.ones(2, 8)).sum()
    assert engine.backward(loss, scale_wrt_gas=False).item() == loss.item()
    engine.step()
    engine.destroy()


def test_script_optimizer_and_scheduler_objects_are_kept():
    model = model_of()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    config = {k: v for k, v in CONFIG.items() if k != "optimizer"}
    engine, opt, _, sched = ds.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                          config=config)
    assert opt is optimizer and sched is scheduler
    train(engine, 3)
    assert engine.get_lr() == [pytest.approx(0.1 / 4)]
    engine.destroy()


def test_training_data_gives_micro_batches():
    data = torch.utils.data.TensorDataset(torch.arange(10.0).reshape(10, 1))
    engine, _, loader, _ = ds.initialize(model=model_of(), config=dict(CONFIG, dataloader_drop_last=True),
                                         training_data=data)
    batches = [b[0].flatten().tolist() for b in loader]
    assert batches == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]
    engine.destroy()


def test_args_deepspeed_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    parser = ds.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, *_ = ds.initialize(args=args, model=model_of())
    assert engine.train_batch_size() == 4
    with pytest.raises(ductile.InvalidArgumentError, match="give one of them"):
        ds.initialize(args=args, model=model_of(), config=CONFIG)
    engine.destroy()


# --- the batch triple: DeepSpeed's DeepSpeedConfig in the same test ---------------

TRIPLES = [(8, None, None), (None, 2, None), (8, 2, None), (8, None, 4), (None, 2, 4),
           (8, 2, 4), (8, 3, 2), (None, None, 4), (6, 4, None)]


@pytest.mark.parametrize("train,micro,gas", TRIPLES)
def test_batch_triple_as_deepspeed_config(train, micro, gas):
    config = {"zero_optimization": {"stage": 3}}
    for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", gas)):
        if value is not None:
            config[key] = value
    try:
        theirs = DeepSpeedConfig(config)
        expected = (theirs.train_batch_size, theirs.train_micro_batch_size_per_gpu,
                    theirs.gradient_accumulation_steps)
    except (AssertionError, ValueError) as e:
        expected = e
    training = {"train_batch_size": train, "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": gas}
    from ductile.deepspeed._initialize import batch_sizes
    if isinstance(expected, Exception):
        with pytest.raises(ductile.ConfigError, match="ds.json: train_batch_size"):
            batch_sizes(training, 1, "ds.json")
    else:
        assert batch_sizes(training, 1, "ds.json") == expected


# --- no key dropped silently ---------------------------------------------------------

def warned(config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = ds.initialize(model=model_of(), config=config)
    engine.destroy()
    return [str(w.message) for w in caught]


def test_keys_without_effect_are_warned_by_name():
    config = dict(CONFIG, tensorboard={"enabled": True, "output_path": "tb"},
                  prescale_gradients=True, not_a_deepspeed_key=1,
                  zero_optimization={"stage": 3, "overlap_comm": True,
                                     "stage3_gather_16bit_weights_on_model_save": True})
    messages = warned(config)
    for key in ("tensorboard", "prescale_gradients", "not_a_deepspeed_key",
                "zero_optimization.overlap_comm"):
        assert any(key in m for m in messages), (key, messages)
    assert not any("stage3_gather_16bit" in m for m in messages), messages
    # Keys at DeepSpeed's defaults, "auto" or honoured say nothing.
    quiet = warned(dict(CONFIG, prescale_gradients=False, tensorboard={"enabled": False},
                        gradient_clipping="auto", steps_per_print=10))
    assert quiet == [], quiet


@pytest.mark.parametrize("key,value", [("amp", {"enabled": True}),
                                       ("torch_autocast", {"enabled": True}),
                                       ("progressive_layer_drop", {"enabled": True}),
                                       ("gradient_allreduce_op", "sum"),
                                       ("sequence_parallel_size", 2)])
def test_keys_that_change_training_are_refused(key, value, tmp_path):
    with pytest.raises(ductile.ConfigError, match=key):
        ds.initialize(model=model_of(), config=dict(CONFIG, **{key: value}))
    # `ductile config check` names them too (a warning there: an elastic job
    # may use the config without ductile's engine).
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(dict(CONFIG, **{key: value})))
    done = subprocess.run([CLI, "config", "check", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and f"{key} = " in done.stdout, done.stdout + done.stderr


def test_config_check_warns_about_keys_without_effect(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(dict(CONFIG, wandb={"enabled": True}, sparse_gradients=True)))
    done = subprocess.run([CLI, "config", "check", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "wandb is accepted, has no effect in ductile" in done.stdout
    assert "sparse_gradients is accepted, has no effect in ductile" in done.stdout


def test_bad_engine_key_values_name_the_key():
    for key, value in (("steps_per_print", 0), ("wall_clock_breakdown", "yes"),
                       ("log_level", "loud"), ("train_batch_size", -4)):
        with pytest.raises(ductile.ConfigError, match=key):
            ds.initialize(model=model_of(), config=dict(CONFIG, **{key: value}))


# --- what the console shows ------------------------------------------------------------

def test_progress_lines_every_steps_per_print(capsys):
    engine, *_ = ds.initialize(model=model_of(), config=dict(
        CONFIG, steps_per_print=2, log_level="info", wall_clock_breakdown=True))
    train(engine, 4)
    # A step's lines are written at the next step (its values on the host by
    # then, without waiting), the last ones by destroy().
    out = capsys.readouterr().out
    assert sum(line.startswith("time (ms) | fwd: ") for line in out.splitlines()) == 3
    engine.destroy()
    out += capsys.readouterr().out
    steps = [line for line in out.splitlines() if "step=" in line and "skipped=" in line]
    assert [s.split("step=")[1].split(",")[0] for s in steps] == ["2", "4"], out
    assert "lr=[0.01]" in steps[0]
    assert sum("RunningAvgSamplesPerSec=" in line for line in out.splitlines()) == 2
    assert sum(line.startswith("time (ms) | fwd: ") for line in out.splitlines()) == 4
    logging.getLogger("ductile.deepspeed").setLevel(logging.WARNING)
    # DeepSpeed's default log level is "warning": the step lines are silent.
    engine, *_ = ds.initialize(model=model_of(), config=dict(CONFIG, steps_per_print=1))
    train(engine, 2)
    assert "step=" not in capsys.readouterr().out
    engine.destroy()


# --- checkpoints and weights ------------------------------------------------------------

def test_checkpoint_round_trip_restores_counters_and_rates(tmp_path):
    config = dict(CONFIG, scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10}})
    engine, *_ = ds.initialize(model=model_of(), config=config)
    train(engine, 3)
    assert engine.save_checkpoint(str(tmp_path), client_state={"epoch": 7})
    # As in DeepSpeed's folder: the save, its pointer and the converter to whole weights.
    assert sorted(os.listdir(tmp_path)) == ["global_step3", "latest", "zero_to_fp32.py"]
    expected = train(engine, 2, seed=5)
    lr = engine.get_lr()
    engine.destroy()

    engine, *_ = ds.initialize(model=model_of(seed=9), config=config)
    path, client_state = engine.load_checkpoint(str(tmp_path))
    assert client_state == {"epoch": 7} and path == os.path.abspath(str(tmp_path))
    assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (3, 12, 6)
    assert train(engine, 2, seed=5) == pytest.approx(expected, rel=1e-6)
    assert engine.get_lr() == pytest.approx(lr)
    engine.destroy()


def test_load_without_checkpoint_is_none_none(tmp_path):
    engine, *_ = ds.initialize(model=model_of(), config=CONFIG)
    assert engine.load_checkpoint(str(tmp_path / "nothing")) == (None, None)
    engine.destroy()


def test_save_16bit_model_loads_into_the_model(tmp_path):
    engine, *_ = ds.initialize(model=model_of(), config=CONFIG)
    train(engine, 2)
    full = engine.zero3.state_dict()
    assert engine.save_16bit_model(str(tmp_path))
    fresh = model_of(seed=3)
    fresh.load_state_dict(torch.load(tmp_path / "pytorch_model.bin"))
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, full[name]), name
    engine.destroy()


def test_zero_init_and_gathered_parameters():
    with ds.zero.Init():
        model = model_of()
    engine, *_ = ds.initialize(model=model, config=CONFIG)
    reference = model_of()
    with ds.zero.GatheredParameters(list(model.parameters())):
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(mine.data, theirs.data)
    with pytest.raises(ductile.InvalidArgumentError, match="remote_device"):
        ds.zero.Init(remote_device="nvme")
    engine.destroy()


def test_zero3_initialize_honours_the_scheduler_block(tmp_path):
    """ductile.torch.zero3.initialize with a DeepSpeed config: its scheduler
    is the engine's lr_scheduler, stepped by step() and checkpointed."""
    import ductile.torch.zero3 as zero3
    config = dict(CONFIG, scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
        "warmup_type": "linear"}})
    engine = zero3.initialize(model_of(), config=config)
    assert type(engine.lr_scheduler).__name__ == "WarmupLR"
    rates = []
    for _ in range(3):
        engine(torch.ones(2, 8)).sum().backward()
        engine.step()
        rates.append(engine.optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([0.0, 0.0025, 0.005])  # DeepSpeed: iteration 0 first
    engine.save(str(tmp_path))
    engine.close()
    engine = zero3.initialize(model_of(), config=config)
    engine.load(str(tmp_path))
    assert engine.lr_scheduler.state_dict() == {"last_batch_iteration": 2}
    engine.close()
