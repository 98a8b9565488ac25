"""Two nodes of three lost a little apart: how long the survivor takes to
start its workers again. It prints medians; nothing asserts on time.

Three `ductile agent` processes on one etcd (1 worker each, `sleep`,
--lease-ttl 4, --min-nodes 1); the oldest (the leader) survives. Node b's
process tree is SIGKILLed, then node c's --gap seconds later: the leader
sees b's lease lapse first and forms a round with itself and c, which died
before it could publish its snapshot holdings. Measured: from the second
kill to the survivor's `round N started: world size 1`, and the rounds it
formed on the way.

usage: bench_member_lost.py [--cli PATH] [--runs 3] [--gap 2.5]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_agent import ROOT, Etcd, kill_node, stop_all, wait_for
from bench_recovery import JOB_TOML


def one_run(cli, gap, directory):
    etcd = Etcd(directory)
    config = os.path.join(directory, "job.toml")
    with open(config, "w") as f:
        f.write(JOB_TOML)
    processes, logs, paths = [], [], {}
    try:
        for name in ("a", "b", "c"):
            paths[name] = os.path.join(directory, f"{name}.log")
            log = open(paths[name], "w")
            logs.append(log)
            processes.append(subprocess.Popen(
                [cli, "agent", "--config", config, "--rdzv", etcd.url, "--job-id", "bench",
                 "--node-addr", "127.0.0.1", "--node-id", name, "--nproc-per-node", "1",
                 "--min-nodes", "1", "--settle", "1", "--stop-grace", "2", "--lease-ttl", "4",
                 "--", "sleep", "600"],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TMPDIR=directory)))
            if name == "a":
                wait_for(lambda: "joined job" in open(paths["a"]).read(), 60, "a to join")

        def text(name):
            with open(paths[name]) as f:
                return f.read()
        wait_for(lambda: all("round 1 started: world size 3" in text(n) for n in "abc"), 120,
                 "round 1")
        kill_node(processes[1])
        time.sleep(gap)
        killed = kill_node(processes[2])
        wait_for(lambda: "started: world size 1 " in text("a"), 120, "the survivor's workers")
        survivor = text("a")
        started_ms = int(re.search(r"started: world size 1 .*started_ms=(\d+)",
                                   survivor).group(1))
        formed = re.findall(r"leader: round (\d+) formed: (.*)", survivor)
        return started_ms / 1000.0 - killed, formed[1:]
    finally:
        stop_all(processes, logs)
        etcd.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", default=os.path.join(ROOT, "build", "bin", "ductile"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gap", type=float, default=2.5)
    args = parser.parse_args()
    times = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="bench-member-lost-") as directory:
            seconds, formed = one_run(os.path.abspath(args.cli), args.gap, directory)
        times.append(seconds)
        print(f"run {run + 1}: {seconds:.2f} s; rounds formed: "
              + "; ".join(f"{r}: {why}" for r, why in formed), flush=True)
    print(f"second kill to the survivor's workers started: median {statistics.median(times):.2f} s "
          f"({min(times):.2f}-{max(times):.2f}), {args.runs} runs")


if __name__ == "__main__":
    main()
