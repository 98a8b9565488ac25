"""zero3's optimizer offload and device memory budget on 2 ranks (the
runs are torchrun jobs of zero3_offload_worker.py), against the same
training with everything on the device:

- offload_optimizer="cpu": fp32 masters and Adam state on the host,
  stepped by the cpu_adam plugin: the same losses (fp32 within 1e-5) with
  accumulation, clipping and a learning-rate schedule; under bf16; with
  step_in_backward;
- max_device_memory below what the model needs on the device: only the
  groups' optimizers that do not fit go to the host, the engine's
  accounting stays within the budget at every step, the losses are the
  same;
- a checkpoint of an offloaded run resumes on 3 ranks, offloaded, and on 1
  rank without offload;
- offload_param="cpu": every group's parameter shard in host memory (the
  coordinator's ShardPlacement), copied to the device for each gather, and
  its optimizer with it: the same losses and parameters, in fp32 and bf16,
  and its checkpoint resumes on 3 ranks; a budget below what the device
  needs with every optimizer on the host moves only some shards;
- DeepSpeed's offload_optimizer / offload_param keys, and the errors.

On the cpu backend the "device" and the host are the same memory: the
moves are copies between the engine's pools, and each is counted."""

import json
import os
import sys

import pytest

import torch

import ductile
import ductile.torch.zero3 as zero3

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_launch import BLOCKS_CONFIG, CONFIG, launch_batch  # noqa: E402
from zero3_model import Windows, loss_of, make_model  # noqa: E402

WORKER = os.path.join(HERE, "zero3_offload_worker.py")
PARAM_CONFIG = BLOCKS_CONFIG.replace("[zero]\n", "[zero]\noffload_param = \"cpu\"\n")
assert PARAM_CONFIG != BLOCKS_CONFIG
STEPS = 6
TRAINING = {"steps": STEPS, "accumulate": 2, "no_sync": True, "clip": 0.5, "save_at": [3]}


