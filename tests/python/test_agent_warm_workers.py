"""`ductile agent --warm-workers`: a worker starts in a spare interpreter
that imported its modules ahead of the round (the first round's before the
agent registers), and sees what a cold-started one sees.

The same job runs cold and warm with the real `ductile agent --standalone`:
local rank 1 fails in each attempt (an exception, then a SystemExit code),
and every attempt starts from spares. Each worker writes what it sees
(argv, environment, working directory, __name__, sys.path, __file__, its
globals) to its log file; the files, the teed console lines, the statuses
the agent reports and its exit code must be the same both ways, except that
the spares had imported the test's module. Deadlines are for an agent that
hangs, far above what a loaded machine takes.
"""

import json
import os
import re
import subprocess
import sys

import pytest

CLI = os.environ["DUCTILE_CLI"]
DEADLINE_S = 120

WORKER = """
import json
import os
import sys
import time

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
local = int(os.environ["LOCAL_RANK"])
seen = {
    "argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "path": sys.path,
    "file": __file__ if "__file__" in globals() else None,
    "globals": sorted(globals()), "warm_probe": "warm_probe" in sys.modules,
    "env": {k: os.environ.get(k) for k in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT",
        "DUCTILE_ROUND", "STATIC_SETTING", "OMP_NUM_THREADS")},
}
print(json.dumps(seen), flush=True)
print(f"attempt {attempt} on stderr", file=sys.stderr, flush=True)
# Local rank 1 fails once rank 0 is done: a failure stops the workers.
done = os.path.join(os.environ["DONE_DIR"], str(attempt))
if local == 0:
    open(done, "w").close()
if local == 1:
    deadline = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.01)
    if attempt < 2:
        raise ValueError(f"planned failure in attempt {attempt}")
    sys.exit(3)
"""


def agent_env(tmp_path, modules, marker):
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp_path / "tmp")
    os.makedirs(env["TMPDIR"], exist_ok=True)
    env["PYTHONPATH"] = f"{modules}:{env.get('PYTHONPATH', '')}"
    env["STATIC_SETTING"] = "kept"
    env["WARM_TEST_MARKER"] = marker
    env["DONE_DIR"] = str(tmp_path / f"done_{marker}")
    os.makedirs(env["DONE_DIR"], exist_ok=True)
    return env


def run_job(tmp_path, name, warm, form):
    """Runs the job; returns (agent result, {(attempt, local rank): (stdout, stderr)})."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "worker_main.py").write_text(WORKER)
    modules = tmp_path / "modules"
    modules.mkdir(exist_ok=True)
    (modules / "warm_probe.py").write_text("PROBED = True\n")
    # -m runs a module found on sys.path[0], the working directory.
    program = ["worker_main.py", "a", "--b"] if form == "script" else ["-m", "worker_main", "a"]
    logs = tmp_path / f"logs_{name}"
    args = [CLI, "agent", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
            "--monitor-interval", "0.05", "--log-dir", str(logs), "--redirects", "1",
            "--tee", "2", "--node-id", "node"]
    if warm:
        args += ["--warm-imports", "warm_probe"]
    r = subprocess.run(args + program, check=False, cwd=work,
                       env=agent_env(tmp_path, modules, name), capture_output=True, text=True,
                       timeout=DEADLINE_S)
    files = {}
    for attempt in logs.glob("*/attempt_*"):
        for rank in attempt.iterdir():
            files[(attempt.name, rank.name)] = ((rank / "stdout.log").read_text(),
                                                (rank / "stderr.log").read_text())
    return r, files


def marked_processes(marker):
    """Processes whose environment holds WARM_TEST_MARKER=`marker`."""
    needle = f"WARM_TEST_MARKER={marker}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle + b"\0" in f.read() + b"\0":
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("form", ["script", "module"])
def test_a_warm_worker_sees_what_a_cold_one_sees(tmp_path, form):
    cold, cold_files = run_job(tmp_path, "cold", False, form)
    warm, warm_files = run_job(tmp_path, "warm", True, form)
    assert "spare" not in cold.stderr, cold.stderr
    assert "the spare workers are ready (" in warm.stderr, warm.stderr
    for attempt in (1, 2, 3):
        assert (f"round {attempt}: local rank 0 started from its spare; local rank 1 started "
                f"from its spare") in warm.stderr, warm.stderr
    # The job fails as it did cold: local rank 1's SystemExit(3) in the last
    # attempt, after exceptions (status 1) in the two before.
    assert warm.returncode == cold.returncode != 0, warm.stderr
    statuses = re.compile(r"worker rank 1 exited with status (\d+)")
    assert statuses.findall(cold.stderr) == ["1", "1", "3"], cold.stderr
    assert statuses.findall(warm.stderr) == statuses.findall(cold.stderr)
    # The teed stderr lines on the console, the tracebacks included.
    for prefix in ("[default0]:", "[default1]:"):
        teed = [line for line in cold.stderr.splitlines() if line.startswith(prefix)]
        assert teed == [line for line in warm.stderr.splitlines() if line.startswith(prefix)]
    assert "[default1]:ValueError: planned failure in attempt 1" in teed, teed
    assert sorted(warm_files) == sorted(cold_files) == [
        (f"attempt_{a}", str(r)) for a in range(3) for r in range(2)]
    for key, (cold_out, cold_err) in cold_files.items():
        warm_out, warm_err = warm_files[key]
        assert warm_err == cold_err, key
        seen_cold, seen_warm = json.loads(cold_out), json.loads(warm_out)
        # Only the spares had imported the probe: every attempt's.
        assert seen_cold.pop("warm_probe") is False
        assert seen_warm.pop("warm_probe") is True, key
        assert seen_warm == seen_cold, key
        assert seen_cold["name"] == "__main__"
        assert seen_cold["env"]["STATIC_SETTING"] == "kept"
        assert seen_cold["env"]["TORCHELASTIC_RESTART_COUNT"] == key[0].split("_")[1]
    assert seen_cold["argv"][1:] == (["a", "--b"] if form == "script" else ["a"])
    # The agent ended its spares with itself.
    assert marked_processes("warm") == []


def test_a_spare_that_died_leaves_its_worker_to_a_cold_start(tmp_path):
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "warm_broken.py").write_text("raise ImportError('not importable here')\n")
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\nprint('attempt', os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
                      "sys.exit(0 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '1' else 5)\n")
    r = subprocess.run([CLI, "agent", "--standalone", "--max-restarts", "1",
                        "--monitor-interval", "0.05", "--warm-imports", "warm_broken",
                        str(script)], check=False, env=agent_env(tmp_path, modules, "broken"),
                       capture_output=True, text=True, timeout=DEADLINE_S)
    assert r.returncode == 0, r.stderr
    assert ("a spare worker was not ready (local rank 0: its spare exited with status 1 before "
            "it was ready): that worker starts cold") in r.stderr, r.stderr
    assert "round 2: local rank 0 started cold: its spare exited with status 1" in r.stderr
    assert r.stdout.splitlines() == ["attempt 0", "attempt 1"]
    assert marked_processes("broken") == []


@pytest.mark.parametrize("args, parts", [
    (["--warm-workers", "--", "/bin/sh", "-c", "true"],
     ["--warm-workers", "'/bin/sh -c true'", "does not start with a Python interpreter",
      "-m MODULE"]),
    (["--warm-workers", "--", "python3", "-c", "pass"], ["--warm-workers", "runs -c code"]),
    (["--warm-workers", "--", "python3", "-i", "x.py"], ["--warm-workers", "'-i'", "valid: -"]),
    (["--warm-workers", "--", "python3", "-u"], ["--warm-workers", "names no script"]),
    (["--warm-imports", "torch,,x", "x.py"],
     ["--warm-imports ''", "module names separated by commas", "torch,torch._dynamo"]),
])
def test_what_a_spare_cannot_run_is_refused(tmp_path, args, parts):
    r = subprocess.run([CLI, "agent", "--standalone", *args], check=False, capture_output=True,
                       text=True, env=agent_env(tmp_path, tmp_path, "refused"), timeout=DEADLINE_S)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    for part in parts:
        assert part in line, (part, line)


IMPORTING_SCRIPT = """
import sys
names = ("warm_probe", "warm_probe_pkg.sub", "warm_probe_pkg.lazy", "warm_nested", "shadowed",
         "warm_in_function")
