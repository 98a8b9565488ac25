#!/usr/bin/env bash
# Installs seqpacker 0.1.3 (the rival of tests/benchmarks/python/bench_packers.py)
# under build-bench/seqpacker, outside the pinned .venv: it is a benchmark's
# rival, not a dependency of ductile.
#
# Why not `pip install seqpacker`: for Linux x86_64 with glibc, 0.1.3 ships
# only a wheel tagged cp38-cp38 and one for the free-threaded 3.14t; CPython
# 3.9-3.13 get the sdist, whose Rust build needs crates.io (not reachable
# here). The cp38 wheel's module is in fact a stable-ABI build for 3.9+ (PyO3
# `abi3-py39`, per the sdist's bindings/python/Cargo.toml; it calls
# PyCMethod_New, so 3.8 itself cannot load it). Saved as `_core.abi3.so`, it
# loads on 3.11. The wheel is checked against the sha256 PyPI publishes.
#
#   tools/bench/install_seqpacker.sh        (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/../.."
wheel=seqpacker-0.1.3-cp38-cp38-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
sha256=e8814b5804b8c9b3b00beb8867e7ba6491b19091467c6eee1e7039164419ee8f
target=build-bench/seqpacker
python=.venv/bin/python
[ -x "$python" ] || { echo "install_seqpacker.sh: $python is missing; run ./run.sh first" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --only-binary=:all: --ignore-requires-python \
  --python-version 3.8 --implementation cp --abi cp38 --platform manylinux2014_x86_64 \
  --dest "$work" seqpacker==0.1.3
echo "$sha256  $work/$wheel" | sha256sum --check --quiet
rm -rf "$target"
mkdir -p "$target"
"$python" -m zipfile -e "$work/$wheel" "$target"
mv "$target/seqpacker/_core.cpython-38-x86_64-linux-gnu.so" "$target/seqpacker/_core.abi3.so"
PYTHONPATH="$target" "$python" -c "import seqpacker; print('seqpacker', seqpacker.__version__, 'in $target')"
