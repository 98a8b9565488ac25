"""The wheel a user installs with pip, and what it needs from the machine.

Built as a release is: `pip wheel` of the source tree (scikit-build-core,
Release), then `auditwheel repair`, which copies every library that is not
the manylinux policy's into the wheel and tags it (wheel_support.py). The
repaired wheel is installed with pip into a new virtual environment that
takes its requirements (torch, numpy) from the suite's. From there, with
nothing of the build or source tree on any path:

- every ELF file of the installed package finds each library it needs
  inside the package, or it is one the manylinux policy lets a wheel take
  from the system (glibc, libstdc++, ...); nothing links Open MPI, the CUDA
  runtime or NCCL;
- the CLI (`ductile`, and `ductile agent`) and the plugins work, the
  Release build's static runtime included; running, the CLI loads nothing
  from outside the package but the policy's libraries;
- zero3 trains 3 steps on 2 ranks under torchrun, no file of the build or
  source tree mapped into the workers, no libmpi either;
- Open MPI is loaded when an MPI world is asked for (mpirun), and its
  absence then is an error saying what to install;
- the cuda backend finds libcudart on the loader's path (no GPU here: "no
  usable CUDA device"), and without it names what it looked for and where.
"""

import json
import math
import os
import re
import shutil
import site
import subprocess
import sys

import pytest

import wheel_support
from conftest import SOURCE

BUILD = os.environ["DUCTILE_BINARY_DIR"]
HAS_CUDA_PLUGIN = os.path.exists(
    os.path.join(BUILD, "lib", "ductile", "plugins", "libductile_accelerator_cuda.so"))
MPIEXEC = os.environ.get("DUCTILE_MPIEXEC") or "mpirun"
# The wheel's CMake tree, kept between runs (an unchanged checkout rebuilds
# nothing), beside this build tree. It is a unity build (pyproject.toml), so
# it shares no object with run.sh's build/; ccache (paths relative to the
# checkout) serves it its own objects when the tree is gone.
WHEEL_BUILD = os.path.join(os.path.dirname(BUILD), os.path.basename(BUILD) + "-wheel")


