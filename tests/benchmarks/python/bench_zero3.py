"""ZeRO-3 through ductile against torch's DistributedDataParallel (a program
that prints figures, medians; not a test).

One run starts three 2-rank jobs under mpirun, one after another, on the
same model (tests/python/zero3_model.py's tied LM, scaled up) and the same
batches, and prints per-step time, the ratio to DDP, the fraction of the
gather wait that prefetch hides, and peak parameter bytes per rank:

- ddp: DistributedDataParallel over gloo (the peer a user would pick on CPU);
- zero3 without prefetch (prefetch_bucket_size = 0): every gather waited;
- zero3 with prefetch (the coordinator's trace drives it).

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_zero3.py [STEPS [ROUNDS]]

Hidden = 1 - (fetch wait with prefetch) / (fetch wait without), per step.
CPU ms per step of rank 0's threads: the training thread ("main") and all
others (gloo's, or ductile's MPI progress and stream threads): with each
rank bound to one core, the others' CPU time is taken from the training
thread's.
Parameter bytes: DDP holds every parameter; zero3 its shards plus the
gathered copies at their peak (persistent ones included). Optimizer state
(Adam's two moments; zero3's shards are also the optimizer's parameters)
is printed beside it.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TESTS = os.path.join(ROOT, "tests", "python")
os.environ.setdefault("DUCTILE_TEST_DATA_DIR", os.path.join(ROOT, "tests", "data"))
sys.path.insert(0, TESTS)

# Deep and narrow, as the models ZeRO-3 is for: the gathered window (a few
# layers) is small next to the whole.
MODEL = dict(d=128, heads=4, layers=16, context=64)
BATCH = 8  # global: 4 sequences per rank
WARMUP = 3

ZERO_CONFIG = """
[accelerator]
backend = "cpu"
communicator = "auto"
timeout = 300