def relative(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def assert_losses_match(result, reference, steps, tolerance=1e-5):
    for s in steps:
        a, b = result["losses"][str(s)], reference["losses"][str(s)]
        assert relative(a, b) <= tolerance, f"step {s}: loss {a} vs {b}"


def run(tmp, batch, ranks=2):
    """The (name, spec, config) runs of `batch`, one after another in one
    torchrun job: {name: (result, params, stderr)}."""
    return launch_batch(tmp, batch, ranks=ranks, launcher="torchrun", worker=WORKER, timeout=400)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3_offload")
    bf16 = {"steps": 4, "precision": "bf16", "optimizer": "adamw", "clip": 1.0}
    early = {"steps": 4, "accumulate": 2, "no_sync": True, "step_in_backward": True}
    r = run(tmp, [("device", TRAINING, BLOCKS_CONFIG),
                  ("offload", dict(TRAINING, offload="cpu"), BLOCKS_CONFIG),
                  ("bf16", bf16, BLOCKS_CONFIG),
                  ("bf16_offload", dict(bf16, offload="cpu"), BLOCKS_CONFIG),
                  ("early", early, BLOCKS_CONFIG),
                  ("early_offload", dict(early, offload="cpu"), BLOCKS_CONFIG),
                  ("param", TRAINING, PARAM_CONFIG),
                  ("bf16_param", bf16, PARAM_CONFIG)])
    # A budget just below what the device held at every step without
    # offload: the plan (which counts the most the coordinator may gather)
    # must offload part of the optimizer state.
    budget = min(r["device"][0]["high_water"].values()) - 1
    # Below what the device needs with every optimizer on the host: some
    # parameter shards must go too.
    shard_budget = r["offload"][0]["stats"]["device_need_bytes"] - 1
    r.update(run(tmp, [("budget", dict(TRAINING, budget=budget), BLOCKS_CONFIG),
                       ("shard_budget", dict(TRAINING, budget=shard_budget), BLOCKS_CONFIG)]))
    resumed = {"steps": STEPS, "start": 3, "accumulate": 2, "no_sync": True, "clip": 0.5}
    r.update(run(tmp, [
        ("resumed", dict(resumed, offload="cpu", load=str(tmp / "offload" / "step3")),
         BLOCKS_CONFIG),
        ("param_resumed", dict(resumed, load=str(tmp / "param" / "step3")), PARAM_CONFIG)],
        ranks=3))
    r.update(run(tmp, [("resumed_on_device", dict(resumed, load=str(tmp / "offload" / "step3")),
                        BLOCKS_CONFIG)], ranks=1))
    return r


def test_the_offloaded_optimizer_trains_as_on_the_device(runs):
    device, params_device, _ = runs["device"]
    offload, params_offload, _ = runs["offload"]
    assert_losses_match(offload, device, range(STEPS))
    for s in range(STEPS):  # the clipped norm, and the schedule's learning rate
        assert relative(offload["norms"][str(s)], device["norms"][str(s)]) <= 1e-5
        assert offload["lr"][str(s)] == device["lr"][str(s)] < 3e-3 or s == 0
    for key, ref in params_device.items():
        diff = (params_offload[key] - ref).abs().max().item()
        assert diff <= 1e-5 * ref.abs().max().item(), f"{key}: max difference {diff}"


def test_offload_moves_every_groups_optimizer_and_counts_the_copies(runs):
    device = runs["device"][0]["stats"]
    stats = runs["offload"][0]["stats"]
    groups = stats["groups"]
    assert len(stats["offloaded_groups"]) == groups == 5  # four blocks and the root
    state = device["placement"]["optimizer_state"]
    assert state["host"] == 0 and state["device"] > 0
    assert stats["placement"]["optimizer_state"] == {"device": 0, "host": state["device"]}
    # One gradient copy to the host and one parameter copy back a group and
    # step (accumulation under no_sync reduces once a step), plus the first
    # copy of the initial values.
    assert stats["offload_grad_copies"] == groups * STEPS
    assert stats["offload_steps"] == groups * STEPS
    assert stats["offload_param_copies"] == groups * (STEPS + 1)
    assert stats["device_high_water_bytes"] < device["device_high_water_bytes"]


def test_a_budget_below_the_models_needs_offloads_only_what_does_not_fit(runs):
    device = runs["device"][0]
    result = runs["budget"][0]
    stats = result["stats"]
    budget = stats["max_device_memory"]
    assert device["stats"]["device_need_bytes"] > budget
    assert device["stats"]["offloaded_groups"] == []
    assert 0 < len(stats["offloaded_groups"]) < stats["groups"]
    assert stats["placement"]["optimizer_state"]["device"] > 0
    assert stats["device_need_bytes"] <= budget
    for s in range(STEPS):
        assert device["high_water"][str(s)] > budget, "the budget must bind"
        assert 0 < result["high_water"][str(s)] <= budget, (s, result["high_water"], budget)
    assert_losses_match(result, device, range(STEPS))


def test_an_offloaded_checkpoint_resumes_on_other_world_sizes(runs):
    offload = runs["offload"][0]
    for name, world in (("resumed", 3), ("resumed_on_device", 1)):
        resumed = runs[name][0]
        assert resumed["world"] == world and resumed["client_state"] == {"step": 3}
        assert_losses_match(resumed, offload, range(3, STEPS))
    assert runs["resumed_on_device"][0]["stats"]["offloaded_groups"] == []


def test_bf16_offload_trains_as_bf16_on_the_device(runs):
    """The plugin rounds the updated masters to bf16 as torch does (round
    to nearest even): the bf16 shards gathered are the same."""
    device, offload = runs["bf16"][0], runs["bf16_offload"][0]
    assert offload["stats"]["placement"]["master_weights"]["device"] == 0
    assert device["stats"]["placement"]["master_weights"]["host"] == 0
    assert_losses_match(offload, device, range(4), tolerance=2e-2)
    worst = max(relative(offload["losses"][str(s)], device["losses"][str(s)]) for s in range(4))
    assert worst <= 1e-4, (offload["losses"], device["losses"])


def test_step_in_backward_steps_each_group_on_the_host_as_its_gradient_lands(runs):
    device, offload = runs["early"][0], runs["early_offload"][0]
    assert_losses_match(offload, device, range(4))
    assert offload["stats"]["offload_steps"] == 4 * offload["stats"]["groups"]


def test_parameter_shards_in_host_memory_train_as_on_the_device(runs):
    device, params_device, _ = runs["device"]
    param, params_param, _ = runs["param"]
    assert_losses_match(param, device, range(STEPS))
    for key, ref in params_device.items():
        diff = (params_param[key] - ref).abs().max().item()
        assert diff <= 1e-5 * ref.abs().max().item(), f"{key}: max difference {diff}"
    stats = param["stats"]
    groups = stats["groups"]
    assert len(stats["host_shard_groups"]) == len(stats["offloaded_groups"]) == groups
    shards = device["stats"]["placement"]["parameters"]
    assert stats["placement"]["parameters"] == {"device": 0, "host": shards["device"]}
    # The host step writes the coordinator's shard itself: nothing is copied
    # back to a device shard.
    assert stats["offload_param_copies"] == 0 and stats["offload_steps"] == groups * STEPS
    assert stats["device_high_water_bytes"] < runs["offload"][0]["stats"][
        "device_high_water_bytes"]
    resumed = runs["param_resumed"][0]
    assert resumed["world"] == 3 and resumed["client_state"] == {"step": 3}
    assert_losses_match(resumed, param, range(3, STEPS))


def test_a_budget_below_every_optimizer_on_the_host_moves_some_shards(runs):
    result = runs["shard_budget"][0]
    stats = result["stats"]
    budget = stats["max_device_memory"]
    assert runs["offload"][0]["stats"]["device_need_bytes"] > budget >= stats["device_need_bytes"]
    assert len(stats["offloaded_groups"]) == stats["groups"]
    assert 0 < len(stats["host_shard_groups"]) < stats["groups"]
    placement = stats["placement"]["parameters"]
    assert placement["device"] > 0 and placement["host"] > 0
    for s in range(STEPS):
        assert 0 < result["high_water"][str(s)] <= budget, (s, result["high_water"], budget)
    assert_losses_match(result, runs["device"][0], range(STEPS))


def test_bf16_shards_in_host_memory_train_as_bf16_on_the_device(runs):
    device, param = runs["bf16"][0], runs["bf16_param"][0]
    assert param["stats"]["placement"]["parameters"]["device"] == 0
    worst = max(relative(param["losses"][str(s)], device["losses"][str(s)]) for s in range(4))
    assert worst <= 1e-4, (param["losses"], device["losses"])


# --- in this process: one rank, no launcher ------------------------------------------------


def deepspeed(**zero):
    return json.dumps({"train_batch_size": 4, "zero_optimization": dict(stage=3, **zero)})


def test_deepspeeds_offload_keys_are_honoured_or_warned_about():
    from ductile.torch.zero3 import _settings
    with pytest.warns(UserWarning) as caught:
        settings = _settings.resolve(deepspeed(
            offload_optimizer={"device": "cpu", "pin_memory": False, "ratio": 0.5,
                               "buffer_count": 4},
            offload_param={"device": "cpu", "max_in_cpu": 10}), None, None, None)
    assert settings.offload.optimizer and not settings.offload.pin
    assert settings.offload.ratio == 0.5 and settings.offload.param
    shown = [str(w.message) for w in caught]
    assert any("offload_optimizer.buffer_count is accepted but ignored" in m for m in shown)
    assert not any("offload_param.device" in m for m in shown)
    assert any("offload_param.max_in_cpu is accepted but ignored" in m for m in shown)
    with pytest.raises(ductile.ConfigError,
                       match=r'offload_optimizer.device = "gpu"; valid: "cpu", "nvme"'):
        _settings.resolve(deepspeed(offload_optimizer={"device": "gpu"}), None, None, None)
    with pytest.raises(ductile.ConfigError, match=r"offload_optimizer.ratio = 2.0 is out of range"):
        _settings.resolve(deepspeed(offload_optimizer={"device": "cpu", "ratio": 2}), None, None,
                        None)


def test_the_offload_argument_is_checked_by_the_deepspeed_mapping():
    """initialize(offload_optimizer=...) goes through the pipeline's mapping
    of an offload_optimizer object: the same checks, warnings and messages."""
    def start(offload):
        return zero3.initialize(make_model(layers=1), lambda ps: torch.optim.Adam(ps), CONFIG,
                                offload_optimizer=offload)
    with pytest.raises(ductile.ConfigError,
                       match=r"zero3.initialize: offload_optimizer.ratio = 2.0 is out of range"):
        start({"device": "cpu", "ratio": 2})
    with pytest.raises(ductile.ConfigError,
                       match=r'zero3.initialize: offload_optimizer.device = "gpu"; valid: '
                             r'"cpu", "nvme", "none"'):
        start("gpu")
    with pytest.raises(ductile.ConfigError, match=r"zero3.initialize: offload_optimizer = "
                                                  r"\{'device': \{1, 2\}\}; valid: None"):
        start({"device": {1, 2}})
    with pytest.warns(UserWarning, match=r"zero3.initialize: offload_optimizer.fast_init is "
                                         r"accepted but ignored"):
        engine = start({"device": "cpu", "fast_init": True, "pin_memory": False})
    try:
        stats = engine.stats()
        assert len(stats["offloaded_groups"]) == stats["groups"]
    finally:
        engine.close()
    engine = start("none")
    try:
        assert engine.stats()["offloaded_groups"] == []
    finally:
        engine.close()


def test_the_zero_sections_offload_keys_read_as_deepspeeds():
    from ductile.torch.zero3 import _settings
    toml = '[accelerator]\nbackend = "cpu"\n[zero]\n'
    settings = _settings.resolve(toml + 'offload_optimizer = "cpu"\noffload_ratio = 0.25\n'
                               'offload_pin_memory = false\n', None, None, None)
    assert settings.offload.optimizer and not settings.offload.pin
    assert settings.offload.ratio == 0.25
    assert not _settings.resolve(toml, None, None, None).offload.optimizer
    assert not _settings.resolve(toml, None, None, None).offload.param
    assert _settings.resolve(toml + 'offload_param = "cpu"\n', None, None, None).offload.param
    with pytest.raises(ductile.ConfigError,
                       match=r'\[zero\] offload_param = "nvme" is not allowed .*; valid '
                             r'values: none, cpu'):
        _settings.resolve(toml + 'offload_param = "nvme"\n', None, None, None)
    with pytest.raises(ductile.ConfigError,
                       match=r'\[zero\] offload_optimizer = "gpu" is not allowed .*; valid '
                             r'values: none, cpu'):
        _settings.resolve(toml + 'offload_optimizer = "gpu"\n', None, None, None)


def test_a_deepspeed_config_offloads_and_builds_its_optimizer():
    config = json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                         "optimizer": {"type": "AdamW", "params": {"lr": 2e-3,
                                                                   "weight_decay": 0.1}}})
    engine = zero3.initialize(make_model(layers=1), None, config)
    try:
        assert engine.optimizer.checkpoint_class == "AdamW"
        assert engine.optimizer.param_groups[0]["lr"] == 2e-3
        assert len(engine.stats()["offloaded_groups"]) == engine.stats()["groups"]
        x, y = Windows(batch=2).step(0)
        engine.backward(loss_of(engine(x), y))
        engine.step()
        assert engine.stats()["offload_steps"] == engine.stats()["groups"]
    finally:
        engine.close()


