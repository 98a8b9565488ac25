#!/usr/bin/env bash
# Here, on the development machine (Debian 12): gathers into .gpu-carry/
# (git-ignored) what the lent GPU machine's image lacks for a build of
# ductile, so that the device tool can carry it there. Its image (Ubuntu
# 24.04, CUDA 13, torch 2.11 on Python 3.12, Boost 1.83 headers, fmt, spdlog,
# CLI11, nlohmann-json, doctest, libcurl, Open MPI 4.1) has no toml++: the
# Debian packages of toml++ travel and tools/gpu/on_device.sh unpacks them
# into /tmp/ductile-deps there (never into /).
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
