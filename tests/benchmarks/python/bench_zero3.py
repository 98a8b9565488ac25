"""The ZeRO-3 race: one Hugging Face model, one batch, engines one after
another in one run (a program that prints figures, medians; not a test):

- ddp: torch DistributedDataParallel;
- fsdp2: torch's fully_shard (FSDP2), one unit per transformer block plus
  the root;
- deepspeed: DeepSpeed 0.19.7 ZeRO stage 3 (its cpu accelerator over gloo
  on the cpu);
- ductile: ductile.torch.zero3 under torchrun, torch.distributed's process
  group as its world (gloo on the cpu, NCCL on cuda; no MPI);
- ductile-mpi: the same under mpirun, over the accelerator's own world
  (Open MPI on the cpu; ductile's NCCL over an MPI bootstrap on cuda);
- ductile-noprefetch: ductile with prefetch_bucket_size = 0 (every gather
  waited): prefetch must never make the gather wait longer than this;
- ductile-logging: ductile with log_interval = 1, its progress line on
  every step written to stderr (logging at INFO): what the logging costs;
- ductile-snapshots: ductile with a snapshot of every step in memory
  (DUCTILE_SNAPSHOT_DIR in /dev/shm, as `ductile agent` gives it; the
  ranks are one node's, rank 0 commits): what writing them costs (the
  agents' copies to other nodes are not part of it);
- ductile-snapshots-alternate: the same with snapshot_interval = 2, so that
  its steps alternate with and without a snapshot: the difference of the
  two medians within one run is a snapshot's cost, untouched by the drift
  between runs that a race of whole runs on a shared machine sees.
- ductile-snapshots-overlap: ductile-snapshots with engine.snapshot_overlap:
  each snapshot's shard file copied, checksummed and written on a thread
  while the next step's forward and backward run, committed before its
  update.
  For the three, the median time the training thread was blocked per
  snapshot (engine.stats()'s snapshot_blocked_ns) and its ratio to a step
  without one.

ZeRO-3 engines get the same settings (prefetch bucket, live limit, reuse
distance, persistence threshold); every engine trains with torch.optim.Adam,
in fp32 or bf16 (--precision: autocast for DDP, FSDP2's MixedPrecisionPolicy,
DeepSpeed's bf16 section, ductile's MixedPrecision("bf16"); fp32 masters and
reduction everywhere).

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_zero3.py \\
      [--steps N] [--engines a,b,...] [--size race|small|overhead|gpu]
      [--device cpu|cuda] [--ranks N] [--batch B] [--precision fp32|bf16]
      [--calls] [--gpu-profile] [--compile]

Sizes: race (GPT-2 of 41.7 M parameters, 2 x 128 tokens a rank); overhead
(24 GPT-2 blocks of width 64, 2 x 16 tokens a rank: the compute is tiny, so
a step is the framework's own host work); gpu (GPT-2 medium's shape).

--calls: after the timed steps, rank 0 runs 3 more under cProfile and prints
the Python function calls per step (all, and ductile's own), and the calls
that can block the host on a GPU (collective waits and completion polls,
.item(), synchronize). --gpu-profile (cuda): 3 more steps under
torch.profiler: the GPU's idle time per step (the step's wall time minus
the union of its kernels and copies) and the CUDA runtime's synchronising
calls per step. --compile: torch.compile on each transformer block, the
engines' hooks outside the compiled regions (as torchtitan does with FSDP2;
DeepSpeed is left out: its ZeRO-3 hooks live inside the blocks); the warm-up
steps absorb the compilation.

With --device cuda (tools/gpu/ runs it on a lent GPU): one rank on one GPU;
step times after torch.cuda.synchronize(), peak =
torch.cuda.max_memory_allocated above what was allocated before the model.

Per engine, one line in this shape:
  engine <name>: step <ms> ms, x<ratio> DeepSpeed, x<ratio> FSDP2, peak <MiB> MiB/rank
      (before the first step <MiB>)
then the parameter and optimizer bytes per rank, the first losses (the
engines agree), and for ductile the gather wait per step. Step: median over
the measured steps of rank 0's forward + backward + optimizer step. Peak
(cpu): the largest resident set of the ranks during the run, above the one
each had right before building its model (libraries and interpreter left
out, as they differ between engines); in brackets, the same once the engine
is built, before its first step. glibc keeps freed memory mapped (its heap
and arenas; buffers it mapped on their own only above a threshold that
rises with the sizes freed), so the resident set holds 0.5-0.8 GB more than
the live tensors of the race size and moves by 100 MB between runs of one
engine. Run with MALLOC_MMAP_THRESHOLD_=1048576 (every engine inherits it)
to make glibc map each buffer of 1 MiB or more alone and unmap it when
freed: the peak is then that of the memory in use (step times grow by a
third: every such buffer is faulted in anew).
"""