def clean_environment(home):
    """This process's environment without what the test tree sets: no
    sanitizer runtime preloaded, no package, library or plugin path, no
    ductile variable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DUCTILE_", "ASAN_", "UBSAN_", "PYTHON"))
           and k not in ("LD_PRELOAD", "LD_LIBRARY_PATH", "DEEPSPEED_ELASTICITY_CONFIG",
                         "PIP_CONSTRAINT", "CMAKE_C_COMPILER_LAUNCHER",
                         "CMAKE_CXX_COMPILER_LAUNCHER")}
    env.update(PIP_CONSTRAINT=os.path.join(SOURCE, "requirements.txt"),
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               PIP_ROOT_USER_ACTION="ignore", HOME=str(home), OMP_NUM_THREADS="1")
    return env


run = wheel_support.run


class Installed:
    """The repaired wheel, installed into a new venv."""

    def __init__(self, root):
        self.root = root
        self.env = clean_environment(root)
        self.wheel = wheel_support.build_wheel(SOURCE, str(root / "wheel"), WHEEL_BUILD)
        with open(root / "wheel" / "auditwheel-show.txt") as f:
            self.show = f.read()
        self.venv = root / "v"
        run([sys.executable, "-m", "venv", self.venv], env=self.env, cwd=root)
        run([self.venv / "bin" / "pip", "install", "--no-deps", self.wheel], env=self.env,
            cwd=root, timeout=600)
        self.python = str(self.venv / "bin" / "python")
        self.site = run([self.python, "-c",
                         "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                        env=self.env).strip()
        # Its requirements (torch, numpy) from the suite's environment, after
        # the venv's own packages on sys.path: the suite's torch is the one a
        # user's `pip install` resolves here (requirements.txt's pin), and
        # unpacking it again would take minutes. That environment holds no
        # ductile.
        with open(os.path.join(self.site, "suite-requirements.pth"), "w") as f:
            f.write("".join(p + "\n" for p in sorted(set(site.getsitepackages()))))
        self.package = os.path.join(self.site, "ductile")
        self.libs = os.path.join(self.site, "ductile.libs")
        self.cli = os.path.join(self.package, "bin", "ductile")

    def files(self):
        """Every file pip installed from the wheel (its RECORD)."""
        [info] = [d for d in os.listdir(self.site)
                  if d.startswith("ductile-") and d.endswith(".dist-info")]
        with open(os.path.join(self.site, info, "RECORD")) as f:
            names = [line.split(",", 1)[0] for line in f if line.strip()]
        return [os.path.normpath(os.path.join(self.site, n)) for n in names]

    def inside(self, path):
        path = os.path.realpath(path)
        return any(path.startswith(os.path.realpath(p) + os.sep) for p in (self.package, self.libs))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return Installed(tmp_path_factory.mktemp("wheel"))


def system_library(name, allowed):
    return name in allowed or name.startswith("ld-linux")


def test_auditwheel_tags_it_manylinux_with_the_libraries_inside(installed):
    tag = wheel_support.platform_tag(installed.show)
    assert re.fullmatch(r"manylinux_2_\d+_x86_64", tag), installed.show
    assert os.path.basename(installed.wheel).endswith(f"-{tag}.whl"), installed.wheel
    vendored = {os.path.basename(n) for n in wheel_support.wheel_files(installed.wheel)
                if n.startswith("ductile.libs/")}
    # fmt, spdlog (the shared-runtime libraries) and libcurl (the agent's
    # etcd client), renamed by auditwheel; never MPI, CUDA or NCCL.
    for stem in ("libfmt", "libspdlog", "libcurl"):
        assert any(v.startswith(stem + "-") for v in vendored), (stem, sorted(vendored))
    for stem in ("libmpi", "libopen-", "libcudart", "libnccl", "libductile"):
        assert not any(v.startswith(stem) for v in vendored), (stem, sorted(vendored))
    metadata = wheel_support.wheel_text(installed.wheel, ".dist-info/METADATA")
    assert "Requires-Dist: torch>=2.11" in metadata


def test_every_elf_file_finds_its_libraries_in_the_package_or_the_policy(installed):
    allowed = set(wheel_support.policy(wheel_support.platform_tag(installed.show))["lib_whitelist"])
    elves = [f for f in installed.files() if os.path.isfile(f) and wheel_support.is_elf(f)]
    assert any(f.endswith(os.path.join("bin", "ductile")) for f in elves)
    assert any(f.endswith("ductile-agent") for f in elves)
    assert any(os.path.basename(f).startswith("_ductile") for f in elves)
    assert len(elves) > 15, elves
    problems = []
    for elf in elves:
        needed, run_paths = wheel_support.dynamic_section(elf)
        for entry in run_paths:
            if not entry.startswith("$ORIGIN"):
                problems.append(f"{elf}: run path entry {entry!r} is not relative to $ORIGIN")
        for name in needed:
            found = wheel_support.resolve(elf, name, run_paths)
            if found is not None and installed.inside(found):
                continue
            if system_library(name, allowed):
                continue
            problems.append(f"{elf}: needs {name}, found {found or 'not in the package'}, "
                            "and the manylinux policy does not let it come from the system")
        for forbidden in ("libmpi", "libcudart", "libnccl", "libcuda."):
            if any(n.startswith(forbidden) for n in needed):
                problems.append(f"{elf}: links {forbidden}*: {needed}")
    assert not problems, "\n".join(problems)


def loaded_by(command, env, cwd):
    """Runs `command` with the loader's debug output: (its stdout, the path
    of every object the loader initialised)."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env=dict(env, LD_DEBUG="libs"), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    paths = re.findall(r"calling init: (\S+)", proc.stderr)
    assert paths, proc.stderr[-2000:]
    return proc.stdout, paths


