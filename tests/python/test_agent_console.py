"""`ductile agent` keeps torchrun's console contract.

Without --tee or --redirects a worker writes the launcher's own stdout and
stderr: on a terminal it sees a terminal, and its '\\r' progress updates
reach the terminal as it writes them. The same worker runs under torchrun
and under the agent, on a pseudo-terminal, and each update is waited for by
the test before the worker writes the next (through a FIFO: no sleeps).

With --tee the agent reads the worker's output itself: a stream of
'\\r'-separated updates without a single '\\n' costs it bounded memory.
"""

import os
import select
import subprocess
import sys
import textwrap
import time

import pytest

CLI = os.environ["DUCTILE_CLI"]
UPDATES = 5
# A deadline for a launcher that hangs, not a measure of speed.
DEADLINE_S = 120

WORKER = textwrap.dedent(
    """
    import os
    import sys

    print(f"isatty stdout={sys.stdout.isatty()} stderr={sys.stderr.isatty()}", flush=True)
    # The test writes a byte once it has seen each update.
    with open(os.environ["CONSOLE_ACKS"], "rb", buffering=0) as acks:
        for i in range(1, UPDATES + 1):
            sys.stdout.write(f"\\rprogress {i}/{UPDATES}")
            sys.stdout.flush()
            if acks.read(1) != b"+":
                sys.exit("the test went away")
    sys.stdout.write("\\n")
    print("worker done", file=sys.stderr, flush=True)
    """
).replace("UPDATES", str(UPDATES))


def on_terminal(command, env, acks):
    """Runs `command` with a pseudo-terminal as its stdout and stderr; returns
    what the terminal showed, having acknowledged each update as it appeared."""
    master, slave = os.openpty()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            env=env, start_new_session=True)
    os.close(slave)
    shown = b""
    seen = 0
    writer = None
    deadline = time.monotonic() + DEADLINE_S
    try:
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"{command[:3]}: no update {seen + 1} in time; shown:\n{shown!r}"
            ready, _, _ = select.select([master], [], [], left)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal is gone
                break
            if not data:
                break
            shown += data
            if writer is None and b"isatty " in shown:
                writer = open(acks, "wb", buffering=0)
            # Update i shows before the worker writes update i + 1: it waits
            # for this byte.
            while writer is not None and seen < UPDATES and (
                    f"progress {seen + 1}/{UPDATES}".encode() in shown):
                seen += 1
                writer.write(b"+")
        assert proc.wait(timeout=DEADLINE_S) == 0, shown.decode(errors="replace")
    finally:
        if writer is not None:
            writer.close()
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert seen == UPDATES, shown
    return shown.decode(errors="replace")


@pytest.fixture
def worker(tmp_path):
    script = tmp_path / "progress_worker.py"
    script.write_text(WORKER)
    return script


def launcher_env(tmp_path, name):
    acks = tmp_path / f"{name}.acks"
    os.mkfifo(acks)
    env = dict(os.environ)
    env["CONSOLE_ACKS"] = str(acks)
    env["PYTHON_EXEC"] = sys.executable
    return env, str(acks)


def test_workers_get_the_terminal_and_live_updates_under_both_launchers(tmp_path, worker):
    launchers = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "1", str(worker)],
        "ductile": [CLI, "agent", "--standalone", "--nproc-per-node", "1", str(worker)],
    }
    for name, command in launchers.items():
        env, acks = launcher_env(tmp_path, name)
        shown = on_terminal(command, env, acks)
        assert "isatty stdout=True stderr=True" in shown, (name, shown)
        # Nothing before the worker's own text: no prefix.
        assert "\nisatty " in "\n" + shown.replace("\r\n", "\n"), (name, shown)
        assert "\rprogress 2/5\rprogress 3/5" in shown, (name, shown)
        assert "worker done" in shown, (name, shown)
        assert "[rank" not in shown and "[default0]" not in shown, (name, shown)


