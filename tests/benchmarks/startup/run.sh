#!/usr/bin/env bash
# Start-up time of the `ductile` CLI as whole processes, raced against
# /bin/true on the same machine in the same run: the median wall time (and
# the mean CPU time) of RUNS runs (hyperfine, 3 warm-up runs a round), and the
# page faults of one run, of
#   /bin/true                                                (the floor)
#   ductile --version
#   ductile elastic --config <v0.1 config> --world-size N   (TOML and DeepSpeed JSON)
#   ductile config check <config>
#   ductile pack on 2,000 real lengths (the first 2,000 of the ShareGPT trace)
# (commands.sh writes them and their inputs).
# Usage: tests/benchmarks/startup/run.sh [BUILD_DIR (default build)] [RUNS (default 50)]
# Build Release first (./run.sh, or cmake --build build --target ductile_cli).
# Needs hyperfine. A program that prints figures, not a test.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
build=${1:-$root/build}
runs=${2:-50}
ductile=$build/bin/ductile
[[ -x $ductile ]] || { echo "no $ductile: build the ductile_cli target first" >&2; exit 2; }
command -v hyperfine >/dev/null || { echo "hyperfine is not installed" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export DUCTILE_LOG_LEVEL=error  # the scheduler warning would be printed on every run
# name<TAB>command line, one a command (commands.sh writes their inputs).
"$root/tests/benchmarks/startup/commands.sh" "$work" "$ductile" >"$work/commands"
mapfile -t lines <"$work/commands"
hyperfine_args=(-n "/bin/true" "/bin/true")
for line in "${lines[@]}"; do
  hyperfine_args+=(-n "${line%%$'\t'*}" "${line#*$'\t'}")
done
printf '%s\n' "/bin/true" "${lines[@]#*$'\t'}" >"$work/command-lines"

# Rounds of 10 runs each (5 at least), every command once a round: a machine
# that drifts (another process, its clock, the page cache) weighs on all of
# them alike, /bin/true included, rather than on whichever hyperfine ran last.
rounds=$(( runs / 10 > 5 ? runs / 10 : 5 ))
for round in $(seq $rounds); do
  hyperfine -N --runs $(( (runs + rounds - 1) / rounds )) --warmup 3 \
    --export-json "$work/times-$round.json" --style none "${hyperfine_args[@]}" \
    >/dev/null 2>>"$work/hyperfine.err"
done

/usr/bin/python3 - "$work" "$rounds" <<'PY'
import json, os, statistics, subprocess, sys
work, rounds = sys.argv[1], int(sys.argv[2])


def page_faults(command_line):
    """Minor page faults of one run: each maps in a page of a file or zeroes one."""
    child = subprocess.Popen(command_line.split(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(child.pid, 0)
    return usage.ru_minflt


lines = open(f"{work}/command-lines").read().splitlines()
commands = {}
for round in range(1, rounds + 1):
    for r in json.load(open(f"{work}/times-{round}.json"))["results"]:
        c = commands.setdefault(r["command"], {"times": [], "cpu": []})
        c["times"] += r["times"]
        c["cpu"].append(r["user"] + r["system"])
floor = statistics.median(commands["/bin/true"]["times"])
runs = len(commands["/bin/true"]["times"])
print(f"start-up of whole processes, {runs} runs in {rounds} rounds: median wall time, its "
      "ratio to /bin/true's, mean CPU time (user + system; steadier on a busy machine) and "
      "the page faults of a run (median of 5)")
for (name, c), line in zip(commands.items(), lines):
    median = statistics.median(c["times"])
    cpu = statistics.mean(c["cpu"]) * 1000
    faults = statistics.median(page_faults(line) for _ in range(5))
    print(f"  {name:<58} {median * 1000:7.2f} ms  {median / floor:5.2f}x   cpu {cpu:5.2f} ms"
          f"   faults {faults:4.0f}")
PY
if grep -q "outliers" "$work/hyperfine.err"; then
  echo "  (hyperfine saw statistical outliers: the machine was busy; run again on a quiet one)"
fi
