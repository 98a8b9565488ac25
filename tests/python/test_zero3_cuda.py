"""ZeRO-3 on a GPU (tools/gpu/ runs it on a lent machine; without a CUDA
device every case skips, and ctest reports the file skipped): the tests'
causal LM trained on cuda by plain torch and through ductile.torch.zero3
with the accelerator backend "cuda", on one GPU:

- under torchrun, torch.distributed's NCCL process group is zero3's world
  (ductile's HostWorld) and torch's current stream its compute stream;
- under mpirun, the cuda accelerator's own NCCL communicator is the world
  (bootstrapped by Open MPI).

Both must give plain torch's losses and parameters, gather from a pool that
stops allocating once the trace runs, hold only their shard outside a
fetch, and run steps without the host ever waiting for the GPU."""

import os
import sys

import pytest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_launch import CUDA_CONFIG, CUDA_ENV, launch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: torch.cuda.is_available() is False")

STEPS = 20
ENV = CUDA_ENV


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3_cuda")
    spec = {"steps": STEPS, "device": "cuda"}
    r = {"plain": launch(tmp, "plain", dict(spec, mode="plain"), config=CUDA_CONFIG, env=ENV)}
    for launcher in ("torchrun", "mpirun"):
        r[launcher] = launch(tmp, launcher, dict(spec, mode="zero3", sync_debug=True), ranks=1,
                             launcher=launcher, config=CUDA_CONFIG, env=ENV)
    return r


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_one_gpu_trains_as_plain_torch(runs, launcher):
    plain, plain_params, _ = runs["plain"]
    result, params, _ = runs[launcher]
    assert result["stats"]["world"] == ("torch.distributed (nccl)" if launcher == "torchrun"
                                        else "accelerator"), result["stats"]["world"]
    for s in range(STEPS):
        a, b = result["losses"][str(s)], plain["losses"][str(s)]
        assert abs(a - b) <= 1e-5 * abs(b), f"step {s}: loss {a} vs {b}"
    assert params.keys() == plain_params.keys()
    for name, ref in plain_params.items():
        assert params[name].device.type == "cuda"
        diff = (params[name] - ref).abs().max().item()
        assert diff <= 1e-5 * ref.abs().max().item(), f"{name}: max difference {diff}"
    assert result["losses"][str(STEPS - 1)] < 0.8 * result["losses"]["0"]


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_gathers_reuse_pooled_device_memory_once_the_trace_runs(runs, launcher):
    result = runs[launcher][0]
    assert result["memory"]["placeholder_numel"] == 0
    steps = result["per_step"]
    assert steps[0]["gather_allocations"] > 0
    assert all(s["gather_allocations"] == 0 for s in steps[2:]), steps
    assert all(s["prefetched_params"] > 0 for s in steps[1:]), steps


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_the_host_never_waits_for_the_gpu_during_a_step(runs, launcher):
    """Forward, backward, clipping and the optimizer step under
    torch.cuda.set_sync_debug_mode("error") (the worker fails on any
    synchronising call), and no fetch blocked the host on a gather."""
    debug = runs[launcher][0]["sync_debug"]
    assert debug["steps"] == 3
    assert debug["fetch_wait_ns"] == 0, debug


