"""The offload race: a GPT-2-shaped model whose Adam state does not fit a
device-memory cap, trained with ZeRO-3 and offload, engines one after
another in one run (a program that prints figures, medians; not a test):

- deepspeed: DeepSpeed 0.19.7 ZeRO stage 3 with ``offload_optimizer`` and
  ``offload_param`` on the cpu (pinned), its DeepSpeedCPUAdam (JIT-built by
  its op builder on first use);
- ductile: ductile.torch.zero3 with ``[zero] offload_optimizer = "cpu"``
  and ``offload_param = "cpu"`` (the cpu_adam plugin steps the host shards);
- ductile-budget: ductile.torch.zero3 with ``max_device_memory`` = the cap
  only: it offloads what does not fit, optimizer state first, parameter
  shards last.

Both ductile engines run with ``[zero] offload_pipeline = true`` (each group
stepped on the host as its gradient lands during backward), or without it
with ``--offload-pipeline off`` (every group stepped in step()).

Every engine runs under torchrun over torch.distributed (NCCL on cuda, gloo
on the cpu), Adam at lr 1e-4, bf16 compute with fp32 masters (or fp32:
--precision).

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_offload.py \\
      [--size 1.3b|tiny] [--device cuda|cpu] [--cap-gib G] [--steps N] [--ranks N]
      [--batch B] [--precision bf16|fp32] [--engines a,b,...] [--offload-pipeline on|off]

On cuda (tools/gpu/ runs it on a lent GPU: the `offload_race` stage) each
rank caps its process with torch.cuda.set_per_process_memory_fraction(cap /
the device's memory), as a smaller GPU would; an engine that needs more
fails with torch's out-of-memory error, which is reported. On the cpu there
is no cap: the run checks that the engines train the same model (their first
losses) and prints the figures of this machine.

Per engine, one line:
  engine <name>: step <ms> ms, <tokens/s> tokens/s, x<ratio> DeepSpeed's tokens/s,
  peak <MiB> MiB/rank (cap <MiB>), floor <ms> ms, step/floor x<ratio>
Step: median over the measured steps of rank 0's forward + backward +
optimizer step (after torch.cuda.synchronize() on cuda). Peak (cuda):
torch.cuda.max_memory_allocated(), everything the process allocated on the
device; (cpu) the largest resident set above the one before the model.
Floor: what the race's offload work (every optimizer and parameter shard on
the host) takes at least on this machine, the same work for every engine,
with the bandwidths measured by each engine's processes before their model
(offload_floor.py: floor = max(CPU Adam bytes / host bandwidth, host<->device
bytes / copy bandwidth)); the ratio is rank 0's step over it.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zero3 import free_port, rss_bytes  # noqa: E402
from offload_floor import describe, floor, measure  # noqa: E402

SIZES = {
    # 1.31 B parameters: GPT-3 XL's width and depth in GPT-2's architecture.
    "1.3b": dict(n_embd=2048, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024),
    "tiny": dict(n_embd=128, n_layer=4, n_head=4, vocab_size=4096, n_positions=512),
}
CONTEXT = 512  # tokens a sequence
WARMUP = 2
ENGINES = ("deepspeed", "ductile", "ductile-budget")

DUCTILE_CONFIG = """
[accelerator]
backend = "{backend}"
communicator = "auto"
timeout = 1200

