"""The floor of an offloaded step on the machine it runs on (not a benchmark
by itself: bench_offload.py and bench_offload_step.py print it beside each
engine's step time).

  floor = max(a, b): the host's and the link's work overlap (the host steps
  a group while the next groups' gradients and parameters are on the link);

  a = adam_bytes / host_bandwidth: the bytes the cpu_adam plugin touches a
      step on a rank, per offloaded element: it reads the fp32 master, the
      fp32 gradient and the two fp32 moments (16 B) and writes the master
      and the moments (12 B), plus the bf16 rounded copy under bf16 (2 B):
      28 B in fp32, 30 B in bf16;
  b = to_host_bytes / d2h_bandwidth + to_device_bytes / h2d_bandwidth: the
      fp32 gradient shard to the host once a step, and the compute-dtype
      shard to the device once a pass (forward and backward) with the
      parameter shards on the host (offload_param), else once a step; one
      copy stream carries both directions in turn. On the cpu there is no
      link: b = 0 (n/a).

host_bandwidth: the median over 9 timings of torch.add(x, y, out=z) on 64 MiB
fp32 tensors (2 reads and a write a element: 3 x 4 B counted, as STREAM
counts), with the caller's torch threads, measured in each rank's process at
the same time as the other ranks (so each rank measures its share). d2h / h2d
bandwidth: the median over 9 copies of 256 MiB between pinned host memory and
the device, timed with cuda events.
"""

import statistics
import time

HOST_NUMEL = 16 << 20     # 64 MiB of fp32 a tensor
LINK_BYTES = 256 << 20
REPEATS = 9


def adam_bytes_per_element(precision):
    return 28 + (2 if precision == "bf16" else 0)


def host_bandwidth():
    """Bytes a second of torch.add over tensors far larger than the caches."""
    import torch
    x = torch.ones(HOST_NUMEL)
    y = torch.ones(HOST_NUMEL)
    z = torch.empty(HOST_NUMEL)
    torch.add(x, y, out=z)  # pages touched before timing
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        torch.add(x, y, out=z)
        times.append(time.perf_counter() - start)
    return 3 * HOST_NUMEL * 4 / statistics.median(times)


def link_bandwidth():
    """(device-to-host, host-to-device) bytes a second of pinned copies."""
    import torch
    host = torch.empty(LINK_BYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(LINK_BYTES, dtype=torch.uint8, device="cuda")
    out = []
    for target, source in ((host, device), (device, host)):
        target.copy_(source, non_blocking=True)
        times = []
        for _ in range(REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out.append(LINK_BYTES / statistics.median(times))
    del host, device, target, source
    # The engine's peak is read after: the measurement's buffers are not its.
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return tuple(out)


def measure(cuda):
    """What the floor needs of this machine, measured now."""
    record = {"host_bandwidth": host_bandwidth()}
    if cuda:
        record["d2h_bandwidth"], record["h2d_bandwidth"] = link_bandwidth()
    return record


def floor(measured, shard_numel, precision, param_on_host):
    """{a, b, floor} in seconds for a rank holding `shard_numel` offloaded
    elements (see the module's docstring); b is None on the cpu."""
    a = shard_numel * adam_bytes_per_element(precision) / measured["host_bandwidth"]
    b = None
    if "d2h_bandwidth" in measured:
        element = 2 if precision == "bf16" else 4
        to_device = shard_numel * element * (2 if param_on_host else 1)
        b = (shard_numel * 4 / measured["d2h_bandwidth"]
             + to_device / measured["h2d_bandwidth"])
    return {"a": a, "b": b, "floor": max(a, b or 0.0)}


def describe(measured, shard_numel, precision, param_on_host):
    """One line: the floor's terms and what they were measured at."""
    f = floor(measured, shard_numel, precision, param_on_host)
    adam = shard_numel * adam_bytes_per_element(precision)
    line = (f"floor {f['floor'] * 1e3:.1f} ms a step = max(a, b): a = CPU Adam "
            f"{adam / 1e6:.1f} MB a rank at {measured['host_bandwidth'] / 1e9:.2f} GB/s = "
            f"{f['a'] * 1e3:.1f} ms")
    if f["b"] is None:
        return line + "; b = host<->device n/a (cpu)"
    return line + (f"; b = host<->device at {measured['d2h_bandwidth'] / 1e9:.1f} GB/s to the "
                   f"host, {measured['h2d_bandwidth'] / 1e9:.1f} GB/s to the device = "
                   f"{f['b'] * 1e3:.1f} ms")
