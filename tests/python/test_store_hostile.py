"""The agent's stores against a hostile client speaking torch's TCPStore
protocol, compared with torch's own TCPStore server, and a live job that
keeps training while its workers' store is attacked.

Each attack is raw bytes over real sockets: a WAIT naming one key 65536
times on 3 connections then its SET (the server's thread must not freeze
on it), bytes streamed behind a WAIT that never ends (memory must stay
bounded), the store's process out of descriptors with 400 connections
(it must not spin, and must go on serving), slow clients holding partial
messages and large SETs (bounded by the store's caps). The figures are
printed (pytest -s); the asserts are bounds with wide margins.
"""

import concurrent.futures
import os
import resource
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

CLI = os.environ["DUCTILE_CLI"]
# A deadline for a process that hangs, not a measure of speed.
DEADLINE_S = 120

VALIDATE, SET, GET, WAIT, PING = 0, 1, 3, 6, 13
MAGIC = 0x3C85F7CE
MIB = 1 << 20


def _bytes(b):
    return struct.pack("=Q", len(b)) + b


def hello():
    return struct.pack("=BI", VALIDATE, MAGIC)


def set_request(key, value):
    return bytes([SET]) + _bytes(key) + _bytes(value)


def get_request(key):
    return bytes([GET]) + _bytes(key)


def wait_request(keys):
    return bytes([WAIT]) + struct.pack("=Q", len(keys)) + b"".join(_bytes(k) for k in keys)


def ping_request(nonce=77):
    return struct.pack("=BI", PING, nonce)


def connect(port, timeout=30.0):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def receive(s, size):
    out = b""
    while len(out) < size:
        chunk = s.recv(size - len(out))
        if not chunk:
            raise ConnectionError("closed by the server")
        out += chunk
    return out


def pong(s):
    s.sendall(ping_request())
    return struct.unpack("=I", receive(s, 4))[0] == 77


def get_value(s, key):
    s.sendall(get_request(key))
    (size,) = struct.unpack("=Q", receive(s, 8))
    return receive(s, size)


def client(port):
    s = connect(port)
    s.sendall(hello())
    return s


def closed_by_server(s, timeout=20.0):
    s.settimeout(timeout)
    try:
        while s.recv(1 << 20):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def listeners(port):
    """The local addresses listening on `port`, from /proc/net/tcp{,6}."""
    found = []
    for name, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) != port or fields[3] != "0A":  # LISTEN
                continue
            raw = bytes.fromhex(address)
            # The kernel prints each 32-bit word in the host's byte order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(socket.inet_ntop(family, raw))
    return found


def listener_pid(port):
    """The process holding the socket that listens on `port`."""
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":
                    inodes.add(fields[9])
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process listens on port {port}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, proc, what):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{what} never listened on port {port}")


def worker_env():
    env = dict(os.environ)
    env["PYTHON_EXEC"] = sys.executable  # the workers' interpreter, with torch
    return env


def limit_descriptors(count):
    def apply():
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))
    return apply


# --- the attacks: each returns its figures ------------------------------------------


def attack_wait_copies(port, copies):
    """3 connections WAIT on one key named `copies` times; then its SET. The
    seconds from the first WAIT sent until all 3 were answered and a PING
    behind the SET was: the time the server's thread was taken."""
    request = wait_request([b"hostile-key"] * copies)
    waiters = [client(port) for _ in range(3)]
    other = client(port)
    assert pong(other)
    start = time.monotonic()
    for w in waiters:
        w.sendall(request)
    other.sendall(set_request(b"hostile-key", b"v"))
    for w in waiters:
        w.settimeout(DEADLINE_S)
        assert receive(w, 1) == b"\0"
    assert pong(other)
    took = time.monotonic() - start
    for s in waiters + [other]:
        s.close()
    return took


