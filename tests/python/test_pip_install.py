"""`pip install .` from the source tree into a new virtual environment (the
PEP 517 build through scikit-build-core, Release), as a user does it:

    python3 -m venv v && v/bin/pip install . && v/bin/ductile --version
    v/bin/python -c "import ductile.torch.zero3"

with requirements.txt as pip's constraints (PIP_CONSTRAINT, which the
isolated build environment inherits too), so that torch resolves to the CPU
wheel this machine keeps on disk and the build tools to the pinned ones.
Then the installed package, with no environment variable pointing anywhere,
finds its plugins inside itself and trains a model with zero3.
"""

import json
import math
import os
import re
import subprocess
import sys

from conftest import SOURCE

BUILD = os.environ["DUCTILE_BINARY_DIR"]


def clean_environment(tmp_path):
    """This process's environment without what the test tree sets: no
    sanitizer runtime preloaded, no package or plugin path, no ductile
    variable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DUCTILE_", "ASAN_", "UBSAN_", "PYTHON"))
           and k not in ("LD_PRELOAD", "DEEPSPEED_ELASTICITY_CONFIG", "PIP_CONSTRAINT")}
    env.update(PIP_CONSTRAINT=os.path.join(SOURCE, "requirements.txt"),
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               PIP_ROOT_USER_ACTION="ignore", HOME=str(tmp_path))
    return env


def run(command, env, cwd, timeout=120):
    proc = subprocess.run([str(c) for c in command], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)
    assert proc.returncode == 0, (
        f"{command} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


ZERO3_CHECK = r"""
import json, os, sys
import torch
import ductile, ductile.torch.zero3 as zero3

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
plain.load_state_dict(model.state_dict())
config = {"accelerator": {"backend": "cpu"}, "zero": {"coordinator": "partitioned"}}
engine = zero3.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), config)
reference = torch.optim.SGD(plain.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randn(32, 1)
losses = []
for _ in range(3):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    ref = torch.nn.functional.mse_loss(plain(x), y)
    ref.backward()
    reference.step()
    reference.zero_grad()
    losses.append([loss.item(), ref.item()])
print(json.dumps({"file": ductile.__file__, "version": ductile.__version__,
                  "torch": torch.__version__, "losses": losses,
                  "plugins": sorted(p["file"] for p in ductile.plugins())}))
"""


def test_pip_install_gives_the_cli_and_the_package_with_its_plugins(tmp_path):
    env = clean_environment(tmp_path)
    venv = tmp_path / "v"
    run([sys.executable, "-m", "venv", venv], env, tmp_path)
    run([venv / "bin" / "pip", "install", SOURCE], env, tmp_path, timeout=1500)

    # The command on PATH is the C++ CLI of this build.
    version = run([venv / "bin" / "ductile", "--version"], env, tmp_path)
    built = run([os.path.join(BUILD, "bin", "ductile"), "--version"], env, tmp_path)
    assert version == built and version.strip()
    job = tmp_path / "ds.json"
    job.write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 2000,
                                              "micro_batch_sizes": [2, 4, 6], "version": 0.1}}))
    answer = json.loads(run([venv / "bin" / "ductile", "elastic", "--config", job,
                             "--world-size", 8, "--json"], env, tmp_path))
    assert answer["final_batch_size"] == 1680 and answer["micro_batch_size"] == 6

    # The package: imported from the venv, plugins from inside it, zero3 trains.
    out = json.loads(run([venv / "bin" / "python", "-c", ZERO3_CHECK], env, tmp_path))
    site = run([venv / "bin" / "python", "-c",
                "import sysconfig; print(sysconfig.get_paths()['platlib'])"], env,
               tmp_path).strip()
    package = os.path.join(site, "ductile")
    assert out["file"] == os.path.join(package, "__init__.py")
    assert out["version"] == version.split()[1]
    assert out["torch"].startswith("2.")
    assert out["plugins"] and all(
        f.startswith(os.path.join(package, "lib", "ductile", "plugins") + os.sep)
        for f in out["plugins"])
    names = {os.path.basename(f) for f in out["plugins"]}
    assert {"libductile_elasticity_v0.1.so", "libductile_batching_greedy.so",
            "libductile_zero_partitioned.so", "libductile_accelerator_cpu.so"} <= names
    for ours, reference in out["losses"]:
        assert abs(ours - reference) <= 1e-6 * abs(reference), out["losses"]
    # Relocatable: every library and program finds the others through
    # $ORIGIN, never through a path of the build that made them.
    binaries = [os.path.join(root, f) for root, _, files in os.walk(package) for f in files
                if ".so" in f or root.endswith(os.path.join("ductile", "bin"))]
    assert len(binaries) > 10
    for binary in binaries:
        dynamic = run(["readelf", "-d", binary], env, tmp_path)
        for line in dynamic.splitlines():
            if "(RUNPATH)" in line or "(RPATH)" in line:
                paths = line.split("[", 1)[1].rstrip("]").split(":")
                assert all(p.startswith("$ORIGIN") for p in paths), (binary, line)
    check_static_runtime(env, tmp_path, venv, package)


# What the `ductile` program and the built-in plugins of a Release build may
# need: the C library alone. libm and the unwinder (libgcc_s) are loaded on
# their first call (sdk/static_runtime/lazy_libm.cpp, lazy_unwinder.cpp;
# docs/architecture.md, "Start-up").
SYSTEM_ONLY = {"libc.so.6", "ld-linux-x86-64.so.2"}
NOT_WRAPPED = ("libm or libgcc_s is needed again: a function of theirs that the static runtime "
               "does not wrap is called (DUCTILE_LAZY_LIBM_FUNCTIONS and "
               "DUCTILE_LAZY_UNWINDER_FUNCTIONS in sdk/static_runtime/CMakeLists.txt)")

UNCAUGHT_AFTER_PLUGIN_ERRORS = r"""
import ctypes, json
from ductile.elasticity import compute_elastic_config
config = {"elasticity": {"enabled": True, "max_train_batch_size": 2000,
                         "micro_batch_sizes": [2, 4, 6], "version": 0.1}}
errors = []
for _ in range(3):
    try:
        compute_elastic_config(config, target_deepspeed_version="0.19.7", world_size=997)
    except Exception as e:
        errors.append(type(e).__name__)
count = ctypes.CDLL("libstdc++.so.6")._ZSt19uncaught_exceptionsv
count.restype = ctypes.c_int
print(json.dumps({"errors": errors, "uncaught": count()}))
"""


def needed(binary, env, cwd):
    dynamic = run(["readelf", "-d", binary], env, cwd)
    return {line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines()
            if "(NEEDED)" in line}


def sections(binary, env, cwd):
    """Name -> (address, size) of each section of `binary`."""
    found = {}
    for line in run(["readelf", "-SW", binary], env, cwd).splitlines():
        match = re.search(r"\]\s+(\S+)\s+\S+\s+([0-9a-f]{16})\s+[0-9a-f]+\s+([0-9a-f]+)", line)
        if match:
            found[match[1]] = (int(match[2], 16), int(match[3], 16))
    return found


def check_startup_functions_first(program, plugins, env, cwd):
    """The functions start-up runs lead the text of the program and of each
    built-in plugin with the static runtime, in a section of their own
    (sdk/static_runtime/startup_functions.txt), the program's entry point
    (_start) among them."""
    placed = sections(program, env, cwd)
    assert ".text.ductile_startup" in placed, (program, sorted(placed))
    start, size = placed[".text.ductile_startup"]
    header = run(["readelf", "-h", program], env, cwd)
    entry = int(re.search(r"Entry point address:\s+0x([0-9a-f]+)", header)[1], 16)
    assert start <= entry < start + size, (hex(entry), hex(start), hex(size))
    for plugin in plugins:
        placed = sections(plugin, env, cwd)
        assert placed.get(".text.ductile_startup", (0, 0))[1] > 0, (plugin, placed)
        # In front of the rest of the text: the start of the mapped code.
        assert placed[".text.ductile_startup"][0] < placed[".text"][0], (plugin, placed)


def check_static_runtime(env, cwd, venv, package):
    """The Release build links the C++ runtime, fmt, spdlog and TOML++ into
    the program and the built-in plugins (DUCTILE_STATIC_RUNTIME), the
    accelerators keep the shared ones, and everything still works together:
    errors cross between them, and one exception state serves the process."""
    program = os.path.join(package, "bin", "ductile")
    plugins = os.path.join(package, "lib", "ductile", "plugins")
    assert needed(program, env, cwd) <= SYSTEM_ONLY, (NOT_WRAPPED, needed(program, env, cwd))
    static_plugins = [os.path.join(plugins, f"libductile_{name}.so") for name in (
        "elasticity_v0.1", "elasticity_v0.2", "elasticity_optimal", "batching_greedy",
        "batching_bfd", "lr_linear", "lr_sqrt", "lr_none", "zero_partitioned")]
    for plugin in static_plugins:
        assert needed(plugin, env, cwd) <= SYSTEM_ONLY, (NOT_WRAPPED, plugin,
                                                         needed(plugin, env, cwd))
    check_startup_functions_first(program, static_plugins, env, cwd)
    cpu = needed(os.path.join(plugins, "libductile_accelerator_cpu.so"), env, cwd)
    assert "libstdc++.so.6" in cpu

    # Every plugin loads into the program, the shared-runtime ones too.
    listed = json.loads(run([program, "plugins", "list", "--json"], env, cwd))
    assert listed["problems"] == [] and len(listed["plugins"]) >= 10, listed

    # A plugin's error, thrown in the plugin's runtime, is caught by the
    # program's: a user error (2) with the plugin's message.
    job = cwd / "ds-static.json"
    job.write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 2000,
                                              "micro_batch_sizes": [2, 4, 6], "version": 0.1}}))
    refused = subprocess.run([program, "elastic", "--config", str(job), "--world-size", "997"],
                             capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    assert refused.returncode == 2, refused
    assert "World size (997) is not valid" in refused.stderr, refused.stderr

    # The program's own first exception (CLI11's parse error) loads the
    # unwinder the same way.
    unknown = subprocess.run([program, "elastic", "--config", str(job), "--no-such-flag"],
                             capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    assert unknown.returncode == 2 and "--no-such-flag" in unknown.stderr, unknown

    # An error thrown by the shared libstdc++ of an accelerator (which loads
    # libgcc_s itself) is caught in a built-in plugin with the static runtime
    # and reported by the program: all three unwind with one libgcc_s.
    with open(os.path.join(SOURCE, "samples", "configs", "demo.toml")) as f:
        demo = f.read()
    host = cwd / "host-communicator.toml"
    host.write_text(demo.replace('communicator = "auto"', 'communicator = "host"'))
    assert 'communicator = "host"' in host.read_text()
    created = subprocess.run([program, "zero", "--config", str(host), "--steps", "1"],
                             capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    assert created.returncode == 2, created
    assert "none was offered" in created.stderr, created.stderr

    # A cosine schedule calls libm's cos, loaded on that call: the same
    # values as Python's math.cos gives.
    lengths = cwd / "eight-lengths.txt"
    lengths.write_text("".join(f"{n}\n" for n in range(100, 900, 100)))
    plan = json.loads(run([program, "pack", "--lengths", str(lengths), "--max-tokens", "1000",
                           "--effective-batch-size", "1", "--schedule", "warmup_cosine",
                           "--warmup-steps", "1", "--total-steps", "5", "--base-lr", "0.1",
                           "--min-lr", "0.01", "--base-batch-size", "1", "--lr-rule", "none",
                           "--json"], env, cwd))
    cosine = [0.01 + 0.5 * (0.1 - 0.01) * (1.0 + math.cos(math.pi * (step - 1) / 4))
              for step in range(1, 5)]
    assert plan["lrs"] == [0.01] + cosine, plan["lrs"]

    # The agent program, run in the CLI's place.
    agent = run([program, "agent", "--help"], env, cwd)
    assert "Usage: ductile agent" in agent

    # In Python (the shared libstdc++), a plugin's errors leave the process's
    # count of uncaught exceptions at 0: the plugin's runtime uses the
    # process's exception state (sdk/static_runtime/shared_exception_state.cpp).
    out = json.loads(run([venv / "bin" / "python", "-c", UNCAUGHT_AFTER_PLUGIN_ERRORS], env, cwd))
    assert out == {"errors": ["ElasticityIncompatibleWorldSize"] * 3, "uncaught": 0}, out
