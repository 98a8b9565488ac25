"""The one-rank offload race (a program that prints figures, medians; not a
test): one training step (forward, backward, optimizer step) of a small
GPT-2 under ZeRO-3 with the optimizer offloaded to the CPU, on one rank
with torch's default intra-op threads (every core), by

- ductile: ductile.torch.zero3 with ``[zero] offload_optimizer = "cpu"``
  (torch.optim.Adam from the factory, stepped by the cpu_adam plugin) and
  ``offload_pipeline = true`` (each group stepped on a worker thread as its
  gradient lands during backward; ``--offload-pipeline off``: in step());
- deepspeed: DeepSpeed 0.19.7, ``deepspeed.initialize`` with ZeRO stage 3
  and ``offload_optimizer`` on the cpu (its DeepSpeedCPUAdam, JIT-built by
  its op builder on first use).

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_offload_step.py \\
      [--rounds R] [--steps N] [--batch B] [--context T] [--conditions quiet,busy]
      [--offload-pipeline on|off]

Each engine runs in a process of its own, on one rank (gloo, world size 1),
OMP_NUM_THREADS unset. The processes take turns: per round and condition
one of each, the first engine alternating between rounds, so a change of
load on the machine hits both alike. Conditions: ``quiet`` (nothing else
started) and ``busy`` (the benchmark starts ``python -c 'while 1: pass'``
before the engine's process and kills it after: one core of this machine
is taken by another process, as on a shared node). Per engine and
condition: the median over every round's timed steps (after 3 warm-up
steps) and each round's median; the ratio is ductile's step time over
DeepSpeed's (below 1: ductile is faster). Both train the same model on the
same tokens: their first losses are printed side by side.

Floor: what the offloaded optimizer's work takes at least on this machine
(offload_floor.py: the cpu_adam plugin's bytes, 28 B an element in fp32, at
the host bandwidth that each engine's process measures with its threads
before its model; no host<->device term on the cpu), at the median of the
bandwidths the condition's processes measured; step/floor: each engine's
step over it.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offload_floor import describe, floor, measure  # noqa: E402

ENGINES = ("ductile", "deepspeed")
CONDITIONS = ("quiet", "busy")
WARMUP = 3
MODEL = dict(n_embd=128, n_layer=4, n_head=4, vocab_size=4096, n_positions=512)
DUCTILE_CONFIG = """
[accelerator]
backend = "cpu"
communicator = "auto"

[zero]
coordinator = "partitioned"
offload_optimizer = "cpu"
offload_pipeline = {pipeline}
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_engine(name, model, batch, pipeline):
    import torch
    if name == "deepspeed":
        import deepspeed
        config = {
            "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        }
        return deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                    config=config)[0]
    import ductile.torch.zero3 as zero3
    return zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-4),
                            DUCTILE_CONFIG.format(pipeline=str(pipeline == "on").lower()))


def worker(args):
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    dist.init_process_group("gloo")
    measured = measure(False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       attn_implementation="eager", **MODEL))
    numel = sum(p.numel() for p in model.parameters())
    engine = make_engine(args.worker, model, args.batch, args.offload_pipeline)
    times, losses = [], []
    for step in range(WARMUP + args.steps):
        ids = torch.randint(0, MODEL["vocab_size"], (args.batch, args.context),
                            generator=torch.Generator().manual_seed(100 + step))
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    if hasattr(engine, "close"):
        engine.close()
    dist.destroy_process_group()
    print(json.dumps({"times": times[WARMUP:], "losses": losses[:2],
                      "threads": torch.get_num_threads(), "numel": numel,
                      "measured": measured}), flush=True)


def launch(name, condition, args):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               PYTHONWARNINGS="ignore")
    env.pop("OMP_NUM_THREADS", None)  # torch's default: every core
    env.pop("DS_BUILD_OPS", None)     # the venv was installed without ops; the JIT builds them
    busy = None
    if condition == "busy":
        busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name,
                              "--steps", str(args.steps), "--batch", str(args.batch),
                              "--context", str(args.context),
                              "--offload-pipeline", args.offload_pipeline],
                             env=env, capture_output=True, text=True, timeout=1800)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
        sys.exit(f"{name} ({condition}) failed with exit code {out.returncode}")
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per process")
    parser.add_argument("--batch", type=int, default=2, help="sequences a step")
    parser.add_argument("--context", type=int, default=128, help="tokens a sequence")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--offload-pipeline", default="on", choices=("on", "off"),
                        help="[zero] offload_pipeline of ductile's engine")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    conditions = args.conditions.split(",")
    unknown = set(conditions) - set(CONDITIONS)
    if unknown:
        parser.error(f"--conditions: {', '.join(sorted(unknown))}; valid: {', '.join(CONDITIONS)}")
    results = {(c, e): [] for c in conditions for e in ENGINES}
    load = {}
    for r in range(args.rounds):
        order = ENGINES if r % 2 == 0 else ENGINES[::-1]
        for condition in conditions:
            for name in order:
                load.setdefault(condition, []).append(os.getloadavg()[0])
                results[(condition, name)].append(launch(name, condition, args))
    cores = len(os.sched_getaffinity(0))
    first = results[(conditions[0], "ductile")][0]
    print(f"One-rank ZeRO-3, offload_optimizer cpu (offload_pipeline {args.offload_pipeline}): "
          f"GPT-2 {MODEL}, batch {args.batch} x "
          f"{args.context} tokens, fp32, Adam lr 1e-4; torch's default threads "
          f"({first['threads']} of {cores} cores); {args.rounds} rounds x {args.steps} timed "
          f"steps after {WARMUP} warm-up, engines taking turns")
    print(f"{'condition':>9} {'ductile ms':>11} {'deepspeed ms':>13} {'ratio':>6} "
          f"{'floor ms':>9} {'ductile/floor':>14} {'deepspeed/floor':>16}  "
          "per-round medians ductile | deepspeed (ms); load 1-min")
    for condition in conditions:
        medians = {}
        rounds = {}
        for name in ENGINES:
            runs = results[(condition, name)]
            medians[name] = statistics.median(t for run in runs for t in run["times"]) * 1e3
            rounds[name] = ", ".join(f"{statistics.median(run['times']) * 1e3:.0f}"
                                     for run in runs)
        # The floor at the median of the bandwidths the condition's processes measured.
        runs = [run for name in ENGINES for run in results[(condition, name)]]
        measured = {"host_bandwidth": statistics.median_low(
            run["measured"]["host_bandwidth"] for run in runs)}
        numel = runs[0]["numel"]
        least = floor(measured, numel, "fp32", False)["floor"] * 1e3
        print(f"{condition:>9} {medians['ductile']:>11.1f} {medians['deepspeed']:>13.1f} "
              f"{medians['ductile'] / medians['deepspeed']:>6.2f} {least:>9.1f} "
              f"{'x%.2f' % (medians['ductile'] / least):>14} "
              f"{'x%.2f' % (medians['deepspeed'] / least):>16}  {rounds['ductile']} | "
              f"{rounds['deepspeed']}; {min(load[condition]):.1f}-{max(load[condition]):.1f}")
        print(f"{'':>9} " + describe(measured, numel, "fp32", False))
    for name in ENGINES:
        losses = results[(conditions[0], name)][0]["losses"]
        print(f"  {name:10} first losses {', '.join(f'{v:.5f}' for v in losses)}")


if __name__ == "__main__":
    main()