def test_a_ratio_offloads_part_of_the_optimizer():
    engine = zero3.initialize(make_model(layers=3), lambda ps: torch.optim.Adam(ps), CONFIG,
                              offload_optimizer={"device": "cpu", "ratio": 0.5})
    try:
        placement = engine.stats()["placement"]["optimizer_state"]
        assert placement["host"] >= placement["device"] > 0
    finally:
        engine.close()


def test_fp16_loss_scaling_with_offload_steps_as_on_the_device():
    def losses(**kwargs):
        engine = zero3.initialize(make_model(layers=1), lambda ps: torch.optim.Adam(ps, lr=1e-3),
                                  CONFIG, mixed_precision="fp16", **kwargs)
        out = []
        try:
            windows = Windows(batch=2)
            for s in range(3):
                x, y = windows.step(s)
                loss = loss_of(engine(x), y)
                engine.backward(loss)
                engine.step()
                out.append((loss.item(), engine.loss_scale))
        finally:
            engine.close()
        return out
    device, offload = losses(), losses(offload_optimizer="cpu")
    for (a, sa), (b, sb) in zip(offload, device):
        assert sa == sb and relative(a, b) <= 1e-3, (offload, device)


def test_masters_written_right_after_a_step_reach_the_device(tmp_path):
    """A load, or GatheredParameters(modifier_rank=0), between a step and
    the next pass (the step's copies to the device are issued, not yet
    waited on) is what the next pass computes with."""
    engine = zero3.initialize(make_model(layers=1), lambda ps: torch.optim.Adam(ps, lr=1e-2),
                              CONFIG, offload_optimizer="cpu")
    try:
        x, y = Windows(batch=2).step(0)

        def train():
            engine.backward(loss_of(engine(x), y))
            engine.step()

        train()
        engine.save(str(tmp_path))
        with torch.no_grad():
            saved = loss_of(engine(x), y).item()
        train()
        engine.load(str(tmp_path))
        with torch.no_grad():
            assert loss_of(engine(x), y).item() == saved
        train()
        weight = engine.module.blocks[0].up.weight
        with zero3.GatheredParameters([weight], modifier_rank=0):
            weight.data.zero_()
        with torch.no_grad():
            engine(x)
        assert engine.full_parameters()["blocks.0.up.weight"].abs().max().item() == 0.0
        with zero3.GatheredParameters([weight]):
            assert weight.abs().max().item() == 0.0  # gathered from the device shard
    finally:
        engine.close()


