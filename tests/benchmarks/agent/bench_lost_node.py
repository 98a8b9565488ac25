"""How soon a lost node is known: from the SIGKILL (or SIGSTOP) of one
node's process tree to the leader's `leader: round 2 formed` line. It
prints medians; nothing asserts on time.

Three `ductile agent` processes on one etcd (1 worker each, `sleep`,
--lease-ttl 3 by default, --settle 0.5, --poll-interval 0.1); node c, the
youngest, is lost. Run it against a build without links to the leader to
see the time a lease's expiry takes; with them, a killed node's link
closes at once and a stopped one's falls silent for --heartbeat.

usage: bench_lost_node.py [--cli PATH] [--runs 3] [--lease-ttl 3]
                          [--signal KILL|STOP] [--heartbeat S]
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_agent import ROOT, Etcd, descendants, stop_all, wait_for
from bench_recovery import JOB_TOML


def one_run(args, directory):
    etcd = Etcd(directory)
    config = os.path.join(directory, "job.toml")
    with open(config, "w") as f:
        f.write(JOB_TOML)
    processes, logs, paths = [], [], {}
    extra = ["--heartbeat", str(args.heartbeat)] if args.heartbeat else []
    try:
        for name in ("a", "b", "c"):
            paths[name] = os.path.join(directory, f"{name}.log")
            log = open(paths[name], "w")
            logs.append(log)
            processes.append(subprocess.Popen(
                [args.cli, "agent", "--config", config, "--rdzv", etcd.url, "--job-id", "bench",
                 "--node-addr", "127.0.0.1", "--node-id", name, "--nproc-per-node", "1",
                 "--settle", "0.5", "--poll-interval", "0.1", "--stop-grace", "1",
                 "--lease-ttl", str(args.lease_ttl), *extra, "--", "sleep", "600"],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TMPDIR=directory)))
            wait_for(lambda n=name: "joined job" in open(paths[n]).read(), 60, f"{name} to join")

        def text(name):
            with open(paths[name]) as f:
                return f.read()
        wait_for(lambda: all("round 1 started: world size 3" in text(n) for n in "abc"), 120,
                 "round 1")
        tree = descendants(processes[2].pid)
        sig = signal.SIGKILL if args.signal == "KILL" else signal.SIGSTOP
        lost_at = time.monotonic()
        for pid in tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        while "leader: round 2 formed" not in text("a"):
            if time.monotonic() - lost_at > 120:
                raise RuntimeError("no round 2 within 120 s:\n" + text("a"))
            time.sleep(0.005)
        seconds = time.monotonic() - lost_at
        how = [line.split(": ", 1)[1] for line in text("a").splitlines()
               if " lost: " in line or " silent for " in line]
        if sig == signal.SIGSTOP:
            for pid in tree:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        return seconds, how
    finally:
        stop_all(processes, logs)
        etcd.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", default=os.path.join(ROOT, "build", "bin", "ductile"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--lease-ttl", type=int, default=3)
    parser.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    parser.add_argument("--heartbeat", type=float, default=None)
    args = parser.parse_args()
    args.cli = os.path.abspath(args.cli)
    times = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="bench-lost-node-") as directory:
            seconds, how = one_run(args, directory)
        times.append(seconds)
        print(f"run {run + 1}: {seconds:.3f} s; " + ("; ".join(how) or "the lease expired"),
              flush=True)
    print(f"SIG{args.signal} of one node to `leader: round 2 formed`: median "
          f"{statistics.median(times):.3f} s ({min(times):.3f}-{max(times):.3f}), {args.runs} "
          f"runs, --lease-ttl {args.lease_ttl}")


if __name__ == "__main__":
    main()