def test_shards_reach_the_host_through_two_reused_pinned_buffers(tmp_path):
    """A checkpoint's or snapshot's CUDA shards go to the file through the
    engine's DeviceStaging: copies on its own stream that wait for the
    compute stream's work (a kernel still queued behind a long sleep when
    the save starts is in the bytes), two pinned buffers reused by every
    save, and the file's bytes those of the tensors, in order, across a
    buffer's end and with CPU tensors (Adam's step) among them."""
    from ductile.torch.zero3._checkpoint_files import _BATCH_BYTES, DeviceStaging, write_file
    generator = torch.Generator(device="cuda").manual_seed(3)
    tensors = [torch.randn(n, device="cuda", generator=generator)
               for n in (5, _BATCH_BYTES // 4 + 7, 1 << 20)]
    tensors += [torch.arange(10, dtype=torch.int64), torch.tensor(3.0)]
    staging = DeviceStaging()
    assert staging.stream != torch.cuda.current_stream()
    assert all(b.is_pinned() for b in staging.buffers)
    pointers = [b.data_ptr() for b in staging.buffers]
    for round in range(2):
        torch.cuda._sleep(200_000_000)  # the compute stream is busy a while...
        tensors[1].mul_(2)  # ...before this runs, still queued when the save starts
        path = tmp_path / f"shard{round}.bin"
        size, _ = write_file(str(path), staging.copies(tensors), durable=False)
        expected = b"".join(t.cpu().numpy().tobytes() for t in tensors)
        assert size == len(expected)
        assert path.read_bytes() == expected
        assert [b.data_ptr() for b in staging.buffers] == pointers


def test_a_snapshot_thread_copies_after_the_training_threads_event(tmp_path):
    """engine.snapshot_overlap's thread: the copies on the staging stream
    wait for the event the training thread recorded after the step (a
    kernel queued behind a long sleep before it is in the bytes), on the
    thread's own device context."""
    import threading

    from ductile.torch.zero3._checkpoint_files import DeviceStaging, write_file
    tensors = [torch.ones(1 << 20, device="cuda"), torch.arange(7, dtype=torch.int64)]
    staging = DeviceStaging()
    torch.cuda._sleep(200_000_000)
    tensors[0].mul_(3)  # still queued when the thread starts
    after = torch.cuda.Event()
    after.record()
    path = tmp_path / "shard.bin"
    result = []

    def write():
        with torch.cuda.device(torch.cuda.current_device()):
            result.append(write_file(str(path), staging.copies(tensors, after), durable=False))

    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    expected = b"".join(t.cpu().numpy().tobytes() for t in tensors)
    assert result[0][0] == len(expected) and path.read_bytes() == expected


def test_snapshots_go_from_the_device_into_the_pinned_mapping_of_their_file(tmp_path):
    """engine.snapshot_overlap on one GPU (torchrun): each step's snapshot is
    copied by the copy engine straight into its shard file's mapping,
    registered as pinned memory, on a stream that waits for the step; step()
    never waits for the device on the training thread (no synchronize of
    the device, a stream or an event; no item, cpu, tolist or float of a
    cuda tensor); every committed file is byte for byte the one write_file
    writes from its header and the step's values, with write_file's size and
    CRC-32C, across the header's growth at step 10; close() lets the
    mappings go."""
    steps = 12
    result, _, _ = launch(tmp_path, "snapshots", {"steps": steps}, ranks=1, launcher="torchrun",
                          config=CUDA_CONFIG + "snapshot_replicas = 0\n",
                          env=dict(ENV, DUCTILE_SNAPSHOT_DIR=str(tmp_path / "own")),
                          worker=os.path.join(HERE, "zero3_snapshot_cuda_worker.py"))
    assert result["waits"] == [], result["waits"]
    assert result["pinned"] == [True]
    checks = result["checks"]
    assert checks and all(c["same_bytes"] and c["same_record"] for c in checks), checks
    assert len(checks) + result["skipped"] == steps and checks[-1]["step"] == steps, result
    assert result["mappings_after_close"] == 0


def test_a_progress_line_waits_for_its_copies_without_synchronising():
    """The progress line's values on cuda: copied into pinned memory behind
    an event, a poll() before the event completes writes nothing and never
    synchronises (sync debug mode "error"), flush() waits and writes the
    values the tensors had at the step."""
    from ductile.torch.zero3._progress import Lines
    written = []
    lines = Lines()
    lr = torch.full((), 0.5, device="cuda")
    counts = torch.tensor([4, 64], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.cuda._sleep(500_000_000)  # the copies queue behind this
        lines.add({"lr": lr, "counts": counts, "step": 7}, written.append)
        lr.fill_(0.25)  # the next step's value: not the line's
        lines.poll()
        assert written == []
    finally:
        torch.cuda.set_sync_debug_mode(0)
    lines.flush()
    assert written == [{"lr": 0.5, "counts": [4, 64], "step": 7}]
