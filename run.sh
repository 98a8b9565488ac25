#!/usr/bin/env bash
# Quick start, part 1: install what is missing, build (Release) into build/,
# and run the main job (the demo) on the CPU backend. The test suite is built
# by test.sh in its own tree (build-test/); this tree holds the CLI, the
# plugins and the benchmark programs.
set -euo pipefail
cd "$(dirname "$0")"
source .ci/setup.sh

ductile_install_packages
ductile_python_env
ductile_configure_and_build build Release OFF -DDUCTILE_BUILD_TESTS=OFF

# The main job: a small language model trained for about a minute under
# ductile's agent, as a user runs one (samples/train_lm/README.md).
echo
echo "== build/bin/ductile agent --standalone --nproc-per-node 2 --config samples/train_lm/ds_config.json samples/train_lm/train_lm.py =="
rm -rf build/train_lm
(
  source "$DUCTILE_VENV/bin/activate"
  export PYTHONPATH="$PWD/build/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
  build/bin/ductile agent --standalone --nproc-per-node 2 --config samples/train_lm/ds_config.json \
    samples/train_lm/train_lm.py --output-dir build/train_lm
)
echo "(the epoch's batch plan: build/train_lm/batch_plan.png)"

echo
echo "== build/bin/ductile demo --config samples/configs/demo.toml =="
build/bin/ductile demo --config samples/configs/demo.toml
# >>> later capabilities append their part of the main job below this line

echo
echo "== mpirun -np 2 build/bin/ductile zero --config samples/configs/demo.toml (ZeRO-3 coordinator) =="
mpirun --allow-run-as-root --oversubscribe -np 2 \
  build/bin/ductile zero --config samples/configs/demo.toml --steps 4 --compute-us 300
