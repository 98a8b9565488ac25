#!/usr/bin/env bash
# Start-up time of the `ductile` CLI as whole processes, raced against
# /bin/true on the same machine in the same run: the median wall time (and
# the mean CPU time) of RUNS runs (hyperfine, 5 warm-up runs) of
#   /bin/true                                                (the floor)
#   ductile --version
#   ductile elastic --config <v0.1 config> --world-size N   (TOML and DeepSpeed JSON)
#   ductile config check <config>
#   ductile pack on 2,000 real lengths (the first 2,000 of the ShareGPT trace)
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
# A heavy v0.1 configuration (a large batch cap and many micro batches): the
# computation itself takes well under a millisecond.
cat >"$work/heavy.toml" <<'TOML'
[elasticity]
version = 0.1
max_train_batch_size = 1000000
micro_batch_sizes = [2, 4, 6, 8, 12, 16, 17, 24, 32]
min_gpus = 32
max_gpus = 4096
TOML
cat >"$work/heavy.json" <<'JSON'
{"train_batch_size": 1000, "elasticity": {"enabled": true, "version": 0.1,
 "max_train_batch_size": 1000000, "micro_batch_sizes": [2, 4, 6, 8, 12, 16, 17, 24, 32],
 "min_gpus": 32, "max_gpus": 4096}}
JSON
# 2,000 real sequence lengths, one a line (tests/data/lengths: ShareGPT first
# turns, OPT tokenizer).
root_data=$root/tests/data/lengths/sharegpt_opt_first_turn_lengths.csv
/usr/bin/python3 - "$root_data" "$work/lengths.txt" <<'PY'
import csv, sys
with open(sys.argv[1]) as f:
    rows = csv.DictReader(f)
    lengths = [row["input_tokens"] for _, row in zip(range(2000), rows)]
open(sys.argv[2], "w").write("\n".join(lengths) + "\n")
PY
export DUCTILE_LOG_LEVEL=error  # the scheduler warning would be printed on every run
world=$("$ductile" elastic --config "$work/heavy.toml" --json |
  /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["valid_gpus"][-1])')

# Rounds of 10 runs each (5 at least), every command once a round: a machine
# that drifts (another process, its clock, the page cache) weighs on all of
# them alike, /bin/true included, rather than on whichever hyperfine ran last.
rounds=$(( runs / 10 > 5 ? runs / 10 : 5 ))
for round in $(seq $rounds); do
  hyperfine -N --runs $(( (runs + rounds - 1) / rounds )) --warmup 3 \
    --export-json "$work/times-$round.json" --style none \
    -n "/bin/true" "/bin/true" \
    -n "ductile --version" "$ductile --version" \
    -n "ductile elastic (v0.1 TOML, world size $world)" \
    "$ductile elastic --config $work/heavy.toml --world-size $world" \
    -n "ductile elastic (v0.1 DeepSpeed JSON, world size $world)" \
    "$ductile elastic --config $work/heavy.json --world-size $world" \
    -n "ductile config check" "$ductile config check $work/heavy.toml" \
    -n "ductile pack (2,000 lengths, greedy, max_tokens 4096)" \
    "$ductile pack --lengths $work/lengths.txt --max-tokens 4096 --effective-batch-size 2" \
    >/dev/null 2>>"$work/hyperfine.err"
done

/usr/bin/python3 - "$work" "$rounds" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
commands = {}
for round in range(1, rounds + 1):
    for r in json.load(open(f"{work}/times-{round}.json"))["results"]:
        c = commands.setdefault(r["command"], {"times": [], "cpu": []})
        c["times"] += r["times"]
        c["cpu"].append(r["user"] + r["system"])
floor = statistics.median(commands["/bin/true"]["times"])
runs = len(commands["/bin/true"]["times"])
print(f"start-up of whole processes, {runs} runs in {rounds} rounds: median wall time, its "
      "ratio to /bin/true's, and mean CPU time (user + system; steadier on a busy machine)")
for name, c in commands.items():
    median = statistics.median(c["times"])
    cpu = statistics.mean(c["cpu"]) * 1000
    print(f"  {name:<58} {median * 1000:7.2f} ms  {median / floor:5.2f}x   cpu {cpu:5.2f} ms")
PY
if grep -q "outliers" "$work/hyperfine.err"; then
  echo "  (hyperfine saw statistical outliers: the machine was busy; run again on a quiet one)"
fi
