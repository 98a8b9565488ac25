"""The CPU Adam race (a program that prints figures, medians; not a test):
one AdamW step over one flat fp32 tensor of 10 M and 50 M elements, with 1
thread and with every core, by

- ductile: ductile.ops.adam.DuctileCPUAdam (the cpu_adam plugin), on
  torch's thread count as it does by default;
- deepspeed: DeepSpeed 0.19.7's DeepSpeedCPUAdam, its C++ op built by
  DeepSpeed's op builder (torch's cpp_extension JIT, -O3 -march=native,
  OpenMP) on first use and cached under <build>/torch_extensions;
- torch: torch.optim.AdamW(foreach=True).

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_cpu_adam.py \\
      [--sizes 10000000,50000000] [--threads 1,all] [--rounds R] [--steps N] [--build-dir build]

Each round runs each thread count in a process of its own (OMP_NUM_THREADS
and torch.set_num_threads set to it; ductile follows torch's count, as
DeepSpeedCPUAdam does), the rounds one after another, so that the thread
counts interleave. In a process, per size, the three optimizers step their
own copy of the same parameters and gradients, taking turns step by step,
each going first in turn (so a change of load on the machine hits all three
alike). After warm-up steps, the median of every round's timed
optimizer.step() calls is printed, with the ratios ductile / rival (speed:
the rival's time over ductile's), each round's ratio to DeepSpeed, and the
largest difference of the final parameters from torch's, in units of lr
(they took the same steps). The load average of the machine is printed
before and after each thread count's processes.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
CONTENDERS = ("ductile", "deepspeed", "torch")
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
WARMUP = 2


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def child_env(threads, extensions_dir):
    env = dict(os.environ)
    env.pop("DS_BUILD_OPS", None)  # the venv was installed without ops; the JIT builds them
    env.update(OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu",
               TORCH_EXTENSIONS_DIR=extensions_dir, PYTHONDONTWRITEBYTECODE="1")
    return env


def build_deepspeed_op():
    """Builds (or loads from the cache) DeepSpeed's cpu_adam op once, before
    anything is timed; returns the seconds it took."""
    from deepspeed.ops.op_builder import CPUAdamBuilder
    start = time.perf_counter()
    CPUAdamBuilder().load(verbose=False)
    return time.perf_counter() - start


def make_optimizer(name, params, threads):
    import torch
    if name == "ductile":
        from ductile.ops.adam import DuctileCPUAdam
        return DuctileCPUAdam(params, **HYPER, adamw_mode=True)  # torch's count
    if name == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(params, **HYPER, adamw_mode=True)
    return torch.optim.AdamW(params, **HYPER, foreach=True)


def race(threads, size, steps):
    import torch
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(size)
    initial = torch.randn(size, generator=gen)
    grad = torch.randn(size, generator=gen) * 1e-2
    params, optimizers = {}, {}
    for name in CONTENDERS:
        params[name] = initial.clone().requires_grad_()
        params[name].grad = grad.clone()
        optimizers[name] = make_optimizer(name, [params[name]], threads)
    del initial, grad
    times = {name: [] for name in CONTENDERS}
    for step in range(WARMUP + steps):
        # Each goes first in turn: none always follows the same rival.
        turn = step % len(CONTENDERS)
        for name in CONTENDERS[turn:] + CONTENDERS[:turn]:
            start = time.perf_counter()
            optimizers[name].step()
            elapsed = time.perf_counter() - start
            if step >= WARMUP:
                times[name].append(elapsed)
    reference = params["torch"].detach()
    result = dict(threads=threads, size=size, steps=steps,
                  implementation=optimizers["ductile"].implementation)
    for name in CONTENDERS:
        result[name + "_ms"] = statistics.median(times[name]) * 1e3
        result[name + "_times"] = [t * 1e3 for t in times[name]]
        result[name + "_spread_ms"] = [min(times[name]) * 1e3, max(times[name]) * 1e3]
        # In units of lr, the size of one step.
        result[name + "_diff"] = (float((params[name].detach() - reference).abs().max())
                                  / HYPER["lr"])
    return result


def child(args):
    threads = int(args.child)
    for size in args.sizes:
        steps = args.steps or max(8, min(30, 300_000_000 // size))
        print(json.dumps(race(threads, size, steps)), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000000,50000000",
                        help="elements of the parameter tensor, comma-separated")
    parser.add_argument("--threads", default="1,all",
                        help="thread counts, comma-separated; 'all': every core this process "
                             "may use")
    parser.add_argument("--steps", type=int, default=0,
                        help="timed steps per size and round (default: 30 for 10 M, 8 for 50 M)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="processes per thread count, interleaved with the others'")
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build"),
                        help="where DeepSpeed's op is built and cached (torch_extensions/)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = [int(float(s)) for s in args.sizes.split(",")]
    if args.child:
        return child(args)

    cores = len(os.sched_getaffinity(0))
    thread_counts = [cores if t == "all" else int(t) for t in args.threads.split(",")]
    extensions_dir = os.path.join(os.path.abspath(args.build_dir), "torch_extensions")
    os.makedirs(extensions_dir, exist_ok=True)
    os.environ.update(child_env(cores, extensions_dir))
    seconds = build_deepspeed_op()
    print(f"CPU Adam race: AdamW (lr {HYPER['lr']}, weight_decay {HYPER['weight_decay']}), one "
          f"flat fp32 tensor; {cpu_name()}, {cores} cores; DeepSpeed's op loaded in "
          f"{seconds:.1f} s from {extensions_dir}", flush=True)
    runs = {}  # (threads, size) -> the rows of every round
    load = {}
    for _ in range(args.rounds):
        for threads in thread_counts:
            before = os.getloadavg()[0]
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                  str(threads), "--sizes", ",".join(map(str, args.sizes)),
                                  "--steps", str(args.steps)],
                                 env=child_env(threads, extensions_dir), capture_output=True,
                                 text=True)
            after = os.getloadavg()[0]
            if out.returncode != 0:
                sys.stderr.write(out.stdout + out.stderr)
                sys.exit(f"the {threads}-thread run failed (exit code {out.returncode})")
            seen = load.setdefault(threads, [before, after])
            seen[:] = [min(seen[0], before, after), max(seen[1], before, after)]
            for line in out.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    runs.setdefault((row["threads"], row["size"]), []).append(row)
    rows = []
    for (threads, size), rounds in runs.items():
        row = dict(rounds[-1], load=load[threads], rounds=rounds)
        for name in CONTENDERS:
            row[name + "_ms"] = statistics.median(t for r in rounds for t in r[name + "_times"])
            row[name + "_spread_ms"] = [min(r[name + "_spread_ms"][0] for r in rounds),
                                        max(r[name + "_spread_ms"][1] for r in rounds)]
        rows.append(row)
    print(f"{'threads':>7} {'elements':>9} {'ductile ms':>11} {'deepspeed ms':>13} "
          f"{'torch ms':>9} {'x DeepSpeed':>11} {'x torch':>8}  per round x DeepSpeed; "
          "load 1-min (least, most)")
    for r in rows:
        per_round = ", ".join(f"{x['deepspeed_ms'] / x['ductile_ms']:.2f}" for x in r["rounds"])
        print(f"{r['threads']:>7} {r['size'] / 1e6:>8.0f}M {r['ductile_ms']:>11.1f} "
              f"{r['deepspeed_ms']:>13.1f} {r['torch_ms']:>9.1f} "
              f"{r['deepspeed_ms'] / r['ductile_ms']:>11.2f} "
              f"{r['torch_ms'] / r['ductile_ms']:>8.2f}  {per_round}; "
              f"{r['load'][0]:.1f}, {r['load'][1]:.1f}")
    for r in rows:
        print(f"{r['threads']} thread(s), {r['size'] / 1e6:.0f}M: ductile {r['implementation']}, "
              f"stepping on torch's {r['threads']}; "
              f"{len(r['rounds'])} x {r['steps']} timed steps, min-max ms: " +
              ", ".join(f"{n} {r[n + '_spread_ms'][0]:.1f}-{r[n + '_spread_ms'][1]:.1f}"
                        for n in CONTENDERS) +
              f"; largest difference from torch's parameters, in steps (lr): ductile "
              f"{r['ductile_diff']:.1e}, deepspeed {r['deepspeed_diff']:.1e}")


if __name__ == "__main__":
    main()
