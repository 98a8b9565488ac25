"""The ZeRO-3 race (issue 22, item 7): one Hugging Face model, one batch,
2 ranks on the cpu, engines one after another in one run (a program that
prints figures, medians; not a test):

- ddp: torch DistributedDataParallel over gloo;
- fsdp2: torch's fully_shard (FSDP2) over gloo, one unit per transformer
  block plus the root;
- deepspeed: DeepSpeed 0.19.7 ZeRO stage 3 on its cpu accelerator over gloo;
- ductile: ductile.torch.zero3 under torchrun, torch.distributed's gloo
  process group as its world (no MPI);
- ductile-mpi: the same under mpirun, over Open MPI (a second transport,
  for reference);
- ductile-noprefetch: ductile with prefetch_bucket_size = 0 (every gather
  waited): prefetch must never make the gather wait longer than this.

ZeRO-3 engines get the same settings (prefetch bucket, live limit, reuse
distance, persistence threshold); every engine trains fp32 with torch.optim.Adam.

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_zero3.py \\
      [--steps N] [--engines a,b,...] [--size small|race|gpu] [--device cpu|cuda]
      [--batch B]

With --device cuda (tools/gpu/ runs it on a lent GPU): one rank on one GPU,
torch.distributed over NCCL, the ductile config's backend "cuda" (its world is
torch's NCCL process group; ductile-mpi: ductile's own NCCL communicator,
bootstrapped by Open MPI); step times after torch.cuda.synchronize(), peak =
torch.cuda.max_memory_allocated above what was allocated before the model.

Per engine, one line exactly in the issue's shape:
  engine <name>: step <ms> ms, x<ratio> DeepSpeed, x<ratio> FSDP2, peak <MiB> MiB/rank
then the parameter and optimizer bytes per rank, the first losses (the
engines agree), and for ductile the gather wait per step. Step: median over
the measured steps of rank 0's forward + backward + optimizer step. Peak:
the largest resident set of the two ranks during the run, above the one
each had right before building its model (libraries and interpreter left
out, as they differ between engines).
"""

