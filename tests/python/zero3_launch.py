"""Starting zero3 test jobs (not a test by itself): zero3_worker.py as one
process, or as N ranks under torchrun (torch.distributed over gloo, the
host's communicator) or under mpirun (Open MPI), with a JSON spec."""

import json
import os
import socket
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "zero3_worker.py")
MPIEXEC = os.environ.get("DUCTILE_MPIEXEC") or "mpirun"
LAUNCHERS = ("torchrun", "mpirun")

CONFIG = """
[accelerator]
backend = "cpu"
communicator = "auto"
timeout = 120

[zero]
coordinator = "partitioned"
prefetch_bucket_size = 20000
max_live_parameters = 40000
max_reuse_distance = 10000
param_persistence_threshold = 300
max_ongoing_fetch_events = 2
"""


# The same with limits a transformer block of the test LM (49,664 elements)
# fits, so that the default groups (one a block) are prefetched one ahead.
BLOCKS_CONFIG = CONFIG.replace("prefetch_bucket_size = 20000", "prefetch_bucket_size = 60000") \
    .replace("max_live_parameters = 40000", "max_live_parameters = 150000") \
    .replace("max_reuse_distance = 10000", "max_reuse_distance = 0")
assert BLOCKS_CONFIG.count("= 60000") == BLOCKS_CONFIG.count("= 150000") == 1

# The same on the GPU (tools/gpu/), and cuBLAS made deterministic for
# torch.use_deterministic_algorithms in the workers.
CUDA_CONFIG = BLOCKS_CONFIG.replace('backend = "cpu"', 'backend = "cuda"')
assert CUDA_CONFIG != BLOCKS_CONFIG, "CONFIG no longer names backend = \"cpu\""
CUDA_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


# Memory given back when freed, so that the resident set measures what is
# alive: glibc maps every block from 128 KiB (its threshold would otherwise
# grow with the first large free, and freed heap stays resident), and the
# sanitizer's allocator keeps no quarantine (its shadow memory, an eighth of
# what the program touches, still counts).
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072",
              "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:quarantine_size_mb=0:"
                              "thread_local_quarantine_size_kb=0:"
                              "allocator_release_to_os_interval_ms=0:malloc_context_size=0"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(ranks, launcher, script, *args):
    """The command line running `script args` on `ranks` ranks."""
    base = [sys.executable, script, *args]
    if ranks is None:
        return base
    if launcher == "mpirun":
        return [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader",
                "--bind-to", "none", "-np", str(ranks)] + base
    if launcher == "torchrun":
        # --standalone: torchrun's rendezvous store listens on a port it
        # binds itself, and the workers meet there (a port picked here could
        # be taken by a test running beside this one before torchrun binds it).
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(ranks), "--monitor-interval", "0.1"] + base[1:]
    raise ValueError(f"unknown launcher {launcher!r}")


def environment(sanitized=True):
    """The test's environment for a job; without `sanitized`, without the
    sanitizer runtime the build preloads (a job of plain torch whose
    allocation failure is the point: AddressSanitizer would abort instead)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    if not sanitized:
        env.pop("LD_PRELOAD", None)
        env.pop("ASAN_OPTIONS", None)
    return env


def prepare(tmp, name, spec, config):
    """Writes the run's TOML and spec.json into tmp/name; returns the spec's path."""
    out = tmp / name
    out.mkdir(parents=True, exist_ok=True)
    config_path = tmp / f"{name}.toml"
    config_path.write_text(config)
    spec = dict(spec, out=str(out), zero_config=str(config_path))
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    return spec_path


def results(out, ranks, all_ranks, stderr):
    """(result, params, stderr) of the run written to `out`."""
    if all_ranks:
        result = []
        for r in range(ranks or 1):
            with open(out / f"result-rank{r}.json") as f:
                result.append(json.load(f))
    else:
        with open(out / "result.json") as f:
            result = json.load(f)
    params = torch.load(out / "params.pt") if (out / "params.pt").exists() else None
    return result, params, stderr


def launch(tmp, name, spec, ranks=None, launcher="mpirun", config=CONFIG, all_ranks=False,
           expect_failure=False, timeout=280, worker=WORKER, sanitized=True, env=None):
    """Runs `worker` (zero3_worker.py); returns (result, params, stderr): rank 0's
    result.json (or every rank's, as a list, with all_ranks) and
    params.pt (None when absent)."""
    spec_path = prepare(tmp, name, spec, config)
    proc = subprocess.run(command(ranks, launcher, worker, str(spec_path)), check=False,
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(environment(sanitized), **(env or {})))
    if expect_failure:
        assert proc.returncode != 0, f"{name} succeeded:\n{proc.stdout}\n{proc.stderr}"
        return None, None, proc.stderr
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return results(tmp / name, ranks, all_ranks, proc.stderr)


def launch_batch(tmp, runs, ranks, launcher="torchrun", worker=WORKER, timeout=280):
    """Runs several runs of `worker` one after another in the same job: one
    start of the launcher and one import of torch a rank for all of them
    (about 7 s of every 2-rank job on 2 cores). `runs` is a list of (name,
    spec, config); the worker takes their spec paths in that order (a run
    may load what an earlier one saved). Returns {name: (result, params,
    stderr)} as launch() does, with the job's stderr."""
    paths = [str(prepare(tmp, name, spec, config)) for name, spec, config in runs]
    proc = subprocess.run(command(ranks, launcher, worker, *paths), check=False,
                          capture_output=True, text=True, timeout=timeout, env=environment())
    names = ", ".join(name for name, _, _ in runs)
    assert proc.returncode == 0, \
        f"{names} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return {name: results(tmp / name, ranks, False, proc.stderr) for name, _, _ in runs}


def one_line_changed(script, old, new, folder):
    """A copy of `script` in `folder` with its line `old` replaced by `new`
    and nothing else changed (the drop-in tests' one-line migration); its
    path."""
    text = open(script).read()
    assert text.count(old) == 1, f"{script} has {text.count(old)} lines {old!r}"
    changed = text.replace(old, new)
    differing = [a for a, b in zip(text.splitlines(), changed.splitlines()) if a != b]
    assert len(text.splitlines()) == len(changed.splitlines()) and len(differing) == 1
    path = os.path.join(folder, "changed_" + os.path.basename(script))
    with open(path, "w") as f:
        f.write(changed)
    return path


# First on the PYTHONPATH of DeepSpeed's own runs: its sitecustomize.py
# gives their gloo groups one worker thread, the order DeepSpeed's ZeRO-3
# gathers rely on (the file says why).
ORDERED_GLOO = os.path.join(HERE, "ordered_gloo")


def rival_environment():
    """environment() for a run of DeepSpeed's own: its gloo groups run
    their operations in order."""
    env = environment()
    env["PYTHONPATH"] = os.pathsep.join([ORDERED_GLOO, env["PYTHONPATH"]])
    return env


def torchrun_script(script, args, ranks=2, timeout=400, rival=False):
    """`script args` on `ranks` ranks under torchrun (DeepSpeed on its CPU
    accelerator); its stdout. Fails the test, with the output's end, when
    the job fails. With `rival`, a run of DeepSpeed's own (the unchanged
    script): its gloo groups run their operations in order."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), script, *args]
    env = rival_environment() if rival else environment()
    env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{command}:\n" + done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout

