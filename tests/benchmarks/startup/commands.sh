#!/usr/bin/env bash
# The commands whose start-up run.sh races against /bin/true: writes their
# input files into WORK and prints one line per command, "name<TAB>command line".
# Usage: tests/benchmarks/startup/commands.sh WORK DUCTILE
# (WORK an existing directory without spaces, DUCTILE the program.)
set -euo pipefail
work=${1:?usage: commands.sh WORK DUCTILE}
ductile=${2:?usage: commands.sh WORK DUCTILE}
root=$(cd "$(dirname "$0")/../../.." && pwd)

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
{"elasticity": {"enabled": true, "version": 0.1,
 "max_train_batch_size": 1000000, "micro_batch_sizes": [2, 4, 6, 8, 12, 16, 17, 24, 32],
 "min_gpus": 32, "max_gpus": 4096}}
JSON
# 2,000 real sequence lengths, one a line (tests/data/lengths: ShareGPT first
# turns, OPT tokenizer).
/usr/bin/python3 - "$root/tests/data/lengths/sharegpt_opt_first_turn_lengths.csv" \
  "$work/lengths.txt" <<'PY'
import csv, sys
with open(sys.argv[1]) as f:
    rows = csv.DictReader(f)
    lengths = [row["input_tokens"] for _, row in zip(range(2000), rows)]
open(sys.argv[2], "w").write("\n".join(lengths) + "\n")
PY
# The largest valid world size: the whole list of valid counts is computed.
world=$(DUCTILE_LOG_LEVEL=error "$ductile" elastic --config "$work/heavy.toml" --json |
  /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["valid_gpus"][-1])')

printf '%s\t%s\n' \
  "ductile --version" "$ductile --version" \
  "ductile elastic (v0.1 TOML, world size $world)" \
  "$ductile elastic --config $work/heavy.toml --world-size $world" \
  "ductile elastic (v0.1 DeepSpeed JSON, world size $world)" \
  "$ductile elastic --config $work/heavy.json --world-size $world" \
  "ductile config check" "$ductile config check $work/heavy.toml" \
  "ductile pack (2,000 lengths, greedy, max_tokens 4096)" \
  "$ductile pack --lengths $work/lengths.txt --max-tokens 4096 --effective-batch-size 2"