import argparse
import contextlib
import json
import logging
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

SIZES = {
    # 44.9 M parameters (GPT-2 architecture, 8 layers of 512, 32k vocabulary).
    "race": dict(n_embd=512, n_layer=8, n_head=8, vocab_size=32000, n_positions=256),
    "small": dict(n_embd=128, n_layer=4, n_head=4, vocab_size=4096, n_positions=256),
    # 354 M parameters (GPT-2 medium's shape) for a GPU.
    "gpu": dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024),
    # Many small modules and tiny compute: the framework's own host work.
    "overhead": dict(n_embd=64, n_layer=24, n_head=4, vocab_size=1024, n_positions=64),
}
CONTEXTS = {"overhead": 16}
CONTEXT = 128  # tokens a sequence, unless CONTEXTS says otherwise
BATCH = 2      # sequences per rank unless --batch (global) says otherwise
WARMUP = 3
PREFETCH = 20_000_000
MAX_LIVE = 60_000_000
REUSE = 0
PERSIST = 100_000

DUCTILE_CONFIG = f"""
[accelerator]
backend = "{{backend}}"
communicator = "auto"
timeout = 600

[zero]
coordinator = "partitioned"
prefetch_bucket_size = {{prefetch}}
max_live_parameters = {MAX_LIVE}
max_reuse_distance = {REUSE}
param_persistence_threshold = {PERSIST}
max_ongoing_fetch_events = 2
log_interval = {{log_interval}}
snapshot_interval = {{snapshot_interval}}
"""

