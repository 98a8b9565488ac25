#!/usr/bin/env bash
# Builds the libFuzzer targets in their own tree (build-fuzz/, clang-14,
# ASan+UBSan, coverage-instrumented core and plugins) and runs each target
# for SECONDS, at most JOBS (default 2) at a time, at nice 19.
#
#   tests/fuzz/run.sh SECONDS [TARGET...]
#
# Each target starts from tests/fuzz/corpus/<target> and its regressions;
# inputs it finds that add coverage go to build-fuzz/corpus/<target> (not
# committed), crashes to build-fuzz/crashes/<target>/ (crash-*, oom-*,
# timeout-*); a target goes on after a crash (fork mode) until SECONDS are
# up. A crash input belongs in tests/fuzz/regressions/<target>/ once
# its fix is in: ctest replays it in every build. Exit 1 when a target found
# a crash.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
seconds="${1:?usage: tests/fuzz/run.sh SECONDS [TARGET...]}"
shift
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(config_toml deepspeed_elasticity deepspeed_batching lengths_text lengths_csv
           lengths_npy lengths_mmidx plugin_descriptor elf_symbols agent_round agent_failure
           agent_node agent_settings agent_error_file agent_checkpoint)
fi
jobs="${JOBS:-2}"
tree="${FUZZ_BUILD_DIR:-$root/build-fuzz}"

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
cmake -S "$root" -B "$tree" -G Ninja -Wno-dev -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 "${launcher[@]}" \
  -DDUCTILE_FUZZ=ON -DDUCTILE_BUILD_TESTS=OFF -DDUCTILE_BUILD_BENCHMARKS=OFF \
  -DDUCTILE_WITH_CUDA=OFF -DDUCTILE_WITH_LEVEL_ZERO=OFF >/dev/null
cmake --build "$tree" -j"$jobs" --target "${targets[@]/#/fuzz_}"

# The shared sanitizer runtime (-shared-libsan) lives with clang.
export LD_LIBRARY_PATH="$(dirname "$(clang-14 -print-file-name=libclang_rt.asan-x86_64.so)")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Leaks are reported but do not stop the run (a leak is not a crash of the
# input); allocations over 2 GiB are findings (malloc limit below).
# libFuzzer's static part pulls libstdc++ in ahead of the shared ASan
# runtime; the order does not matter here (nothing intercepted runs first).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:verify_asan_link_order=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

status=0
run_one() {
  local t="$1"
  mkdir -p "$tree/corpus/$t" "$tree/crashes/$t" "$tree/logs"
  local seeds=("$here/corpus/$t")
  if compgen -G "$here/regressions/$t/[!.]*" >/dev/null; then seeds+=("$here/regressions/$t"); fi
  nice -n 19 "$tree/bin/fuzz_$t" "$tree/corpus/$t" "${seeds[@]}" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2560 -malloc_limit_mb=2048 \
    -max_len=8192 -artifact_prefix="$tree/crashes/$t/" -print_final_stats=1 \
    -fork=1 -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1 \
    >"$tree/logs/$t.log" 2>&1
}
pids=()
names=()
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
  echo "fuzzing $t for ${seconds}s (log: $tree/logs/$t.log)"
  run_one "$t" &
  pids+=($!)
  names+=("$t")
done
for i in "${!pids[@]}"; do wait "${pids[$i]}" || true; done
for t in "${targets[@]}"; do
  last=$(grep -h "^#[0-9]" "$tree/logs/$t.log" 2>/dev/null | tail -1 | cut -c1-100)
  found=$(find "$tree/crashes/$t" -type f | wc -l)
  echo "$t: ${found} finding(s); last status: ${last:-none}"
  if [ "$found" -gt 0 ]; then status=1; fi
done
exit $status