import argparse
import json
import os
import resource
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
}
CONTEXT = 128
BATCH = 4      # global: 2 sequences per rank
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
"""

ENGINES = ("ddp", "fsdp2", "deepspeed", "ductile", "ductile-mpi", "ductile-noprefetch")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_model(size):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        attn_implementation="eager", **SIZES[size])
    return GPT2LMHeadModel(config)


def batch(step, rank, world, vocab, size):
    import torch
    g = torch.Generator().manual_seed(7000 + step)
    ids = torch.randint(0, vocab, (size, CONTEXT), generator=g)
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


def worker(engine_name, size, steps, out, device, global_batch):
    import torch
    import torch.distributed as dist

    import transformers  # noqa: F401  (before the baseline: every engine imports it)

    torch.set_num_threads(1)
    cuda = device == "cuda"
    launched_by_mpi = "OMPI_COMM_WORLD_RANK" in os.environ
    if cuda:
        torch.cuda.set_device(0)
    if not launched_by_mpi:
        dist.init_process_group("nccl" if cuda else "gloo")
    if engine_name == "deepspeed":
        import deepspeed  # imported before the baseline: its own memory is not the model's
    if engine_name.startswith("ductile"):
        import ductile.torch.zero3 as zero3
    baseline = torch.cuda.memory_allocated() if cuda else rss_bytes()
    model = build_model(size)
    if cuda:
        model = model.cuda()
    vocab = model.config.vocab_size
    numel = sum(p.numel() for p in model.parameters())
    stats_of = None
    if engine_name == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[0] if cuda else None)
        optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-4)
        rank, world = dist.get_rank(), dist.get_world_size()

        def train_step(ids):
            loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        def param_bytes():
            return tensor_bytes(list(model.parameters()))
    elif engine_name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(device, (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

        def train_step(ids):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        def param_bytes():
            return tensor_bytes(list(model.parameters()))
    elif engine_name == "deepspeed":
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
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        ds_engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                             config=config)

        def train_step(ids):
            loss = ds_engine(input_ids=ids, labels=ids).loss
            ds_engine.backward(loss)
            ds_engine.step()
            return loss

        def param_bytes():
            return tensor_bytes([p.ds_tensor for p in model.parameters()])
        optimizer = ds_optimizer.optimizer
    else:
        prefetch = 0 if engine_name == "ductile-noprefetch" else PREFETCH
        engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-4),
                                  DUCTILE_CONFIG.format(prefetch=prefetch, backend=device))
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

    times, losses, waits = [], [], []
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
        ids = batch(s, rank, world, vocab, global_batch).to(device)
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
              "peak": peak, "param_bytes": param_bytes(),
              "optimizer_bytes": optimizer_bytes(optimizer), "waits": waits[WARMUP:]}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(record, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(engine, size, steps, folder, device, global_batch):
    out = os.path.join(folder, engine + ".json")
    ranks = ranks_for(device)
    script = [os.path.abspath(__file__), "--worker", engine, "--size", size, "--steps",
              str(steps), "--out", out, "--device", device, "--batch", str(global_batch)]
    if engine == "ductile-mpi":
        command = [os.environ.get("DUCTILE_MPIEXEC", "mpirun"), "--allow-run-as-root",
                   "--oversubscribe", "--mca", "btl", "self,vader", "--bind-to", "none", "-np",
                   str(ranks), sys.executable] + script
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port())] + script
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=device,
               PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        return None, (proc.stdout + proc.stderr)[-3000:]
    records = []
    for r in range(ranks):
        with open(f"{out}.rank{r}") as f:
            records.append(json.load(f))
    return records, None


def ranks_for(device):
    """2 ranks on the cpu; 1 on cuda (one GPU: NCCL refuses two ranks on one
    device)."""
    return 1 if device == "cuda" else 2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--size", default="race", choices=sorted(SIZES))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=BATCH, help="global batch (sequences)")
    parser.add_argument("--worker")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.batch < ranks_for(args.device) or args.batch % ranks_for(args.device):
        parser.error(f"--batch {args.batch} must be a positive multiple of the "
                     f"{ranks_for(args.device)} ranks")
    if args.worker:
        worker(args.worker, args.size, args.steps, args.out, args.device, args.batch)
        return
    engines = args.engines.split(",")
    results, failures = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for engine in engines:
            ranks, error = launch(engine, args.size, args.steps, folder, args.device, args.batch)
            if ranks is None:
                failures[engine] = error
            else:
                results[engine] = ranks
    first = next(iter(results.values()), None)
    if first:
        where = ("1 rank on one GPU (NCCL)" if args.device == "cuda"
                 else "2 ranks (1 thread each)")
        print(f"model: GPT-2 {SIZES[args.size]}, {first[0]['numel']:,} parameters; global batch "
              f"{args.batch} x {CONTEXT} tokens on {where}, fp32, Adam; medians of "
              f"{args.steps} steps after {WARMUP} warm-up")
    med = {e: statistics.median(r[0]["times"]) for e, r in results.items()}

    def ratio(engine, rival):
        return f"x{med[engine] / med[rival]:.2f}" if rival in med else "x-"
    for engine in engines:
        if engine in failures:
            print(f"engine {engine}: did not run: {failures[engine].strip().splitlines()[-1]}")
            continue
        r = results[engine]
        peak = max(x["peak"] for x in r) / 2**20
        print(f"engine {engine}: step {med[engine] * 1e3:.0f} ms, {ratio(engine, 'deepspeed')} "
              f"DeepSpeed, {ratio(engine, 'fsdp2')} FSDP2, peak {peak:.0f} MiB/rank")
    print()
    for engine, r in results.items():
        print(f"  {engine:20} parameters {max(x['param_bytes'] for x in r) / 2**20:8.1f} MiB/rank"
              f"  optimizer {max(x['optimizer_bytes'] for x in r) / 2**20:8.1f} MiB/rank"
              f"  first losses {', '.join(f'{v:.5f}' for v in r[0]['losses'])}")
    for engine in ("ductile", "ductile-noprefetch", "ductile-mpi"):
        if engine in results and results[engine][0]["waits"]:
            print(f"  {engine}: gather wait {statistics.median(results[engine][0]['waits']) * 1e3:.1f}"
                  " ms per step (median)")
    for engine, error in failures.items():
        print(f"\n{engine} failed:\n{error}")


if __name__ == "__main__":
    main()