def test_cli_and_plugins_load_nothing_from_outside_the_package(installed, tmp_path):
    env, cli = installed.env, installed.cli
    allowed = set(wheel_support.policy(wheel_support.platform_tag(installed.show))["lib_whitelist"])
    # The command on PATH is the C++ CLI of this build.
    version = run([installed.venv / "bin" / "ductile", "--version"], env=env)
    built = run([os.path.join(BUILD, "bin", "ductile"), "--version"], env=env)
    assert version == built and version.strip()
    out, paths = loaded_by([cli, "plugins", "list", "--json"], env, tmp_path)
    listed = json.loads(out)
    assert listed["problems"] == [] and len(listed["plugins"]) >= 10, listed
    names = {os.path.basename(p["file"]) for p in listed["plugins"]}
    assert "libductile_accelerator_cpu.so" in names
    assert ("libductile_accelerator_cuda.so" in names) == HAS_CUDA_PLUGIN, names
    outside = [p for p in paths
               if not installed.inside(p) and not system_library(os.path.basename(p), allowed)]
    assert not outside, outside
    assert any(installed.inside(p) and "libductile_accelerator_common" in p for p in paths)
    assert not [p for p in paths if re.search(r"lib(mpi|cudart|nccl)", p)], paths
    # `ductile agent`: its own program, with libcurl from the wheel.
    out, paths = loaded_by([cli, "agent", "--help"], env, tmp_path)
    assert "Usage: ductile agent" in out
    curl = [p for p in paths if "libcurl" in os.path.basename(p)]
    assert curl and all(installed.inside(p) for p in curl), curl
    outside = [p for p in paths
               if not installed.inside(p) and not system_library(os.path.basename(p), allowed)]
    assert not outside, outside
    job = tmp_path / "ds.json"
    job.write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 2000,
                                              "micro_batch_sizes": [2, 4, 6], "version": 0.1}}))
    answer = json.loads(run([cli, "elastic", "--config", job, "--world-size", 8, "--json"],
                            env=env))
    assert answer["final_batch_size"] == 1680 and answer["micro_batch_size"] == 6
    check_static_runtime(installed, tmp_path)


def demo_config(tmp_path, name, **accelerator):
    """samples/configs/demo.toml with [accelerator] keys replaced."""
    with open(os.path.join(SOURCE, "samples", "configs", "demo.toml")) as f:
        text = f.read()
    for key, value in accelerator.items():
        text, count = re.subn(rf'(?m)^{key} = .*$', f'{key} = "{value}"', text, count=1)
        assert count == 1, key
    path = tmp_path / name
    path.write_text(text)
    return path


