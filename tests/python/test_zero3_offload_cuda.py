"""zero3's optimizer offload on a GPU (tools/gpu/on_device.sh's `offload`
stage runs it on a lent machine; without a CUDA device every case skips):
the tests' causal LM on cuda, one rank under torchrun (NCCL), trained with
everything on the GPU and with the optimizer offloaded to pinned host
memory, fp32 and bf16:

- the same losses (fp32 within 1e-5; bf16 within 1e-4 of bf16 on the GPU);
- steps after the first run under torch.cuda.set_sync_debug_mode("error"):
  the gradient copies to the host, the host steps and the copies back are
  ordered by streams and events, with no call that synchronises the host
  with a stream or the device (a host step waits only for the event of the
  gradient copy it reads);
- under max_device_memory below the model's needs, the engine's accounting
  stays within the budget at every step;
- with offload_param = "cpu" (every parameter shard in pinned host memory,
  copied to the GPU for each gather), the same losses;
- with offload_pipeline = true (each group's host step on a worker thread
  during backward, its copies on the copy stream), the losses of the serial
  offload bit for bit, under the same sync debug mode."""

import os
import sys

import pytest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_launch import CUDA_CONFIG, CUDA_ENV, launch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: torch.cuda.is_available() is False")

STEPS = 8
WORKER = os.path.join(HERE, "zero3_offload_worker.py")


PARAM_CONFIG = CUDA_CONFIG.replace("[zero]\n", "[zero]\noffload_param = \"cpu\"\n")
PIPELINED_CONFIG = CUDA_CONFIG.replace("[zero]\n", "[zero]\noffload_pipeline = true\n")
assert PARAM_CONFIG != CUDA_CONFIG != PIPELINED_CONFIG


def run(tmp, name, spec, config=CUDA_CONFIG):
    return launch(tmp, name, dict(spec, device="cuda"), ranks=1, launcher="torchrun",
                  config=config, env=CUDA_ENV, worker=WORKER, timeout=300)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3_offload_cuda")
    r = {}
    for precision in ("fp32", "bf16"):
        spec = {"steps": STEPS, "optimizer": "adamw", "sync_debug": True}
        if precision == "bf16":
            spec["precision"] = "bf16"
        r[precision] = run(tmp, precision, spec)
        r[precision + "_offload"] = run(tmp, precision + "_offload", dict(spec, offload="cpu"))
        r[precision + "_pipelined"] = run(tmp, precision + "_pipelined", dict(spec, offload="cpu"),
                                          config=PIPELINED_CONFIG)
        spec.pop("sync_debug")  # a gather from host shards is waited for by the host
        r[precision + "_param"] = run(tmp, precision + "_param", spec, config=PARAM_CONFIG)
    budget = min(r["fp32"]["high_water"].values()) - 1
    r["budget"] = run(tmp, "budget", {"steps": STEPS, "optimizer": "adamw", "budget": budget})
    return r


@pytest.mark.parametrize("precision,tolerance", [("fp32", 1e-5), ("bf16", 1e-4)])
def test_offload_on_a_gpu_trains_as_on_the_gpu_without_host_waits(runs, precision, tolerance):
    device, offload = runs[precision], runs[precision + "_offload"]
    assert len(offload["stats"]["offloaded_groups"]) == offload["stats"]["groups"]
    for s in range(STEPS):
        a, b = offload["losses"][str(s)], device["losses"][str(s)]
        assert abs(a - b) <= tolerance * abs(b), f"step {s}: loss {a} vs {b}"
    assert offload["stats"]["offload_steps"] == STEPS * offload["stats"]["groups"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_offload_pipeline_on_a_gpu_trains_bit_for_bit_as_the_serial_offload(runs, precision):
    serial, pipelined = runs[precision + "_offload"], runs[precision + "_pipelined"]
    assert pipelined["losses"] == serial["losses"]
    groups = pipelined["stats"]["groups"]
    assert pipelined["stats"]["offload_pipelined_steps"] == STEPS * groups
    assert serial["stats"]["offload_pipelined_steps"] == 0


def test_a_budget_on_a_gpu_holds_at_every_step(runs):
    result = runs["budget"]
    budget = result["stats"]["max_device_memory"]
    assert 0 < len(result["stats"]["offloaded_groups"]) < result["stats"]["groups"]
    for s in range(STEPS):
        assert 0 < result["high_water"][str(s)] <= budget
        a, b = result["losses"][str(s)], runs["fp32"]["losses"][str(s)]
        assert abs(a - b) <= 1e-5 * abs(b), f"step {s}: loss {a} vs {b}"


@pytest.mark.parametrize("precision,tolerance", [("fp32", 1e-5), ("bf16", 1e-4)])
def test_parameter_shards_in_host_memory_train_as_on_the_gpu(runs, precision, tolerance):
    device, param = runs[precision], runs[precision + "_param"]
    stats = param["stats"]
    assert len(stats["host_shard_groups"]) == stats["groups"]
    assert stats["placement"]["parameters"]["device"] == 0
    for s in range(STEPS):
        a, b = param["losses"][str(s)], device["losses"][str(s)]
        assert abs(a - b) <= tolerance * abs(b), f"step {s}: loss {a} vs {b}"
