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
ductile_configure_and_build build-test RelWithDebInfo ON -DDUCTILE_BUILD_BENCHMARKS=OFF

cd build-test
# No retries: a test that fails once has failed (tests/stress/run.sh repeats
# the MPI suites under load to find the rare failures).
ctest --output-on-failure --timeout 600 -j "$(ductile_jobs)" "$@"
