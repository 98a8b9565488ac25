"""A node that joins a running job, raced: the running workers going on in
place (they pause at an optimizer update and rejoin at the new size) against
the running workers restarted from the snapshot in memory. It prints tables;
nothing asserts on time.

The job of bench_recovery.py (the tied LM of the zero3 tests, Adam, global
batch 24, a snapshot every step copied to one other node): two nodes x 1
worker train; after --join-after steps a third agent starts. From the third
agent's start, per run: its worker's torch imported (the newcomer ready),
the first step at world size 3, and the steps trained again; the first
step at world size 3 from the newcomer ready; and the running workers'
stall, from their last step at size 2 to the first at size 3.

Launchers: ductile-in-place (the running workers go on in place; the
newcomer's agent, coming to a job that keeps snapshots, starts its worker's
interpreter with torch imported before it joins), ductile-in-place-warm
(the same with --warm-workers: the script's own imports too, and spares
for every later round), ductile (the running workers are restarted from
the snapshot in memory).

usage: bench_join.py [--cli PATH] [--python PATH] [--runs 3] [--join-after 4]
                     [--steps 40] [--launchers ductile-in-place,ductile-in-place-warm,ductile]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_agent import ROOT, Etcd, spread, stop_nodes
from bench_recovery import (BATCH, DUCTILE_WORKER, IN_PLACE_WORKER, JOB_TOML, MODEL, REPLICAS,
                            notes, wait_for)

NAMES = {"ductile-in-place": "ductile agent, running workers in place",
         "ductile-in-place-warm": "the same, --warm-workers",
         "ductile": "ductile agent, running workers restarted from memory"}


def race_one(kind, args, directory):
    out = os.path.join(directory, "notes")
    script = os.path.join(directory, "worker.py")
    with open(script, "w") as f:
        f.write((IN_PLACE_WORKER if kind.startswith("ductile-in-place") else DUCTILE_WORKER)
                % (MODEL, BATCH, REPLICAS))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(args.build, "python"),
                                           os.path.join(ROOT, "tests", "python")]),
               DUCTILE_TEST_DATA_DIR=os.path.join(ROOT, "tests", "data"))
    etcd = Etcd(directory)
    config = os.path.join(directory, "job.toml")
    with open(config, "w") as f:
        f.write(JOB_TOML)
    shm = os.path.join(directory, "shm")
    os.makedirs(shm)
    nodes, logs = [], []

    def start(i):
        log = open(os.path.join(directory, f"node{i}.log"), "w")
        logs.append(log)
        argv = [args.cli, "agent", "--config", config, "--rdzv", etcd.url, "--job-id", "join",
                "--node-addr", "127.0.0.1", "--nproc-per-node", "1", "--min-nodes", "2",
                "--min-time", "0", "--settle", "0.5", "--snapshot-dir", shm]
        argv += {"ductile-in-place": [], "ductile-in-place-warm": ["--warm-workers"],
                 "ductile": ["--mpi-world"]}[kind]
        nodes.append(subprocess.Popen(argv + ["--", args.python, script, out, str(args.steps)],
                                      stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))

    try:
        start(0)
        time.sleep(0.2)
        start(1)
        wait_for(lambda: len([r for r in notes(out) if r[0] == "stepped" and r[2] == 2
                              and r[4] >= args.join_after - 1]) >= 2, 900,
                 f"{kind}: step {args.join_after} at world size 2", nodes)
        joined = time.time()
        start(2)

        def after(event, world):
            return [r for r in notes(out) if r[0] == event and r[2] == world and r[5] > joined]
        wait_for(lambda: len(after("stepped", 3)) >= 3, 900,
                 f"{kind}: the first step at world size 3", nodes)
        done = max(r[4] for r in notes(out) if r[0] == "stepped" and r[2] == 2) + 1
        first = after("stepped", 3)
        first_step = min(r[5] for r in first)
        # The newcomer's worker: the only one to start after the join in
        # place; restarted, the last of the round's workers to import torch.
        ready = max(r[5] for r in after("imported", 3))
        resumed = min(r[4] for r in first)
        last_before = max(r[5] for r in notes(out) if r[0] == "stepped" and r[2] == 2)
        return (ready - joined, first_step - joined, first_step - ready,
                first_step - last_before, done - resumed)
    except Exception:
        kept = tempfile.mkdtemp(prefix=f"ductile-bench-join-failed-{kind}-")
        shutil.copytree(directory, kept, dirs_exist_ok=True, ignore_dangling_symlinks=True)
        print(f"{kind}: failed; its logs are in {kept}", file=sys.stderr)
        raise
    finally:
        stop_nodes(nodes, logs)
        etcd.stop()


COLUMNS = ("newcomer ready (s)", "first step at size 3 (s)", "from the newcomer ready (s)",
           "running workers stalled (s)", "steps trained again")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cli", default=os.path.join(ROOT, "build", "bin", "ductile"))
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--join-after", type=int, default=4, dest="join_after")
    parser.add_argument("--launchers", default="ductile-in-place,ductile-in-place-warm,ductile",
                        type=lambda s: s.split(","))
    args = parser.parse_args()
    bad = [k for k in args.launchers if k not in NAMES]
    if bad:
        sys.exit(f"bench_join.py: --launchers {bad[0]!r} is not valid; use {', '.join(NAMES)}")
    if not 1 <= args.join_after < args.steps - 2:
        sys.exit(f"bench_join.py: --join-after {args.join_after}: give 1 to --steps - 3 "
                 f"({args.steps - 3})")
    results = {kind: [] for kind in args.launchers}
    for run in range(args.runs):
        for kind in args.launchers:
            directory = tempfile.mkdtemp(prefix=f"ductile-bench-join-{kind}-")
            try:
                r = race_one(kind, args, directory)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            results[kind].append(r)
            print(f"run {run + 1} {kind}: " + ", ".join(
                f"{name} {value:.2f}" for name, value in zip(COLUMNS, r)), flush=True)
    print(f"\n2 nodes x 1 worker on loopback, a third joins after step {args.join_after}; "
          f"medians (min-max) of {args.runs} run(s); {os.cpu_count()} CPU(s)")
    print("| launcher | " + " | ".join(COLUMNS) + " |")
    print("| --- |" + " ---: |" * len(COLUMNS))
    for kind, runs in results.items():
        cells = [spread([r[i] for r in runs], ".2f" if i < 4 else ".1f")
                 for i in range(len(COLUMNS))]
        print(f"| {NAMES[kind]} | " + " | ".join(cells) + " |")
    if "ductile-in-place" in results and "ductile" in results:
        restart = statistics.median(r[1] for r in results["ductile"])
        ratios = [r[1] / restart for r in results["ductile-in-place"]]
        print(f"ductile-in-place / ductile (join to first step at size 3): "
              f"{statistics.median(ratios):.3f} (worst run {max(ratios):.3f})")


if __name__ == "__main__":
    main()