ahead = {name: name in sys.modules for name in names}
import json
import os

import warm_probe
from warm_probe_pkg import Lazy, sub

import shadowed

try:
    import warm_not_installed
except ImportError:
    pass
if os.environ.get("NEVER_SET") is None:
    import warm_nested


def later():
    import warm_in_function


attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(json.dumps({"attempt": attempt, "ahead": ahead, "shadowed": shadowed.WHERE}), flush=True)
sys.exit(0 if attempt == "1" else 5)
"""


def test_a_spare_imports_ahead_what_the_script_imports_from_the_job_path(tmp_path):
    """--warm-workers: the spare imports torch and the modules the script
    imports at its top level (found by reading it; a lazily loaded attribute
    it imports is looked up), but none that the script's folder, first on
    the job's sys.path, gives the job: the worker gets the folder's module,
    as it does cold."""
    modules = tmp_path / "modules"
    (modules / "warm_probe_pkg").mkdir(parents=True)
    (modules / "warm_probe.py").write_text("")
    # Lazy: an attribute whose module loads when it is first looked up.
    (modules / "warm_probe_pkg" / "__init__.py").write_text(
        "def __getattr__(name):\n"
        "    if name == 'Lazy':\n"
        "        from .lazy import Lazy\n"
        "        return Lazy\n"
        "    raise AttributeError(name)\n")
    (modules / "warm_probe_pkg" / "lazy.py").write_text("Lazy = 1\n")
    (modules / "warm_probe_pkg" / "sub.py").write_text("")
    (modules / "warm_nested.py").write_text("")
    (modules / "warm_in_function.py").write_text("")
    (modules / "shadowed.py").write_text("WHERE = 'the path'\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "shadowed.py").write_text("WHERE = 'the script folder'\n")
    (work / "train.py").write_text(IMPORTING_SCRIPT)
    env = agent_env(tmp_path, modules, "imports")
    env["PYTHON_EXEC"] = sys.executable  # the job's Python: torch is installed there
    r = subprocess.run([CLI, "agent", "--standalone", "--max-restarts", "1",
                        "--monitor-interval", "0.05", "--warm-workers", "train.py"],
                       check=False, cwd=work, env=env, capture_output=True, text=True,
                       timeout=DEADLINE_S)
    assert r.returncode == 0, r.stderr
    for round_ in (1, 2):
        assert f"round {round_}: local rank 0 started from its spare" in r.stderr, r.stderr
    seen = [json.loads(line) for line in r.stdout.splitlines()]
    assert [s["attempt"] for s in seen] == ["0", "1"], r.stdout
    for warm in seen:  # the first round's spare too, started before the agent registered
        assert warm["ahead"] == {"warm_probe": True, "warm_probe_pkg.sub": True,
                                 "warm_probe_pkg.lazy": True, "warm_nested": True,
                                 "shadowed": False, "warm_in_function": False}, warm
        assert warm["shadowed"] == "the script folder"
    assert marked_processes("imports") == []
