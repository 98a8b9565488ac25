"""`ductile agent` is bounded: its options are capped, it ends what its
workers leave behind, and a stop signal ends it at every stage.

Each test runs the real `ductile agent` (--standalone, or a c10d rendezvous
whose host never comes) in a TMPDIR of its own, and checks the exit code,
the message, that no process of the job is left and that no directory is.
Time bounds are deadlines for an agent that hangs, far above what a loaded
machine takes.
"""

import os
import select
import signal
import subprocess
import time

import pytest

CLI = os.environ["DUCTILE_CLI"]
# A deadline for a launcher that hangs, not a measure of speed.
DEADLINE_S = 60


def agent_env(tmp_path, **extra):
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp)
    env.update(extra)
    return env


def run_agent(args, env):
    started = time.monotonic()
    r = subprocess.run([CLI, "agent", *args], env=env, capture_output=True, text=True,
                       timeout=DEADLINE_S)
    return r, time.monotonic() - started


def left_in(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def alive(pid):
    """True while `pid` exists (a zombie included)."""
    return os.path.exists(f"/proc/{pid}")


def marked_processes(marker):
    """Processes whose environment holds `marker` (NAME=value)."""
    needle = marker.encode() + b"\0"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                text = f.read()
        except OSError:
            continue
        if needle in text or text.endswith(marker.encode()):
            found.append(int(name))
    return found


def refused(r, *parts):
    """Exit 2 with one line naming each of `parts`."""
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def test_nproc_per_node_is_capped_at_what_the_machine_runs(tmp_path):
    env = agent_env(tmp_path)
    cap = os.cpu_count() * 64
    for value in ("1000000", "4294967297", str(cap + 1)):
        r, took = run_agent(["--standalone", "--nproc-per-node", value, "--no-python", "--",
                             "true"], env)
        refused(r, "--nproc-per-node", f"'{value}'", f"1 to {cap}", "online cores x 64")
        assert took < DEADLINE_S / 2
    assert left_in(tmp_path / "tmp") == []
    help_text = subprocess.run([CLI, "agent", "--help"], capture_output=True, text=True,
                               timeout=DEADLINE_S).stdout
    assert "online cores x 64" in help_text


def test_durations_are_capped_with_their_range_in_the_message(tmp_path):
    env = agent_env(tmp_path)
    r, _ = run_agent(["--standalone", "--lease-ttl", "10000000000", "--no-python", "--",
                      "true"], env)
    line = refused(r, "--lease-ttl 10000000000", "2 to 1000000 seconds")
    assert "internal error" not in line
    for option in ("--settle", "--stop-grace", "--failure-grace", "--store-timeout",
                   "--checkpoint-timeout", "--min-time", "--poll-interval"):
        r, _ = run_agent(["--standalone", option, "10000000", "--no-python", "--", "true"], env)
        refused(r, option, "10000000", "1000000")
    r, _ = run_agent(["--standalone", "--rdzv-conf", "join_timeout=2000000", "--no-python",
                      "--", "true"], env)
    refused(r, "--rdzv-conf join_timeout", "2000000", "0 to 1000000")
    r, _ = run_agent(["--standalone", "--rdzv-conf", "keep_alive_max_attempt=100000000000",
                      "--no-python", "--", "true"], env)
    refused(r, "keep_alive_max_attempt", "at most 1000000")


def test_counts_state_their_whole_range(tmp_path):
    env = agent_env(tmp_path)
    r, _ = run_agent(["--standalone", "--max-restarts", "-1", "--no-python", "--", "true"], env)
    refused(r, "--max-restarts -1", "0 to 2147483648")
    r, _ = run_agent(["--standalone", "--nnodes", "1:4294967297", "--no-python", "--", "true"],
                     env)
    refused(r, "--nnodes '1:4294967297'", "<= 2147483648")


def test_control_characters_in_names_are_refused_and_escaped(tmp_path):
    env = agent_env(tmp_path)
    for option in ("--role", "--node-id"):
        r, _ = run_agent(["--standalone", option, "a\nb\x1b[31m", "--no-python", "--", "true"],
                         env)
        line = refused(r, "a\\x0ab\\x1b[31m")
        assert "\x1b" not in line


def test_a_missing_worker_command_fails_at_once(tmp_path):
    env = agent_env(tmp_path)
    r, took = run_agent(["--standalone", "--no-python", "--", str(tmp_path / "no-such-worker")],
                        env)
    refused(r, "no-such-worker", "is not an executable file")
    # Refused before any rendezvous: no wait for one.
    assert took < 5, took
    assert left_in(tmp_path / "tmp") == []


def test_an_unusable_tmpdir_is_a_user_error(tmp_path):
    env = agent_env(tmp_path)
    env["TMPDIR"] = str(tmp_path / "missing")
    r, _ = run_agent(["--standalone", "--no-python", "--", "true"], env)
    refused(r, f"TMPDIR '{tmp_path / 'missing'}'", "set TMPDIR to a writable directory")


def test_a_v02_policy_plans_for_the_agents_world_size(tmp_path):
    """v0.2 plans for one world size: the agent's, --nnodes x --nproc-per-node;
    the agent has no --world-size option, and no message asks for one."""
    env = agent_env(tmp_path)
    config = os.path.join(os.environ["DUCTILE_SOURCE_DIR"], "plugins", "elasticity", "v0.2",
                          "example.toml")
    r, _ = run_agent(["--standalone", "--config", config, "--nproc-per-node", "8", "--no-python",
                      "--", "/bin/sh", "-c", "echo $WORLD_SIZE $DUCTILE_GLOBAL_BATCH"], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["8 2880"] * 8, r.stdout
    r, _ = run_agent(["--standalone", "--config", config, "--nproc-per-node", "3", "--no-python",
                      "--", "true"], env)
    line = refused(r, "model_parallel_size", "world size 3 is --nnodes 1 x --nproc-per-node 3")
    assert "--world-size" not in line


@pytest.mark.parametrize("outcome", [0, 3])
def test_what_a_worker_leaves_behind_ends_with_the_job(tmp_path, outcome):
    """A worker starts a job under setsid (a process group of its own) that ignores SIGTERM,
    and exits: the job, done or failed, ends it (SIGKILL after the grace)."""
    marker = f"DUCTILE_CLEANUP_TEST={os.getpid()}-{outcome}"
    name, value = marker.split("=")
    env = agent_env(tmp_path, **{name: value})
    pid_file = tmp_path / "orphan.pid"
    worker = (f"setsid sh -c 'trap \"\" TERM; echo $$ > {pid_file}; exec sleep 302' & "
              f"while [ ! -s {pid_file} ]; do sleep 0.05; done; exit {outcome}")
    r, _ = run_agent(["--standalone", "--stop-grace", "0.5", "--no-python", "--", "/bin/sh",
                      "-c", worker], env)
    assert r.returncode == outcome, r.stderr
    orphan = int(pid_file.read_text())
    # Reaped before the agent exited: not even a zombie is left.
    assert not alive(orphan), open(f"/proc/{orphan}/stat").read()
    assert marked_processes(marker) == []
    assert left_in(tmp_path / "tmp") == []


def tasks_of_user(uid):
    """Threads of `uid`'s processes: what RLIMIT_NPROC counts."""
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid == uid:
                count += len(os.listdir(f"/proc/{name}/task"))
        except OSError:
            continue
    return count


def usable_by_others(path):
    """`path` and every folder above it can be reached by any user."""
    path = os.path.abspath(path)
    while True:
        if not os.stat(path).st_mode & 0o001:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def test_out_of_processes_is_a_clear_error_not_a_bug():
    """fork fails with EAGAIN at the process limit: exit 2 naming
    --nproc-per-node and the limit, the workers started are ended."""
    import resource
    import shutil
    import tempfile
    # root is not held to RLIMIT_NPROC: the agent runs as nobody then.
    as_nobody = os.geteuid() == 0
    if as_nobody and not usable_by_others(CLI):
        pytest.skip(f"{CLI} cannot be run by another user: no process limit holds root")
    uid = 65534 if as_nobody else os.geteuid()
    marker = f"DUCTILE_CLEANUP_TEST={os.getpid()}-nproc"
    name, value = marker.split("=")
    tmp = tempfile.mkdtemp(prefix="ductile-nproc-", dir="/tmp")
    try:
        os.chmod(tmp, 0o777)
        env = dict(os.environ)
        env["TMPDIR"] = tmp
        env[name] = value
        # The agent and its threads fit; 64 workers (a guard and a worker
        # each) do not.
        limit = tasks_of_user(uid) + 24

        def limited():
            resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
            if as_nobody:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)

        r = subprocess.run([CLI, "agent", "--standalone", "--nproc-per-node", "64",
                            "--no-python", "--", "sleep", "300"], env=env, capture_output=True,
                           text=True, timeout=DEADLINE_S, preexec_fn=limited, cwd=tmp)
        assert r.returncode == 2, r.stderr
        assert "internal error" not in r.stderr
        assert "cannot start worker local rank" in r.stderr, r.stderr
        assert "Resource temporarily unavailable" in r.stderr
        assert f"ulimit -u: {limit}" in r.stderr and "--nproc-per-node 64" in r.stderr
        assert wait_for(lambda: marked_processes(marker) == [], 10)
        assert os.listdir(tmp) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def wait_for(predicate, limit=DEADLINE_S):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def stop_with_sigterm(proc):
    """SIGTERM; returns (exit code, seconds it took, stderr)."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, time.monotonic() - sent, err


def test_sigterm_while_waiting_for_the_rendezvous_host(tmp_path):
    """A c10d agent that does not host waits for the host (up to 600 s):
    SIGTERM ends the wait and the agent, and its directory goes."""
    env = agent_env(tmp_path)
    with socket_port() as port:
        proc = subprocess.Popen(
            [CLI, "agent", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-conf", "is_host=false", "--no-python", "--", "true"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # Its line once it waits: "waiting for the c10d rendezvous ...". An
        # agent may say first that it removed what dead agents left in
        # /dev/shm (another test's, killed).
        said = b""
        deadline = time.monotonic() + DEADLINE_S
        while b"waiting for the c10d rendezvous" not in said:
            ready, _, _ = select.select([proc.stderr], [], [],
                                        max(deadline - time.monotonic(), 0))
            assert ready, f"the agent did not say it waits: {said!r}"
            piece = os.read(proc.stderr.fileno(), 4096)
            assert piece, f"the agent ended its output: {said!r}"
            said += piece
        code, took, err = stop_with_sigterm(proc)
    assert code == 128 + signal.SIGTERM, err
    assert "signal 15" in err, err
    assert took < DEADLINE_S / 2
    assert left_in(tmp_path / "tmp") == []


def test_sigterm_while_the_workers_start_and_run(tmp_path):
    """As many workers as the machine may run: SIGTERM as they start ends
    them all, and the agent exits 143 with nothing left."""
    marker = f"DUCTILE_CLEANUP_TEST={os.getpid()}-many"
    name, value = marker.split("=")
    env = agent_env(tmp_path, **{name: value})
    workers = min(os.cpu_count() * 64, 64)
    proc = subprocess.Popen(
        [CLI, "agent", "--standalone", "--nproc-per-node", str(workers), "--stop-grace", "1",
         "--no-python", "--", "sleep", "300"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: len(marked_processes(marker)) >= 2)
    code, took, err = stop_with_sigterm(proc)
    assert code == 128 + signal.SIGTERM, err
    assert took < DEADLINE_S / 2
    assert "internal error" not in err
    assert wait_for(lambda: marked_processes(marker) == [], 10)
    assert left_in(tmp_path / "tmp") == []


class socket_port:
    """A loopback port nothing listens on (bound, not listening, while in use)."""

    def __enter__(self):
        import socket
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc):
        self.sock.close()