def test_the_agent_names_the_workers_python_and_why(tmp_path):
    script = tmp_path / "which.py"
    script.write_text("import sys\nprint('interpreter', sys.executable)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHON_EXEC", "VIRTUAL_ENV", "DUCTILE_CONSOLE_PYTHON")}
    env["VIRTUAL_ENV"] = sys.prefix
    r = subprocess.run([CLI, "agent", "--standalone", "--nproc-per-node", "1", str(script)],
                       env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert r.returncode == 0, r.stderr
    venv_python = os.path.join(sys.prefix, "bin", "python")
    first = r.stderr.splitlines()[0]
    assert first == (f"ductile agent: the workers run {venv_python} "
                     "(the active virtual environment, $VIRTUAL_ENV)"), r.stderr
    assert f"interpreter {venv_python}\n" in r.stdout
    # $PYTHON_EXEC comes first.
    env["PYTHON_EXEC"] = "/usr/bin/python3"
    r = subprocess.run([CLI, "agent", "--standalone", "--nproc-per-node", "1", str(script)],
                       env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == (
        "ductile agent: the workers run /usr/bin/python3 ($PYTHON_EXEC)"), r.stderr
    help_text = subprocess.run([CLI, "agent", "--help"], capture_output=True, text=True).stdout
    assert "$VIRTUAL_ENV/bin/python" in help_text and "$PYTHON_EXEC" in help_text


# 51 MB of updates without a '\n': an agent that held the unfinished line
# whole would grow by more than that; this one holds one read and one line
# piece (workers.hpp: kMaxTeedLineBytes). The growth is measured against the
# same agent teeing one update, so that a build's own footprint (a
# sanitizer's) does not count.
UPDATE_TEXT = "progress 1234567\r"
TEED_STREAM_BYTES = len(UPDATE_TEXT) * 3_000_000
MAX_GROWTH_KIB = 16 * 1024


def run_teed(directory, stream_bytes):
    """Runs the agent teeing `stream_bytes` of updates and a last line;
    returns its peak RSS (KiB), its stdout and the worker's stdout.log."""
    logs = directory / "logs"
    console = directory / "console.out"
    # Small C programs write the stream: the peak RSS of the agent's
    # process tree is the agent's.
    stream = (f"yes 'progress 1234567' | tr '\\n' '\\r' | head -c {stream_bytes}; "
              "printf 'last update\\n'")
    pid = os.fork()
    if pid == 0:  # the agent, a child of this test's process alone
        try:
            out = os.open(console, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.execv(CLI, [CLI, "agent", "--standalone", "--nproc-per-node", "1", "--tee", "3",
                           "--log-dir", str(logs), "--no-python", "/bin/sh", "-c", stream])
        finally:
            os._exit(127)
    _, status, usage = os.wait4(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    stdout_logs = [os.path.join(d, f) for d, _, files in os.walk(logs) for f in files
                   if f == "stdout.log"]
    assert len(stdout_logs) == 1
    # ru_maxrss (KiB): the largest of the agent and the processes it waited
    # for (its workers' guards, the shell, yes, tr, head).
    return usage.ru_maxrss, console.read_bytes(), stdout_logs[0]


def test_teed_carriage_returns_cost_bounded_memory(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    baseline, _, _ = run_teed(tmp_path / "one", len(UPDATE_TEXT))
    peak, console, stdout_log = run_teed(tmp_path / "many", TEED_STREAM_BYTES)
    assert peak - baseline < MAX_GROWTH_KIB, (
        f"peak RSS {peak} KiB teeing {TEED_STREAM_BYTES} bytes, {baseline} KiB teeing one update")
    assert os.path.getsize(stdout_log) == TEED_STREAM_BYTES + len("last update\n")
    # Each '\r' ends a line, as torchrun's tail of the log file reads it.
    assert console.count(b"[default0]:progress 1234567\n") == TEED_STREAM_BYTES // len(UPDATE_TEXT)
    assert console.endswith(b"\n[default0]:progress 1234567\n[default0]:last update\n")