def attack_stream_behind_wait(port, pid, total=400 * MIB):
    """Streams `total` bytes behind a WAIT that never ends; the growth of the
    server's RSS at its highest, and the bytes it took before closing."""
    s = client(port)
    s.sendall(wait_request([b"never-set"]))
    # A server that stops reading holds the client back: its send blocks.
    s.settimeout(3)
    before = peak = rss(pid)
    chunk = b"x" * MIB
    sent = 0
    try:
        while sent < total:
            s.sendall(chunk)
            sent += len(chunk)
            if sent % (8 * MIB) == 0:
                peak = max(peak, rss(pid))
    except (ConnectionError, socket.timeout):
        pass
    peak = max(peak, rss(pid))
    s.close()
    return peak - before, sent


def attack_descriptors(port, pid, count=400, span=2.0):
    """An existing client, then `count` connections (more than the server's
    descriptors): the server's CPU seconds over `span` seconds, and the
    seconds the existing client waited for an answer."""
    honest = client(port)
    honest.sendall(set_request(b"honest", b"yes"))
    assert pong(honest)
    flood = []
    for _ in range(count):
        try:
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    time.sleep(0.5)
    cpu = cpu_seconds(pid)
    time.sleep(span)
    cpu = cpu_seconds(pid) - cpu
    start = time.monotonic()
    honest.settimeout(30)
    try:
        served = get_value(honest, b"honest") == b"yes"
    except (ConnectionError, socket.timeout):
        served = False
    answered = time.monotonic() - start
    for s in flood:
        s.close()
    honest.close()
    return cpu, served, answered, len(flood)


def attack_slow(port, pid, clients=8):
    """`clients` clients each 40 MiB into a 64 MiB SET, then silent: the
    growth of the server's RSS while they hold on, and how many of them the
    server closed."""
    before = rss(pid)
    prefix = bytes([SET]) + _bytes(b"slow") + struct.pack("=Q", 64 * MIB)
    slow = []
    for _ in range(clients):
        s = client(port)
        s.settimeout(10)
        try:
            s.sendall(prefix + b"s" * (40 * MIB))
        except OSError:
            pass
        slow.append(s)
    probe = client(port)
    assert pong(probe)  # the server has read all that was sent before
    grown = rss(pid) - before
    closed = 0
    for s in slow:
        s.setblocking(False)
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except ConnectionError:
            closed += 1
        s.close()
    probe.close()
    return grown, closed


def attack_large(port):
    """SETs of 60 MiB values under new keys from new connections, until the
    store refuses one (8 at most): how many it kept."""
    kept = 0
    value = b"L" * (60 * MIB)
    for i in range(8):
        s = client(port)
        try:
            s.sendall(set_request(b"large-%d" % i, value))
            if not pong(s):
                break
        except (ConnectionError, socket.timeout):
            break
        finally:
            s.close()
        kept += 1
    return kept


# --- the servers ------------------------------------------------------------------


class Server:
    def __init__(self, proc, port, pid):
        self.proc, self.port, self.pid = proc, port, pid

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=DEADLINE_S)


def torch_server(use_libuv, descriptors=None):
    code = textwrap.dedent(f"""
        import time
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv={use_libuv},
                              wait_for_workers=False)
        print(store.port, flush=True)
        time.sleep(3600)
        """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            preexec_fn=limit_descriptors(descriptors) if descriptors else None)
    port = int(proc.stdout.readline())
    return Server(proc, port, proc.pid)


SLEEPER = textwrap.dedent("""
    import os
    import sys
    import time

    open(sys.argv[1] + ".started", "w").close()
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.2)
    """)


