#!/usr/bin/env bash
# On the lent GPU machine, from the repository root (tools/gpu/README.md says
# how to call it): builds ductile with the cuda accelerator against the
# image's CUDA toolkit, torch's NCCL wheel and its Python 3.12, runs the GPU
# tests and benchmarks, and writes each stage's log to $OUT (the device
# tool brings those files back).
#
#   tools/gpu/on_device.sh [STAGE...]    (no stage: all of them, in order)
#
# Stages: build; tests (ctest: the cuda device suite and python/test_zero3_cuda);
# copy (accelerator_cuda_copy_bench); zero3 (bench_zero3.py --device cuda);
# flatten (bench_flatten.py llama-gpu); cpu_adam (the optimizer plugin's test on
# this host's CPU, which has the AVX-512 the development machine lacks). Every
# stage but build needs build.
# A stage that fails is reported and the next one runs; the exit status is
# that of the first failure.
set -uo pipefail
out=${OUT:-/tmp/ductile-gpu}
mkdir -p "$out"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build tests copy zero3 flatten)
build=build-gpu
deps=/tmp/ductile-deps
python=$(command -v python3)
status=0

note() { echo "== $(date -u +%H:%M:%S) $*"; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -1
  "$python" -c "import torch, transformers; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__)"
  g++ --version | head -1
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

# What the image lacks, from .gpu-carry/ (tools/gpu/prepare.sh), unpacked
# into a prefix of its own.
if [ ! -e /usr/include/toml++/toml.h ] && [ ! -e $deps/usr/include/toml++/toml.h ]; then
  for deb in .gpu-carry/debs/*.deb; do
    [ -e "$deb" ] || { echo "on_device.sh: .gpu-carry/debs is empty: run tools/gpu/prepare.sh here and carry .gpu-carry"; exit 2; }
    dpkg -x "$deb" $deps
  done
fi
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nccl=$("$python" -c "import nvidia.nccl as n; print(list(n.__path__)[0])")

run_stage() {
  local name=$1
  shift
  note "$name: $*"
  if ! "$@" >"$out/$name.log" 2>&1; then
    echo "on_device.sh: stage $name failed; the end of $out/$name.log:"
    tail -40 "$out/$name.log"
    [ $status -eq 0 ] && status=1
    return 1
  fi
  tail -60 "$out/$name.log"
}

stage_build() {
  cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDUCTILE_WITH_CUDA=ON \
    -DDUCTILE_WITH_LEVEL_ZERO=OFF -DDUCTILE_NCCL_ROOT="$nccl" -DCMAKE_PREFIX_PATH=$deps/usr \
    -DDUCTILE_PYTHON_EXECUTABLE="$python" -DDUCTILE_BUILD_PYTHON=ON &&
    cmake --build $build --parallel "$(nproc)" --target ductile_python_package \
      ductile_accelerator_cuda accelerator_cuda_device accelerator_cuda_unavailable \
      accelerator_cuda_copy_bench optimizer_cpu_adam
}

stage_tests() {
  ctest --test-dir $build -R '^(accelerator_cuda|python/test_zero3_cuda)' --output-on-failure \
    --timeout 400
}

export PYTHONPATH=$PWD/$build/python PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

for stage in "${stages[@]}"; do
  case $stage in
    build) run_stage build stage_build || break ;;
    tests) run_stage tests stage_tests ;;
    copy) run_stage copy $build/bin/accelerator_cuda_copy_bench 30 ;;
    zero3)
      # BENCH_ZERO3_PROFILE=ductile:$OUT/zero3_profile.txt in the caller's
      # environment adds a host-side profile of ductile's steps (slower).
      run_stage zero3 timeout 420 "$python" tests/benchmarks/python/bench_zero3.py --device cuda \
        --size gpu --batch 8 --steps 10 --engines ddp,fsdp2,ductile,ductile-noprefetch,ductile-mpi
      ;;
    flatten)
      run_stage flatten timeout 420 "$python" tests/benchmarks/python/bench_flatten.py llama-gpu \
        400 3
      ;;
    cpu_adam)
      # Every instruction set the CPU has against the scalar kernel, bit for
      # bit (the test names the ones it compared and the ones it lacks).
      grep -m1 -o -w 'avx512f' /proc/cpuinfo || echo "this CPU has no avx512f"
      run_stage cpu_adam timeout 300 $build/bin/optimizer_cpu_adam
      ;;
    *)
      echo "on_device.sh: stage '$stage' is not valid; use build, tests, copy, zero3, flatten or" \
        "cpu_adam"
      exit 2
      ;;
  esac
done
note "done, status $status"
exit $status