[zero]
coordinator = "partitioned"
prefetch_bucket_size = {prefetch}
max_live_parameters = 200000
max_reuse_distance = 0
param_persistence_threshold = 1000
max_ongoing_fetch_events = 2
"""


def thread_cpu_seconds():
    """(CPU seconds of the main thread, of every other thread) of this process."""
    main = others = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a thread that ended
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        if int(tid) == os.getpid():
            main += ticks
        else:
            others += ticks
    hz = os.sysconf("SC_CLK_TCK")
    return main / hz, others / hz


def worker(kind, steps, out, port):
    import torch
    from zero3_model import Windows, loss_of, make_model

    torch.set_num_threads(1)
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    model = make_model(seed=0, **MODEL)
    windows = Windows(batch=BATCH, context=MODEL["context"])
    numel = sum(p.numel() for p in model.parameters())
    times, waits, grad_waits = [], [], []
    if kind == "ddp":
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)

        def train_step(x, y):
            loss_of(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

        def after_step():
            pass
    else:
        import ductile.torch.zero3 as zero3
        prefetch = 0 if kind == "zero3_noprefetch" else 100000
        engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-3),
                                  ZERO_CONFIG.format(prefetch=prefetch))
        optimizer = engine.optimizer
        before = [engine.stats()]

        def train_step(x, y):
            engine.backward(loss_of(engine(x), y))
            engine.step()

        def after_step():
            after = engine.stats()
            waits.append((after["fetch_wait_ns"] - before[0]["fetch_wait_ns"]) / 1e9)
            grad_waits.append((after["grad_wait_ns"] - before[0]["grad_wait_ns"]) / 1e9)
            before[0] = after

    for s in range(WARMUP + steps):
        if s == WARMUP:
            cpu_start = thread_cpu_seconds()
        x, y = windows.step(s, rank, world)
        t0 = time.perf_counter()
        train_step(x, y)
        times.append(time.perf_counter() - t0)
        after_step()
    optimizer_bytes = sum(t.numel() * t.element_size() for st in optimizer.state.values()
                          for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    if kind == "ddp":
        parameter_bytes = numel * 4
        dist.destroy_process_group()
    else:
        stats = engine.stats()
        parameter_bytes = stats["shard_bytes"] + 4 * (stats["peak_live_numel"] +
                                                      stats["persistent_numel"])
    end = thread_cpu_seconds()
    cpu_main = (end[0] - cpu_start[0]) / steps
    cpu_others = (end[1] - cpu_start[1]) / steps
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times[WARMUP:], "waits": waits[WARMUP:],
                       "grad_waits": grad_waits[WARMUP:], "numel": numel,
                       "cpu_main": cpu_main, "cpu_others": cpu_others,
                       "parameter_bytes": parameter_bytes, "optimizer_bytes": optimizer_bytes}, f)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(kind, steps, folder):
    out = os.path.join(folder, kind + ".json")
    mpiexec = os.environ.get("DUCTILE_MPIEXEC", "mpirun")
    command = [mpiexec, "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader",
               "--bind-to", "core", "-np", "2", sys.executable, os.path.abspath(__file__),
               "--worker", kind, str(steps), out, str(free_port())]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        OMP_NUM_THREADS="1")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{kind} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    with open(out) as f:
        return json.load(f)


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    kinds = ("ddp", "zero3_noprefetch", "zero3")
    runs = {}
    # Rounds of the three jobs one after another, so that a slow spell of the
    # machine falls on all of them alike; per-step figures are pooled.
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(rounds):
            for kind in kinds:
                r = launch(kind, steps, folder)
                if kind not in runs:
                    runs[kind] = dict(r, cpu_main=[r["cpu_main"]], cpu_others=[r["cpu_others"]])
                    continue
                for key in ("times", "waits", "grad_waits"):
                    runs[kind][key] += r[key]
                runs[kind]["cpu_main"].append(r["cpu_main"])
                runs[kind]["cpu_others"].append(r["cpu_others"])
    for r in runs.values():
        r["cpu_main"] = statistics.median(r["cpu_main"])
        r["cpu_others"] = statistics.median(r["cpu_others"])
    med = {k: statistics.median(r["times"]) for k, r in runs.items()}
    wait_off = statistics.median(runs["zero3_noprefetch"]["waits"])
    wait_on = statistics.median(runs["zero3"]["waits"])
    print(f"model: tied LM {MODEL}, {runs['ddp']['numel']:,} parameters; global batch "
          f"{BATCH} x {MODEL['context']} tokens, 2 ranks (1 thread each); {rounds} rounds of "
          f"{steps} steps after {WARMUP} warm-up each, medians")
    print(f"{'':24}{'step ms':>10}{'vs DDP':>9}{'param MiB/rank':>16}{'optim MiB/rank':>16}"
          f"{'CPU ms: main':>14}{'others':>8}")
    for kind, label in (("ddp", "DDP (gloo)"), ("zero3_noprefetch", "zero3, no prefetch"),
                        ("zero3", "zero3")):
        r = runs[kind]
        print(f"{label:24}{med[kind] * 1e3:10.1f}{med[kind] / med['ddp']:9.2f}"
              f"{r['parameter_bytes'] / 2**20:16.2f}{r['optimizer_bytes'] / 2**20:16.2f}"
              f"{r['cpu_main'] * 1e3:14.0f}{r['cpu_others'] * 1e3:8.0f}")
    hidden = 1 - wait_on / wait_off if wait_off > 0 else float("nan")
    print(f"gather wait per step: {wait_off * 1e3:.2f} ms without prefetch, {wait_on * 1e3:.2f} "
          f"ms with: {hidden:.1%} hidden by prefetch")
    print(f"gradient reduce-scatter wait at the end of backward: "
          f"{statistics.median(runs['zero3']['grad_waits']) * 1e3:.2f} ms per step")
    print(f"parameter bytes per rank, zero3 / DDP: "
          f"{runs['zero3']['parameter_bytes'] / runs['ddp']['parameter_bytes']:.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    else:
        main()