def ductile_server(tmp_path, descriptors=None):
    """`ductile agent` hosting a one-node c10d rendezvous at 127.0.0.1: its
    store answers torch's protocol on the rendezvous port, as the workers'
    store does on MASTER_PORT (one server)."""
    worker = tmp_path / "sleeper.py"
    worker.write_text(SLEEPER)
    port = free_port()
    proc = subprocess.Popen(
        [CLI, "agent", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hostile", "--local-addr",
         "127.0.0.1", str(worker), str(tmp_path / "stop")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=worker_env(),
        preexec_fn=limit_descriptors(descriptors) if descriptors else None)
    wait_for_port(port, proc, "ductile agent")
    # The round formed and its worker runs: the agent opens no more
    # descriptors of its own (it needs some to form a round).
    deadline = time.monotonic() + DEADLINE_S
    while not (tmp_path / "stop.started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the worker never started"
        time.sleep(0.1)
    return Server(proc, port, listener_pid(port))


KINDS = ["ductile", "torch-libuv", "torch"]


@pytest.fixture
def servers(tmp_path):
    """Starts one server of each kind, side by side (each takes seconds to
    start), with `descriptors` each when given; returns them by kind."""
    started = []

    def start(descriptors=None):
        def one(kind):
            if kind == "ductile":
                return ductile_server(tmp_path, descriptors)
            return torch_server(kind == "torch-libuv", descriptors)

        with concurrent.futures.ThreadPoolExecutor(len(KINDS)) as pool:
            futures = {kind: pool.submit(one, kind) for kind in KINDS}
        for future in futures.values():
            if future.exception() is None:
                started.append(future.result())
        return {kind: future.result() for kind, future in futures.items()}

    yield start
    (tmp_path / "stop").touch()
    for server in started:
        server.stop()


def side_by_side(servers, attack):
    """`attack` on each server at once (each mostly waits): its figures by kind."""
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        futures = {kind: pool.submit(attack, server) for kind, server in servers.items()}
    return {kind: future.result() for kind, future in futures.items()}


def test_the_store_under_attack_degrades_no_more_than_torchs_own(servers):
    # Each server with 256 descriptors (row 3's flood needs it; the others
    # use a few).
    started = servers(descriptors=256)

    # A WAIT naming one key 65536 times on 3 connections, then its SET.
    took = {kind: attack_wait_copies(server.port, 65536) for kind, server in started.items()}
    print(f"\n3 WAITs of one key x65536, then its SET: store busy {took} s")
    assert took["ductile"] < 5.0
    # torch's servers take about a second here; a spare 0.25 s for a busy machine.
    assert took["ductile"] <= min(took["torch-libuv"], took["torch"]) + 0.25

    # 400 MiB streamed behind a WAIT that never ends.
    grown = side_by_side(started, lambda server: attack_stream_behind_wait(server.port, server.pid))
    print("400 MiB streamed behind a WAIT: (RSS growth MiB, MiB taken) " +
          str({k: (g >> 20, s >> 20) for k, (g, s) in grown.items()}))
    growth, taken = grown["ductile"]
    assert taken < 200 * MIB  # held back, or cut at one message's bound (65 MiB)
    assert growth < 300 * MIB
    assert growth <= min(g for g, _ in grown.values()) + 64 * MIB

    # 400 connections on 256 descriptors.
    figures = side_by_side(started, lambda server: attack_descriptors(server.port, server.pid))
    print("400 connections, 256 descriptors: (CPU s in 2 s, existing client served, "
          f"answered in s, connections) {figures}")
    cpu, served, answered, _ = figures["ductile"]
    assert served
    assert answered < 10.0
    assert cpu < 0.5  # spinning on accept: the whole 2 s (0.7 s on a busy machine)
    assert cpu <= min(f[0] for f in figures.values()) + 0.25


# --- a live job under attack --------------------------------------------------------

STEPPER = textwrap.dedent("""
    import os
    import sys
    import time

    import torch
    import torch.distributed as dist

    out, stop = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        with open(os.path.join(out, "master"), "w") as f:
            f.write(os.environ["MASTER_ADDR"] + " " + os.environ["MASTER_PORT"])
    step = 0
    while True:
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t[0].item() == dist.get_world_size()
        if rank == 0:
            with open(os.path.join(out, "steps"), "a") as f:
                f.write(f"{step} {time.monotonic():.4f}\\n")
        done = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
        dist.all_reduce(done)
        if done.item() > 0:
            break
        step += 1
        time.sleep(0.1)
    dist.destroy_process_group()
    """)


def steps(out):
    try:
        with open(out / "steps") as f:
            return [tuple(map(float, line.split())) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def wait_steps(out, count, agents):
    deadline = time.monotonic() + DEADLINE_S
    while len(steps(out)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} steps in time"
        for a in agents:
            assert a.poll() is None, f"an agent exited with {a.returncode}"
        time.sleep(0.1)
    return steps(out)


def mean_interval(rows):
    return (rows[-1][1] - rows[0][1]) / (len(rows) - 1)


def agents_protocol_attacks(rendezvous_port):
    """Attacks on the agents' protocol of the rendezvous store, run against
    the same live job; empty here (their bounds are tested with that
    protocol's code)."""
    del rendezvous_port


def test_a_live_job_keeps_stepping_while_its_workers_store_is_attacked(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stop = tmp_path / "stop"
    worker = tmp_path / "stepper.py"
    worker.write_text(STEPPER)
    rdzv_port = free_port()
    command = [CLI, "agent", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", "hostile-job",
               "--local-addr", "127.0.0.1", "--max-restarts", "0", str(worker), str(out),
               str(stop)]
    logs = [open(tmp_path / f"agent{i}.log", "wb") for i in range(2)]
    # The agents and their workers with 256 descriptors: the flood below
    # exhausts the hosting agent's.
    agents = [subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=worker_env(),
                               preexec_fn=limit_descriptors(256)) for log in logs]
    try:
        wait_steps(out, 20, agents)
        host, master_port = (out / "master").read_text().split()
        master_port = int(master_port)
        assert host == "127.0.0.1"
        # Each store binds the address asked, not every interface.
        assert listeners(master_port) == ["127.0.0.1"], listeners(master_port)
        assert listeners(rdzv_port) == ["127.0.0.1"], listeners(rdzv_port)
        pid = listener_pid(master_port)
        baseline = mean_interval(steps(out)[-15:])
        first = len(steps(out))
        rss_before = rss(pid)

        froze = attack_wait_copies(master_port, 131072)
        grown, taken = attack_stream_behind_wait(master_port, pid)
        cpu, served, answered, flood = attack_descriptors(master_port, pid)
        slow_grown, slow_closed = attack_slow(master_port, pid)
        kept = attack_large(master_port)
        agents_protocol_attacks(rdzv_port)
        rss_after = rss(pid)

        rows = wait_steps(out, len(steps(out)) + 10, agents)
        during = mean_interval(rows[first - 1:])
        print(f"\nlive job: step {baseline:.3f} s before, {during:.3f} s during the attacks; "
              f"WAIT x131072 x3 then SET: {froze:.3f} s; behind a WAIT: RSS "
              f"+{grown >> 20} MiB, {taken >> 20} MiB taken; {flood} connections on 256 "
              f"descriptors: {cpu:.2f} s CPU in 2 s, served {served} in {answered:.3f} s; "
              f"8 slow clients 40 MiB into a SET: RSS +{slow_grown >> 20} MiB, {slow_closed} "
              f"closed; {kept} SETs of 60 MiB kept; "
              f"store's RSS {rss_before >> 20} -> {rss_after >> 20} MiB")
        assert froze < 5.0
        assert taken < 200 * MIB and grown < 300 * MIB
        assert served and cpu < 0.5
        assert slow_grown < 400 * MIB and slow_closed >= 1  # 256 MiB buffered at most
        assert 1 <= kept <= 4  # the store's 256 MiB
        assert rss_after - rss_before < 700 * MIB
        assert during < 2 * baseline
        for a in agents:
            assert a.poll() is None
        log = b"".join((tmp_path / f"agent{i}.log").read_bytes() for i in range(2))
        assert b"round 2" not in log and b"fence" not in log, log.decode(errors="replace")
        stop.touch()
        for a in agents:
            assert a.wait(timeout=DEADLINE_S) == 0
    finally:
        stop.touch()
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
        for log in logs:
            log.close()
