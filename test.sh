#!/usr/bin/env bash
# Quick start, part 2: install what is missing, build with assertions,
# AddressSanitizer and UndefinedBehaviorSanitizer into build-test/ (run.sh's
# Release tree build/ is left alone), and run the
# whole test suite (multi-rank MPI tests included) through ctest.
set -euo pipefail
cd "$(dirname "$0")"
source .ci/setup.sh

ductile_install_packages
ductile_python_env
# -O1 -g1: AddressSanitizer's recommended optimisation, and line tables
# only (what its reports need): each file compiles in about half the time
# of RelWithDebInfo's -O2 -g (cmd_pack.cpp 79 -> 41 s, zero_binding.cpp
# 75 -> 37 s, agent_test.cpp 75 -> 36 s, measured one by one without ccache).
# Unity build: a target's sources compiled 8 to a translation unit, so the
# headers they share (CLI11, pybind11, toml++, doctest, fmt) are parsed and
# their inline code generated once a batch: a cold build of this tree takes
# half the CPU time (2,750 -> 1,400 s). run.sh's build/ stays one file a
# unit, which also checks that each file includes what it uses.
ductile_configure_and_build build-test RelWithDebInfo ON -DDUCTILE_BUILD_BENCHMARKS=OFF \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
  -DCMAKE_UNITY_BUILD=ON

cd build-test
# No retries: a test that fails once has failed (tests/stress/run.sh repeats
# the MPI suites under load to find the rare failures).
ctest --output-on-failure --timeout 600 -j "$(ductile_jobs)" "$@"