# ductile-deepspeed: the deepspeed engine's code and config as they are,
# with `import ductile.deepspeed as deepspeed` (docs/deepspeed.md).
ENGINES = ("ddp", "fsdp2", "deepspeed", "ductile", "ductile-deepspeed", "ductile-mpi",
           "ductile-noprefetch", "ductile-logging", "ductile-snapshots",
           "ductile-snapshots-alternate", "ductile-snapshots-overlap")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_model(size, device, compile_blocks=False):
    """GPT-2 of `size`, built on `device` (on cuda, initialised there: the
    same values for every engine of a run); with `compile_blocks`, each
    transformer block wrapped by torch.compile."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        attn_implementation="eager", **SIZES[size])
    with torch.device(device):
        model = GPT2LMHeadModel(config)
    if compile_blocks:
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = torch.compile(block)
    return model


def batch(step, rank, world, vocab, size, context):
    import torch
    g = torch.Generator().manual_seed(7000 + step)
    ids = torch.randint(0, vocab, (size, context), generator=g)
    per = size // world
    return ids[rank * per:(rank + 1) * per]


def tensor_bytes(tensors):
    import torch
    seen, total = set(), 0
    for t in tensors:
        if not torch.is_tensor(t) or t.dim() == 0:
            continue
        local = getattr(t, "_local_tensor", t)  # a DTensor's shard
        key = (local.data_ptr(), local.numel())
        if key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def optimizer_bytes(optimizer):
    return tensor_bytes([t for st in optimizer.state.values() for t in st.values()])


# Built-in calls that can block the host on a GPU, by name.
BLOCKING = re.compile(r"\b(wait|item|tolist|synchronize|is_completed|query)\b")


def count_calls(stats, steps):
    """Python function calls per step: all, ductile's own, and the ones that
    can block the host on a GPU (by name), from a pstats.Stats."""
    import ductile
    # The package's own files (a checkout folder may be named "ductile" too).
    package = os.path.dirname(os.path.abspath(ductile.__file__)) + os.sep
    total = ours = 0
    blocking = {}
    for (path, _, name), (_, calls, _, _, _) in stats.stats.items():
        total += calls
        if path.startswith(package):
            ours += calls
        if path == "~" and BLOCKING.search(name):
            blocking[name] = blocking.get(name, 0) + calls
    return {"calls": total / steps, "ductile_calls": ours / steps,
            "blocking": {k: v / steps for k, v in sorted(blocking.items())}}


def gpu_profile(train_step, next_ids, steps):
    """GPU idle time and synchronising runtime calls per step (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("bench_steps"):
            for _ in range(steps):
                train_step(next_ids())
            torch.cuda.synchronize()
    events = prof.events()
    window = next(e for e in events if e.name == "bench_steps").time_range
    spans = sorted((max(e.time_range.start, window.start), min(e.time_range.end, window.end))
                   for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, window.start
    for start, stop in spans:
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    wall = window.end - window.start
    syncs = {}
    for e in events:
        if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                      "cudaMemcpy", "cudaStreamWaitEvent"):
            syncs[e.name] = syncs.get(e.name, 0) + 1
    return {"wall_ms": wall / 1e3 / steps, "busy_ms": busy / 1e3 / steps,
            "idle_ms": (wall - busy) / 1e3 / steps,
            "syncs": {k: v / steps for k, v in sorted(syncs.items())}}


def worker(engine_name, size, steps, out, device, global_batch, precision, calls, profile_gpu,
           compile_blocks):
    import torch
    import torch.distributed as dist

    import transformers  # noqa: F401  (before the baseline: every engine imports it)

    torch.set_num_threads(1)
    cuda = device == "cuda"
    bf16 = precision == "bf16"
    context = CONTEXTS.get(size, CONTEXT)
    launched_by_mpi = "OMPI_COMM_WORLD_RANK" in os.environ
    if cuda:
        torch.cuda.set_device(0)
    if not launched_by_mpi:
        dist.init_process_group("nccl" if cuda else "gloo")
    if engine_name == "deepspeed":
        import deepspeed  # imported before the baseline: its own memory is not the model's
    elif engine_name == "ductile-deepspeed":
        import ductile.deepspeed as deepspeed
    if engine_name.startswith("ductile"):
        import ductile.torch.zero3 as zero3
    baseline = torch.cuda.memory_allocated() if cuda else rss_bytes()
    model = build_model(size, device, compile_blocks)
    vocab = model.config.vocab_size
    numel = sum(p.numel() for p in model.parameters())
    stats_of = None
    autocast = torch.autocast(device, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    if engine_name == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[0] if cuda else None)
        optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-4)
        rank, world = dist.get_rank(), dist.get_world_size()

        def train_step(ids):
            with autocast:
                loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        def param_bytes():
            return tensor_bytes(list(model.parameters()))
    elif engine_name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(device, (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if bf16 else MixedPrecisionPolicy()
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

        def train_step(ids):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        def param_bytes():
            return tensor_bytes(list(model.parameters()))
    elif engine_name in ("deepspeed", "ductile-deepspeed"):
        rank, world = dist.get_rank(), dist.get_world_size()
        config = {
            "train_micro_batch_size_per_gpu": global_batch // world, "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {
                "stage": 3, "stage3_prefetch_bucket_size": PREFETCH,
                "stage3_max_live_parameters": MAX_LIVE, "stage3_max_reuse_distance": REUSE,
                "stage3_param_persistence_threshold": PERSIST, "overlap_comm": True,
                "contiguous_gradients": True},
        }
        if bf16:
            config["bf16"] = {"enabled": True}
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        ds_engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                             config=config)

        def train_step(ids):
            loss = ds_engine(input_ids=ids, labels=ids).loss
            ds_engine.backward(loss)
            ds_engine.step()
            return loss

        if engine_name == "deepspeed":
            def param_bytes():
                return tensor_bytes([p.ds_tensor for p in model.parameters()])
            optimizer = ds_optimizer.optimizer
        else:
            def param_bytes():
                s = ds_engine.zero3.stats()
                return s["shard_bytes"] + s["master_bytes"]
            optimizer = ds_optimizer
            stats_of = ds_engine.zero3.stats
    else:
        prefetch = 0 if engine_name == "ductile-noprefetch" else PREFETCH
        log_interval = 1 if engine_name == "ductile-logging" else 0
        if log_interval:
            logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-4),
                                  DUCTILE_CONFIG.format(
                                      prefetch=prefetch, backend=device, log_interval=log_interval,
                                      snapshot_interval=2 if engine_name.endswith("alternate")
                                      else 1),
                                  mixed_precision="bf16" if bf16 else None)
        engine.snapshot_overlap = engine_name.endswith("overlap")
        optimizer = engine.optimizer
        rank, world = engine.rank, engine.world_size

        def train_step(ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss

        def param_bytes():
            s = engine.stats()
            return s["shard_bytes"] + s["master_bytes"]
        stats_of = engine.stats

    per_rank = global_batch // world
    # The high-water mark once the engine is built, before any step: whether
    # a peak comes from setting up (the full model and its shards at once)
    # or from the steps.
    setup_peak = None if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    step_number = [0]

    def next_ids():
        ids = batch(step_number[0], rank, world, vocab, global_batch, context).to(device)
        step_number[0] += 1
        return ids
    assert per_rank * world == global_batch

    times, losses, waits, blocked = [], [], [], []
    before = stats_of() if stats_of else None
    # BENCH_ZERO3_PROFILE=<engine>:<file>: rank 0 of that engine writes the
    # host-side profile (cProfile, by cumulative time) of its steps there.
    profile_engine, _, profile_path = os.environ.get("BENCH_ZERO3_PROFILE", "").partition(":")
    profiler = None
    if profile_engine == engine_name and rank == 0:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    for s in range(WARMUP + steps):
        ids = next_ids()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train_step(ids)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if stats_of:
            after = stats_of()
            waits.append((after["fetch_wait_ns"] - before["fetch_wait_ns"]) / 1e9)
            # The training thread's time blocked per snapshot (its write and
            # commit, then the wait for its replicas at the next step), for
            # the snapshots whose time was complete at this step.
            timed = after.get("snapshots_timed", 0) - before.get("snapshots_timed", 0)
            if timed and s >= WARMUP:
                blocked.append((after["snapshot_blocked_ns"] - before["snapshot_blocked_ns"])
                               / timed / 1e9)
            before = after
    if profiler:
        import pstats
        profiler.disable()
        with open(profile_path, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(40)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - baseline
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    record = {"rank": rank, "times": times[WARMUP:], "losses": losses[:3], "numel": numel,
              "peak": peak, "setup_peak": setup_peak, "param_bytes": param_bytes(),
              "optimizer_bytes": optimizer_bytes(optimizer), "waits": waits[WARMUP:],
              "snapshot_blocked": blocked}
    if calls:
        import cProfile
        import pstats
        profiled = cProfile.Profile()
        ids = [next_ids() for _ in range(3)]
        start = stats_of() if stats_of else None
        profiled.enable()
        for i in range(3):
            train_step(ids[i])
        profiled.disable()
        record["calls"] = count_calls(pstats.Stats(profiled), 3)
        if start is not None:
            # The host world's waits in C++ (planned gathers), which
            # cProfile does not see.
            end = stats_of()
            for key, name in (("host_world_waits", "host world (C++): wait"),
                              ("host_world_polls", "host world (C++): is_completed")):
                if end[key] > start[key]:
                    record["calls"]["blocking"][name] = (end[key] - start[key]) / 3
    if profile_gpu and cuda:
        record["gpu"] = gpu_profile(train_step, next_ids, 3)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(record, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(engine, args, folder):
    out = os.path.join(folder, engine + ".json")
    ranks = args.ranks
    script = [os.path.abspath(__file__), "--worker", engine, "--size", args.size, "--steps",
              str(args.steps), "--out", out, "--device", args.device, "--batch", str(args.batch),
              "--ranks", str(ranks), "--precision", args.precision]
    script += ["--calls"] if args.calls else []
    script += ["--gpu-profile"] if args.gpu_profile else []
    script += ["--compile"] if args.compile else []
    if engine == "ductile-mpi":
        command = [os.environ.get("DUCTILE_MPIEXEC", "mpirun"), "--allow-run-as-root",
                   "--oversubscribe", "--mca", "btl", "self,vader", "--bind-to", "none", "-np",
                   str(ranks), sys.executable] + script
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port())] + script
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=args.device,
               PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    env.pop("DUCTILE_SNAPSHOT_DIR", None)
    snapshots = engine.startswith("ductile-snapshots")
    if snapshots:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        env["DUCTILE_SNAPSHOT_DIR"] = tempfile.mkdtemp(prefix="bench-zero3-snapshots-", dir=shm)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    finally:
        if snapshots:
            shutil.rmtree(env["DUCTILE_SNAPSHOT_DIR"], ignore_errors=True)
    if proc.returncode != 0:
        return None, (proc.stdout + proc.stderr)[-3000:]
    records = []
    for r in range(ranks):
        with open(f"{out}.rank{r}") as f:
            records.append(json.load(f))
    return records, None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--size", default="race", choices=sorted(SIZES))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--ranks", type=int, help="processes (default: 2 on the cpu, 1 on cuda: "
                        "NCCL refuses two ranks on one device)")
    parser.add_argument("--batch", type=int, help="global batch in sequences (default: 2 a rank)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--calls", action="store_true")
    parser.add_argument("--gpu-profile", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--worker")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.ranks is None:
        args.ranks = 1 if args.device == "cuda" else 2
    if args.batch is None:
        args.batch = BATCH * args.ranks
    if args.ranks < 1 or args.batch < args.ranks or args.batch % args.ranks:
        parser.error(f"--batch {args.batch} must be a positive multiple of the {args.ranks} ranks")
    if args.worker:
        worker(args.worker, args.size, args.steps, args.out, args.device, args.batch,
               args.precision, args.calls, args.gpu_profile, args.compile)
        return
    engines = args.engines.split(",")
    if args.compile and "deepspeed" in engines:
        parser.error("--compile: leave deepspeed out of --engines (its hooks are inside the "
                     "blocks)")
    results, failures = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for engine in engines:
            ranks, error = launch(engine, args, folder)
            if ranks is None:
                failures[engine] = error
            else:
                results[engine] = ranks
    report(args, engines, results, failures)


def report(args, engines, results, failures):
    first = next(iter(results.values()), None)
    if first:
        where = f"{args.ranks} rank(s) on one GPU" if args.device == "cuda" \
            else f"{args.ranks} rank(s) (1 thread each)"
        compiled = ", blocks under torch.compile" if args.compile else ""
        print(f"model: GPT-2 {SIZES[args.size]}, {first[0]['numel']:,} parameters; global batch "
              f"{args.batch} x {CONTEXTS.get(args.size, CONTEXT)} tokens on {where}, "
              f"{args.precision}, Adam{compiled}; medians of {args.steps} steps after {WARMUP} "
              "warm-up")
    med = {e: statistics.median(r[0]["times"]) for e, r in results.items()}

    def ratio(engine, rival):
        return f"x{med[engine] / med[rival]:.2f}" if rival in med else "x-"
    for engine in engines:
        if engine in failures:
            print(f"engine {engine}: did not run: {failures[engine].strip().splitlines()[-1]}")
            continue
        r = results[engine]
        peak = max(x["peak"] for x in r) / 2**20
        setup = "" if r[0]["setup_peak"] is None else \
            f" (before the first step {max(x['setup_peak'] for x in r) / 2**20:.0f})"
        print(f"engine {engine}: step {med[engine] * 1e3:.1f} ms, {ratio(engine, 'deepspeed')} "
              f"DeepSpeed, {ratio(engine, 'fsdp2')} FSDP2, peak {peak:.0f} MiB/rank{setup}")
    for engine in ("ductile-snapshots", "ductile-snapshots-overlap"):
        if "ductile" in med and engine in med:
            print(f"{engine}, a snapshot every step: "
                  f"{(med[engine] / med['ductile'] - 1) * 100:+.2f}% of ductile's step")
    if "ductile-snapshots-alternate" in med:
        # Steps after the warm-up: the first makes global_step WARMUP + 1.
        times = results["ductile-snapshots-alternate"][0]["times"]
        first = 0 if (WARMUP + 1) % 2 == 0 else 1
        with_one = statistics.median(times[first::2])
        without = statistics.median(times[1 - first::2])
        print(f"a snapshot, within one run (steps alternating): {(with_one - without) * 1e3:+.1f} "
              f"ms, {(with_one / without - 1) * 100:+.2f}% of a step without one "
              f"({without * 1e3:.1f} ms)")
    for engine in ("ductile-snapshots", "ductile-snapshots-alternate",
                   "ductile-snapshots-overlap"):
        blocked = results[engine][0]["snapshot_blocked"] if engine in results else None
        if blocked:
            # Against a step without a snapshot: ductile's (the alternating
            # run's own steps without one).
            step = without if engine.endswith("alternate") else med.get("ductile")
            against = f", {statistics.median(blocked) / step * 100:.2f}% of a step without " \
                f"one ({step * 1e3:.1f} ms)" if step else ""
            print(f"{engine}: the training thread blocked {statistics.median(blocked) * 1e3:.1f} "
                  f"ms per snapshot (median of {len(blocked)}; write and commit, then the wait "
                  f"for its replicas){against}")
    if "ductile" in med and "ductile-logging" in med:
        print(f"logging every step: {(med['ductile-logging'] / med['ductile'] - 1) * 100:+.2f}% "
              "of ductile's step")
    print()
    for engine, r in results.items():
        print(f"  {engine:20} parameters {max(x['param_bytes'] for x in r) / 2**20:8.1f} MiB/rank"
              f"  optimizer {max(x['optimizer_bytes'] for x in r) / 2**20:8.1f} MiB/rank"
              f"  first losses {', '.join(f'{v:.5f}' for v in r[0]['losses'])}")
    for engine in ("ductile", "ductile-deepspeed", "ductile-noprefetch", "ductile-mpi",
                   "ductile-logging", "ductile-snapshots", "ductile-snapshots-overlap"):
        if engine in results and results[engine][0]["waits"]:
            print(f"  {engine}: gather wait {statistics.median(results[engine][0]['waits']) * 1e3:.1f}"
                  " ms per step (median)")
    for engine, r in results.items():
        c = r[0].get("calls")
        if c:
            blocking = ", ".join(f"{k} {v:g}" for k, v in c["blocking"].items()) or "none"
            print(f"  {engine:20} Python calls/step {c['calls']:8.0f} (ductile's "
                  f"{c['ductile_calls']:6.0f}); host-blocking candidates/step: {blocking}")
    for engine, r in results.items():
        g = r[0].get("gpu")
        if g:
            syncs = ", ".join(f"{k} {v:g}" for k, v in g["syncs"].items()) or "none"
            print(f"  {engine:20} GPU per step: wall {g['wall_ms']:.1f} ms, busy "
                  f"{g['busy_ms']:.1f} ms, idle {g['idle_ms']:.1f} ms; runtime syncs/step: {syncs}")
    for engine, error in failures.items():
        print(f"\n{engine} failed:\n{error}")


if __name__ == "__main__":
    main()