[zero]
coordinator = "partitioned"
prefetch_bucket_size = 50000000
max_live_parameters = 1000000000
max_reuse_distance = 0
param_persistence_threshold = 100000
max_ongoing_fetch_events = 2
offload_pipeline = {pipeline}
{offload}
"""
DUCTILE_OFFLOAD = 'offload_optimizer = "cpu"\noffload_param = "cpu"'


def build_model(size, device):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        attn_implementation="eager", **SIZES[size])
    with torch.device(device):
        return GPT2LMHeadModel(config)


def make_engine(name, model, device, args, world):
    """Engine `name` over `model`: DeepSpeed's or ductile's, which train
    alike (engine(...), engine.backward(loss), engine.step())."""
    import torch
    bf16 = args.precision == "bf16"
    if name == "deepspeed":
        import deepspeed
        config = {
            "train_micro_batch_size_per_gpu": args.batch // world,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
            "zero_optimization": {
                "stage": 3, "stage3_prefetch_bucket_size": 50_000_000,
                "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 0,
                "stage3_param_persistence_threshold": 100_000, "overlap_comm": True,
                "contiguous_gradients": True,
                "offload_optimizer": {"device": "cpu", "pin_memory": device == "cuda"},
                "offload_param": {"device": "cpu", "pin_memory": device == "cuda"}},
        }
        if bf16:
            config["bf16"] = {"enabled": True}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                    config=config)[0]
    import ductile.torch.zero3 as zero3
    budget = None
    offload = DUCTILE_OFFLOAD
    if name == "ductile-budget":
        offload = ""
        budget = int(args.cap_gib * 2**30) if device == "cuda" else None
    return zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-4),
                            DUCTILE_CONFIG.format(backend=device, offload=offload,
                                                  pipeline=str(args.offload_pipeline == "on")
                                                  .lower()),
                            mixed_precision="bf16" if bf16 else None, max_device_memory=budget)


def worker(name, args):
    import torch
    import torch.distributed as dist

    import transformers  # noqa: F401  (before the baseline: every engine imports it)

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank measures at once: each its share of the bandwidth
    measured = measure(cuda)
    if name == "deepspeed":
        import deepspeed  # noqa: F401  (its own memory is not the model's)
    baseline = 0 if cuda else rss_bytes()
    model = build_model(args.size, "cpu")  # every engine moves what it keeps on the device
    if name != "deepspeed":
        model = model.to(args.device)
    numel = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    engine = make_engine(name, model, args.device, args, world)

    def train_step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss
    per = args.batch // world
    times, losses = [], []
    for s in range(WARMUP + args.steps):
        g = torch.Generator().manual_seed(9000 + s)
        ids = torch.randint(0, vocab, (args.batch, CONTEXT), generator=g)[rank * per:(rank + 1) * per]
        ids = ids.to(args.device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train_step(ids)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    record = {"times": times[WARMUP:], "losses": losses[:2], "numel": numel, "peak": peak,
              "measured": measured}
    if name.startswith("ductile"):
        stats = engine.stats()
        record["placement"] = stats["placement"]
        record["host_shard_groups"] = len(stats["host_shard_groups"])
        record["offloaded_groups"] = len(stats["offloaded_groups"])
        record["groups"] = stats["groups"]
        engine.close()
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def launch(name, args, folder):
    out = os.path.join(folder, name + ".json")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               os.path.abspath(__file__), "--worker", name, "--out", out, "--size", args.size,
               "--device", args.device, "--cap-gib", str(args.cap_gib), "--steps",
               str(args.steps), "--ranks", str(args.ranks), "--batch", str(args.batch),
               "--precision", args.precision, "--offload-pipeline", args.offload_pipeline]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               DS_ACCELERATOR=args.device, PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        return None, (proc.stdout + proc.stderr)[-3000:]
    records = []
    for r in range(args.ranks):
        with open(f"{out}.rank{r}") as f:
            records.append(json.load(f))
    return records, None


def report(args, results, failures):
    first = next(iter(results.values()), None)
    cap = f"{args.cap_gib:g} GiB cap a rank" if args.device == "cuda" else "no cap (cpu)"
    if first:
        print(f"model: GPT-2 {SIZES[args.size]}, {first[0]['numel']:,} parameters; global batch "
              f"{args.batch} x {CONTEXT} tokens on {args.ranks} rank(s), {args.device}, "
              f"{args.precision}, Adam, {cap}; medians of {args.steps} steps after {WARMUP} "
              "warm-up")
    tokens = {e: args.batch * CONTEXT / statistics.median(r[0]["times"])
              for e, r in results.items()}
    shard = -(-first[0]["numel"] // args.ranks) if first else 0
    for name in args.engines.split(","):
        if name in failures:
            print(f"engine {name}: did not run: {failures[name].strip().splitlines()[-1]}")
            continue
        r = results[name]
        ratio = f"x{tokens[name] / tokens['deepspeed']:.2f}" if "deepspeed" in tokens else "x-"
        peak = max(x["peak"] for x in r) / 2**20
        step = statistics.median(r[0]["times"])
        least = floor(r[0]["measured"], shard, args.precision, True)["floor"]
        print(f"engine {name}: step {step * 1e3:.1f} ms, "
              f"{tokens[name]:.0f} tokens/s, {ratio} DeepSpeed's tokens/s, peak {peak:.0f} "
              f"MiB/rank" + (f" (cap {args.cap_gib * 1024:.0f})" if args.device == "cuda" else "")
              + f", floor {least * 1e3:.1f} ms, step/floor x{step / least:.2f}")
    print()
    for name, r in results.items():
        line = f"  {name:16} first losses {', '.join(f'{v:.5f}' for v in r[0]['losses'])}"
        if "placement" in r[0]:
            p = r[0]["placement"]
            line += (f"; host shards {r[0]['host_shard_groups']}/{r[0]['groups']} groups, "
                     f"optimizers on the host {r[0]['offloaded_groups']}; parameters on the "
                     f"device {p['parameters']['device'] / 2**20:.0f} MiB, on the host "
                     f"{p['parameters']['host'] / 2**20:.0f} MiB")
        print(line)
        print(f"  {'':16} {describe(r[0]['measured'], shard, args.precision, True)}")
    for name, error in failures.items():
        print(f"\n{name} failed:\n{error}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cap-gib", type=float, default=12.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--batch", type=int, help="global batch in sequences (default: 2 a rank)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--offload-pipeline", default="on", choices=("on", "off"),
                        help="[zero] offload_pipeline of the ductile engines")
    parser.add_argument("--worker")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.batch is None:
        args.batch = 2 * args.ranks
    if args.ranks < 1 or args.batch % args.ranks:
        parser.error(f"--batch {args.batch} must be a multiple of the {args.ranks} ranks")
    if args.cap_gib <= 0:
        parser.error(f"--cap-gib {args.cap_gib} must be positive")
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        parser.error(f"--engines: {', '.join(sorted(unknown))}; valid: {', '.join(ENGINES)}")
    if args.worker:
        worker(args.worker, args)
        return
    results, failures = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.engines.split(","):
            records, error = launch(name, args, folder)
            if records is None:
                failures[name] = error
            else:
                results[name] = records
    report(args, results, failures)


if __name__ == "__main__":
    main()
