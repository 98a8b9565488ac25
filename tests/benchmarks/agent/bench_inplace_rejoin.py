"""A rank of three lost: how long until the survivors complete their next
step, going on in place (round notices, ``engine.rejoin``) or restarted
(new worker processes with DUCTILE_SNAPSHOT_RESTORE, as the agent does
without notices). It prints medians; nothing asserts on time.

Three ranks of tests/python/zero3_rejoin_worker.py (zero3 on gloo, the
tests' LM, snapshot_interval 1, each rank its own node), started as the
agent starts them; rank 2 stops after step 3 and is SIGKILLed. This script
plays the agents: it assembles step 3's snapshot from the three nodes'
folders and then either writes the survivors' notices (in place) or stops
the survivors (SIGTERM) and starts two new workers on that folder
(restart). Measured: from the SIGKILL to the first step a survivor (or
new worker) logs at world size 2, the slower of the two ranks.

usage: bench_inplace_rejoin.py [--runs 3] [--steps 5]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from zero3_rejoin_support import (Releases, assemble, finish, kill, notice, serve_store,  # noqa
                                  start, wait_for, write_notice)

PAUSE = 3


def first_at_two(out, rank):
    """The time of the first step `rank` logged at world size 2, or None."""
    try:
        with open(os.path.join(out, f"losses-rank{rank}.jsonl")) as f:
            for line in f:
                record = json.loads(line)
                if record["world_size"] == 2:
                    return record["time"]
    except FileNotFoundError:
        return None
    return None


def wait_first(out, procs, timeout=240):
    deadline = time.monotonic() + timeout
    while True:
        times = [first_at_two(out, r) for r in range(2)]
        if all(t is not None for t in times):
            return max(times)
        for p in procs:
            if p.poll() not in (None, 0):
                sys.exit(f"a rank failed ({p.returncode}); see {out}/stderr-rank*.txt")
        if time.monotonic() > deadline:
            sys.exit(f"no step at world size 2 within {timeout} s; see {out}")
        time.sleep(0.002)


def one_run(directory, mode, steps):
    store, port = serve_store()
    out = os.path.join(directory, mode)
    procs = start(out, {"steps": steps, "pause": {"rank": 2, "step": PAUSE,
                                                   "where": "boundary"}}, 3, port,
                  notices=mode == "in place")
    nodes = [os.path.join(out, f"node{r}") for r in range(3)]
    with Releases(nodes):
        wait_for(os.path.join(out, "paused-rank2"), procs)
        killed = time.time()
        kill(procs[2])
        folder = assemble(out, 3, f"step{PAUSE}")
        if mode == "in place":
            for r in range(2):
                write_notice(os.path.join(out, f"notice-rank{r}.json"),
                             notice(2, r, 2, port, folder))
            done = wait_first(out, procs[:2])
            finish(procs[:2])
        else:
            for p in procs[:2]:
                p.terminate()
            finish(procs[:2])
            for r in range(2):
                os.unlink(os.path.join(out, f"losses-rank{r}.jsonl"))
            store2, port2 = serve_store()
            fresh = start(out + "-new", {"steps": PAUSE + 1}, 2, port2, round_=2,
                          notices=False, restore=folder)
            done = wait_first(out + "-new", fresh)
            finish(fresh)
            del store2
    del store
    return done - killed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=PAUSE + 2)
    args = parser.parse_args()
    results = {"in place": [], "restart": []}
    for _ in range(args.runs):
        for mode in results:
            directory = tempfile.mkdtemp(prefix="bench-rejoin-")
            try:
                results[mode].append(one_run(directory, mode, args.steps))
            finally:
                shutil.rmtree(directory, ignore_errors=True)
    print("| workers | SIGKILL to the next step at world size 2 (s) |")
    print("| --- | ---: |")
    for mode, times in results.items():
        print(f"| {mode} | {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) |")


if __name__ == "__main__":
    main()