def test_what_offload_cannot_do_is_an_error_naming_it():
    model = make_model(layers=1)
    with pytest.raises(ductile.IncompatibleError, match=r"made a SGD. Valid: torch.optim.Adam"):
        zero3.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), CONFIG,
                         offload_optimizer="cpu")
    with pytest.raises(ductile.IncompatibleError, match=r"amsgrad=True"):
        zero3.initialize(make_model(layers=1), lambda ps: torch.optim.Adam(ps, amsgrad=True),
                         CONFIG, offload_optimizer=True)
    with pytest.raises(ductile.IncompatibleError,
                       match=r"max_device_memory = 1000 bytes cannot be met: .* the device still "
                             r"needs \d+ bytes .*valid: max_device_memory >= \d+"):
        zero3.initialize(make_model(layers=1), lambda ps: torch.optim.Adam(ps), CONFIG,
                         max_device_memory=1000)
    for bad, shown in (("lots", "'lots'"), (1.5, "1.5"), (0, "0"), (True, "True")):
        with pytest.raises(ductile.InvalidArgumentError, match=f"max_device_memory = {shown}"):
            zero3.initialize(make_model(layers=1), None, CONFIG, max_device_memory=bad)


# --- NVMe shard files: the folder and the files are ductile's own ---------------------------