def test_open_mpi_is_loaded_when_an_mpi_world_is_asked_for(installed, tmp_path):
    config = demo_config(tmp_path, "demo.toml")
    launcher = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader",
                "--bind-to", "none", "-np", "2"]
    out = run(launcher + [installed.cli, "zero", "--config", config, "--steps", "2",
                          "--compute-us", "100"], env=installed.env, cwd=tmp_path, timeout=300)
    assert out.strip(), out
    # Without Open MPI, an MPI world fails with what to install; nothing
    # else needs it (the checks above ran without it loaded).
    mpi = demo_config(tmp_path, "mpi.toml", communicator="mpi")
    missing = subprocess.run([installed.cli, "zero", "--config", mpi, "--steps", "1"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env=dict(installed.env, DUCTILE_MPI_LIBRARY="libmpi-absent.so.40"))
    assert missing.returncode == 2, missing
    assert "libmpi-absent.so.40 could not be loaded" in missing.stderr, missing.stderr
    assert "Install Open MPI" in missing.stderr, missing.stderr


TORCHRUN_WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
import ductile
import ductile.torch.zero3 as zero3

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
plain.load_state_dict(model.state_dict())
config = ductile.load_config({"accelerator": {"backend": "cpu"},
                              "zero": {"coordinator": "partitioned"}}, format="toml")
engine = zero3.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), config)
reference = torch.optim.SGD(plain.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randn(32, 1)  # the same batch on both ranks
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
with open("/proc/self/maps") as f:
    mapped = sorted({line.split()[-1] for line in f if len(line.split()) >= 6
                     and line.split()[-1].startswith("/")})
result = {"rank": dist.get_rank(), "size": dist.get_world_size(), "file": ductile.__file__,
          "losses": losses, "mapped": mapped,
          "plugins": sorted(p["file"] for p in ductile.plugins())}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
"""


def test_zero3_trains_on_two_ranks_under_torchrun_from_the_venv(installed, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(TORCHRUN_WORKER)
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run([installed.python, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", port, "--monitor-interval", "0.1",
         worker, tmp_path],
        env=installed.env, cwd=tmp_path, timeout=300)
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["size"] == 2 and out["file"] == os.path.join(installed.package, "__init__.py")
        assert len(out["losses"]) == 3
        for ours, reference in out["losses"]:
            assert abs(ours - reference) <= 1e-6 * abs(reference), out["losses"]
        assert out["losses"][2][0] < out["losses"][0][0], out["losses"]
        assert out["plugins"] and all(installed.inside(f) for f in out["plugins"])
        # Nothing of the build or source tree, no Open MPI: everything of
        # ductile's comes from the installed package.
        suite = tuple(p + os.sep for p in site.getsitepackages())
        for path in out["mapped"]:
            assert not path.startswith(BUILD + os.sep), path
            assert not path.startswith(SOURCE + os.sep) or path.startswith(suite), path
            assert not re.search(r"/lib(mpi|open-pal|open-rte)\.so", path), path
        ours = [p for p in out["mapped"] if re.search(r"libductile|_ductile|libfmt|libspdlog", p)]
        assert ours and all(installed.inside(p) for p in ours), ours


def cuda_directories():
    """The directories holding the CUDA runtime this machine's loader finds."""
    found = set()
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        if "libcudart.so" in line and "=>" in line:
            found.add(os.path.dirname(os.path.realpath(line.split("=>")[1].strip())))
    for candidate in ("/usr/local/cuda/lib64",):
        if os.path.exists(os.path.join(candidate, "libcudart.so.13")):
            found.add(os.path.realpath(candidate))
    return sorted(found)


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="this build has no cuda accelerator")
def test_cuda_backend_finds_its_libraries_at_run_time_or_names_them(installed, tmp_path):
    config = demo_config(tmp_path, "cuda.toml", backend="cuda", communicator="local")
    proc = subprocess.run([installed.cli, "zero", "--config", config, "--steps", "1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=installed.env)
    assert proc.returncode == 2, proc
    if cuda_directories():
        # The CUDA runtime on the loader's path, no GPU.
        assert "no usable CUDA device" in proc.stderr, proc.stderr
    dirs = cuda_directories()
    if shutil.which("unshare") is None:
        pytest.skip("no unshare: cannot hide the CUDA runtime from the loader")
    # The same with the CUDA runtime gone (empty directories mounted over
    # its own, in a mount namespace of this command alone).
    hide = "".join(f"mount -t tmpfs none '{d}' && " for d in dirs)
    proc = subprocess.run(["unshare", "--mount", "sh", "-c",
                           f"{hide}exec '{installed.cli}' zero --config '{config}' --steps 1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=installed.env)
    if "Operation not permitted" in proc.stderr or "unshare failed" in proc.stderr:
        pytest.skip(f"cannot make a mount namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 2, proc
    message = proc.stderr
    assert "libcudart.so.13) was not found" in message, message
    assert os.path.join(installed.site, "nvidia", "cu13", "lib") in message, message
    assert "LD_LIBRARY_PATH" in message and "pip install" in message, message
    # No directory of the machine that built the wheel.
    assert BUILD not in message and SOURCE not in message, message


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


def needed(binary):
    return set(wheel_support.dynamic_section(binary)[0])


def check_static_runtime(installed, cwd):
    """The Release build links the C++ runtime, fmt, spdlog and TOML++ into
    the program and the built-in plugins (DUCTILE_STATIC_RUNTIME), the
    accelerators keep the shared ones, and everything still works together
    after auditwheel's repair: errors cross between them, and one exception
    state serves the process."""
    env, program = installed.env, installed.cli
    plugins = os.path.join(installed.package, "lib", "ductile", "plugins")
    assert needed(program) <= SYSTEM_ONLY, (NOT_WRAPPED, needed(program))
    static_plugins = [os.path.join(plugins, f"libductile_{name}.so") for name in (
        "elasticity_v0.1", "elasticity_v0.2", "elasticity_optimal", "batching_greedy",
        "batching_bfd", "lr_linear", "lr_sqrt", "lr_none", "zero_partitioned")]
    for plugin in static_plugins:
        assert needed(plugin) <= SYSTEM_ONLY, (NOT_WRAPPED, plugin, needed(plugin))
    assert "libstdc++.so.6" in needed(os.path.join(plugins, "libductile_accelerator_cpu.so"))

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
    host = demo_config(cwd, "host-communicator.toml", communicator="host")
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
                           "--json"], env=env, cwd=cwd))
    cosine = [0.01 + 0.5 * (0.1 - 0.01) * (1.0 + math.cos(math.pi * (step - 1) / 4))
              for step in range(1, 5)]
    assert plan["lrs"] == [0.01] + cosine, plan["lrs"]

    # In Python (the shared libstdc++), a plugin's errors leave the process's
    # count of uncaught exceptions at 0: the plugin's runtime uses the
    # process's exception state (sdk/static_runtime/shared_exception_state.cpp).
    out = json.loads(run([installed.python, "-c", UNCAUGHT_AFTER_PLUGIN_ERRORS], env=env,
                         cwd=cwd))
    assert out == {"errors": ["ElasticityIncompatibleWorldSize"] * 3, "uncaught": 0}, out
