"""A restarted worker's start, cold and from a spare (`ductile agent
--warm-workers`), for a script that imports torch and transformers at its
top level. It prints medians; nothing asserts on time.

One node (`--standalone`, one worker): the worker fails in its first
attempt, and the agent starts the second, cold or in the spare it started
beside the first. Measured: from the agent's `round 2 started` (its
started_ms) to the worker's line after its imports (time.time() there).
With --warm-workers the spare imports torch and torch._dynamo ahead, and
the modules the script imports at its top level (transformers here);
--warm-imports torch,torch._dynamo gives the spare only those.

usage: bench_warm_imports.py [--cli PATH] [--python PATH] [--runs 5]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_agent import ROOT

SCRIPT = """
import os
import time

import torch
import transformers
from transformers import AutoConfig

print(f"imported {time.time() * 1000:.0f}", flush=True)
raise SystemExit(0 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "1" else 5)
"""

MODES = {
    "cold": [],
    "spare: torch, torch._dynamo": ["--warm-imports", "torch,torch._dynamo"],
    "spare: --warm-workers (with the script's imports)": ["--warm-workers"],
}


def start_seconds(cli, python, options, work):
    env = dict(os.environ, PYTHON_EXEC=python, OMP_NUM_THREADS="1")
    r = subprocess.run([cli, "agent", "--standalone", "--max-restarts", "1",
                        "--monitor-interval", "0.05", *options, "train.py"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    if r.returncode != 0:
        sys.exit(f"the job failed ({r.returncode}):\n{r.stderr}")
    started = re.search(r"round 2 started: .*started_ms=(\d+)", r.stderr)
    imported = re.findall(r"imported (\d+)", r.stdout)
    if not started or len(imported) != 2:
        sys.exit(f"unexpected output:\n{r.stdout}\n{r.stderr}")
    if options and "started from its spare" not in r.stderr:
        sys.exit(f"the worker did not start from its spare:\n{r.stderr}")
    return (int(imported[1]) - int(started.group(1))) / 1000.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", default=os.path.join(ROOT, "build", "bin", "ductile"))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    args.cli = os.path.abspath(args.cli)
    with tempfile.TemporaryDirectory(prefix="bench-warm-imports-") as work:
        with open(os.path.join(work, "train.py"), "w") as f:
            f.write(SCRIPT)
        print("| worker start of round 2 | median (s) | min-max (s) |")
        print("| --- | ---: | ---: |")
        for name, options in MODES.items():
            times = [start_seconds(args.cli, args.python, options, work)
                     for _ in range(args.runs)]
            print(f"| {name} | {statistics.median(times):.2f} | "
                  f"{min(times):.2f}-{max(times):.2f} |", flush=True)


if __name__ == "__main__":
    main()