def test_deepspeeds_nvme_device_with_an_empty_path_is_refused():
    """nvme_path "" kept the shards in device memory while the config asked
    for NVMe; it is an error naming DeepSpeed's key."""
    from ductile.torch.zero3 import _settings
    with pytest.raises(ductile.ConfigError,
                       match=r'zero_optimization.offload_param.nvme_path = "": device "nvme" '
                             r"needs the directory of its files; valid: a non-empty directory "
                             r'path \(or device "cpu" or "none"'):
        _settings.resolve(deepspeed(offload_param={"device": "nvme", "nvme_path": ""}), None,
                        None, None)


def nvme_engine(nvme):
    config = CONFIG.replace("[zero]\n", f'[zero]\nnvme_path = "{nvme}"\n')
    return zero3.initialize(make_model(layers=1), None, config)


def test_a_link_planted_as_a_shard_file_is_refused_and_its_target_kept(tmp_path):
    folder = tmp_path / "nvme" / "rank0"
    folder.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for p in range(64):
        os.symlink(victim, folder / f"param_{p}.shard")
    with pytest.raises(ductile.IoError,
                       match=rf"cannot create NVMe shard file '{folder}/param_\d+.shard' of "
                             r"parameter \d+: it is a symbolic link, not a regular file; remove "
                             r"it"):
        nvme_engine(tmp_path / "nvme")
    assert victim.read_text() == "precious"


def test_a_fifo_planted_as_a_shard_file_fails_at_once(tmp_path):
    """A blocking open of the FIFO waited for a writer forever."""
    folder = tmp_path / "nvme" / "rank0"
    folder.mkdir(parents=True, mode=0o700)
    for p in range(64):
        os.mkfifo(folder / f"param_{p}.shard")
    with pytest.raises(ductile.IoError, match=r"param_\d+.shard' of parameter \d+: it is a "
                                              r"FIFO, not a regular file"):
        nvme_engine(tmp_path / "nvme")


def test_a_rank_folder_writable_by_others_or_a_link_is_refused(tmp_path):
    folder = tmp_path / "open" / "rank0"
    folder.mkdir(parents=True)
    os.chmod(folder, 0o777)
    with pytest.raises(ductile.IoError, match=rf"\[zero\] nvme_path: the shard folder '{folder}' "
                                              r"has mode 0777, writable by its group or by "
                                              r"others"):
        nvme_engine(tmp_path / "open")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "linked").mkdir()
    os.symlink(elsewhere, tmp_path / "linked" / "rank0")
    with pytest.raises(ductile.IoError, match=r"rank0' is a symbolic link, not a directory of "
                                              r"this user"):
        nvme_engine(tmp_path / "linked")
    assert os.listdir(elsewhere) == []
    # A fresh one is created private.
    engine = nvme_engine(tmp_path / "fresh")
    try:
        assert os.stat(tmp_path / "fresh" / "rank0").st_mode & 0o777 == 0o700
    finally:
        engine.close()


def test_the_staging_bound_is_the_coordinators_for_its_configured_gathers_and_bucket():
    """The device bytes planned for host shards staged for gathers follow
    the [zero] section as the coordinator reads it: (gathers in flight + the
    fetch's own) buffers, each of the larger of a rank's share of the
    prefetch bucket and the largest shard; without the keys, the schema's
    defaults (2 gathers, a bucket of 5e7 elements)."""
    def bound(config):
        engine = zero3.initialize(make_model(layers=1), torch.optim.Adam, config)
        try:
            largest = max(g.shard_numel for g in engine._groups)
            assert {g.element_size for g in engine._groups} == {4}
            return engine._placement.staging_cap, largest
        finally:
            engine.close()

    three = CONFIG.replace("max_ongoing_fetch_events = 2", "max_ongoing_fetch_events = 3") \
        .replace("prefetch_bucket_size = 20000", "prefetch_bucket_size = 1e6")
    cap, largest = bound(three)
    assert largest < 1_000_000
    assert cap == (3 + 1) * 1_000_000 * 4
    one = CONFIG.replace("max_ongoing_fetch_events = 2", "max_ongoing_fetch_events = 1") \
        .replace("prefetch_bucket_size = 20000", "prefetch_bucket_size = 0")
    cap, largest = bound(one)
    assert cap == (1 + 1) * largest * 4
    defaults = CONFIG.replace("max_ongoing_fetch_events = 2\n", "") \
        .replace("prefetch_bucket_size = 20000\n", "")
    assert "max_ongoing" not in defaults and "prefetch_bucket" not in defaults
    cap, _ = bound(defaults)
    assert cap == (2 + 1) * 50_000_000 * 4
