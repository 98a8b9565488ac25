"""Benchmarks of `ductile agent` (forming and re-forming at scale); they print tables,
nothing asserts on time.

scale: one etcd and N agents on loopback, each with one trivial worker (a
shell that records its round, world size and start time, then sleeps). For
each N, --scale-runs times:
  formed     from the last agent's start (and from the first's) until every
             worker of the first round of world size N ran;
  re-formed  from the SIGKILL of one agent and its worker (the youngest that
             does not lead) until every worker of the survivors' round (N-1)
             ran;
  etcd       at steady state, over 10 s: requests per second (gRPC messages
             the server received, from its /metrics: the unary calls and
             the lease keep-alives), bytes sent per second, and
             the CPU the etcd process used; and the same counts over the
             forming (from the first start) and over the re-forming.
  agents     the CPU all agents used at steady state.
  model      etcd's load at rest per agent (requests, bytes sent and CPU a
             second: N x that, fitted through the origin) and the work a
             forming and a re-forming adds to it (their counts less the
             load at rest over the same agent-seconds: agents start evenly
             over the start time), fitted as a + b N + c N^2 over every
             run; the fit from all sizes but the largest checked against
             the largest; the prediction at 1,024 and 4,096 agents; and the
             time to form with etcd on one core, every agent started at
             once: the forming's work over the core the load at rest
             leaves.

replay: etcd's side of N agents, made by one process (agent_etcd_replay,
built in a Release tree): each replayed agent makes an agent's requests
through the agent's own etcd client (its lease, its registration with its
reads and its mirror's first read, its age index entry, the watch of its
part of the job's keys, its renewals on one stream every TTL/3; the 16
oldest read and watch every key), --in-flight agents joining at a time,
then the oldest writes the round naming every member and each watch
receives it. It goes past what a machine holds as agents (each a process
with a worker). For each N, --scale-runs times: joined (from the first
grant to the last age entry), delivered (from the round's write until
every watch had it), etcd's CPU over both, and etcd's CPU at rest over
10 s; then the forming's CPU fitted as a + b N + c N^2 and the load at
rest per agent through the origin, and the time to form on one etcd core
(the forming's CPU over the core the load at rest leaves), measured and
predicted at 4,096. --join-rate R: the agents start R a second (as
`scale` starts them, one process after the other), to check the replay
against the agents themselves at a size both run.

race: torchrun (torch's c10d rendezvous) and `ductile agent`, the same
nodes as processes on loopback, the same worker (2 gloo ranks a node that
all-reduce every 0.1 s). Formed: from the first launcher's start until
every worker of the full group ran (its first line, before torch is
imported) and until their first all-reduce. Then one node is killed
(SIGKILL to its launcher and every process below it: the node is gone);
re-formed: the time until the survivors' workers run again and until their
first all-reduce in the new group. Defaults on both sides but
--max-restarts 3; the launchers alternate, --runs times. Launchers
(--launchers, all four by default):
  torchrun            torchrun as it comes;
  torchrun-own-store  torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: its
                      workers get a store of their own each round instead of
                      sharing the rendezvous store under a prefix made of the
                      node's local restart count, which differs between nodes
                      after a node is lost (pytorch/pytorch#135712; with it
                      the survivors' workers never meet);
  ductile             `ductile agent` on etcd;
  ductile-c10d        `ductile agent` with torchrun's command line as it is
                      (c10d: node 0's agent hosts the rendezvous).

usage:
  bench_agent.py scale [--cli PATH] [--sizes 8,64,256] [--lease-ttl 5] [--scale-runs 3]
                       [--quiet-file PATH]
  bench_agent.py replay [--replay PATH] [--sizes 256,512,1024,2048] [--in-flight 32]
                       [--join-rate 0] [--lease-ttl 5] [--scale-runs 2]
  bench_agent.py race  [--cli PATH] [--python PATH] [--nodes 4] [--runs 3] [--quiet-file PATH]
                       [--launchers torchrun,torchrun-own-store,ductile,ductile-c10d]

--cli: the ductile CLI (default build/bin/ductile, a Release build);
--replay: agent_etcd_replay (default build/bin/agent_etcd_replay);
--python: the interpreter with torch for the race (default .venv/bin/python).
"""

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    def __init__(self, directory):
        self.client, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client}"
        self.log = open(os.path.join(directory, "etcd.log"), "w")
        self.process = subprocess.Popen(
            ["etcd", "--name", "bench", "--data-dir", os.path.join(directory, "etcd-data"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"bench=http://127.0.0.1:{peer}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1).read()
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError("etcd did not start") from e
                time.sleep(0.05)

    def metric(self, name):
        """A counter of etcd's /metrics, summed over its labels.
        grpc_server_msg_received_total: the requests (unary calls and stream
        messages)."""
        total = 0
        for line in urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode() \
                .splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self):
        self.process.terminate()
        self.process.wait(30)
        self.log.close()


def descendants(pid):
    """pid and every process below it (from /proc), parents first."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def signal_node(process, sig):
    """`sig` to a launcher and everything under it (its workers are in
    process groups of their own). Returns when it was sent."""
    pids = descendants(process.pid)
    sent = time.time()
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return sent


def kill_node(process):
    """SIGKILL a launcher and everything under it: the node is gone.
    Returns when it was killed."""
    killed = signal_node(process, signal.SIGKILL)
    process.wait()
    return killed


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(predicate, limit, what):
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def started(path):
    """(round, world size, node, s since the epoch) of each worker start."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 4:
                    out.append((int(parts[0]), int(parts[1]), parts[2], int(parts[3]) / 1e9))
    except FileNotFoundError:
        pass
    return out


def full_round(path, world, after=0):
    """(round, time its last worker started) of the first round after `after`
    whose `world` workers all started, else None."""
    rounds = {}
    for r, w, _, t in started(path):
        if r > after and w == world:
            rounds.setdefault(r, []).append(t)
    for r in sorted(rounds):
        if len(rounds[r]) >= world:
            return r, max(rounds[r])
    return None


def stop_all(processes, logs):
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in processes:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            kill_node(p)
    for log in logs:
        log.close()


def stop_nodes(processes, logs):
    """stop_all, then SIGKILL for the processes they left behind (workers
    of a launcher that did not stop them, a node left stopped)."""
    stop_all(processes, logs)
    for p in processes:
        for pid in descendants(p.pid)[1:]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def may_start(args):
    """--quiet-file: a run starts only while that file exists (a shared
    machine's signal that it is quiet); a run under way finishes."""
    if args.quiet_file and not os.path.exists(args.quiet_file):
        print(f"{args.quiet_file} is gone: no further run started", flush=True)
        return False
    return True


def etcd_counters(etcd):
    """(requests received, bytes sent, CPU seconds, time) of etcd now."""
    return (etcd.metric("grpc_server_msg_received_total"),
            etcd.metric("etcd_network_client_grpc_sent_bytes_total"),
            cpu_seconds(etcd.process.pid), time.monotonic())


def difference(before, after):
    """etcd's work between two etcd_counters(): requests, bytes, CPU seconds."""
    return {"requests": after[0] - before[0], "bytes": after[1] - before[1],
            "cpu": after[2] - before[2]}


def fit_quadratic(points, degree=2):
    """Least squares a + b n + c n^2 through (n, y) points: (a, b, c). With
    fewer than three sizes, c is 0 (and with one, b too). A term that would
    make the work shrink as the size grows (c < 0, then b < 0: noise, or a
    term too small to measure) is left out and the rest fitted again:
    extrapolated, it would turn the work negative."""
    sizes = sorted({n for n, _ in points})
    degree = min(len(sizes) - 1, degree)
    # The normal equations, solved by Gaussian elimination (no numpy here).
    m = degree + 1
    rows = [[sum(float(n) ** (i + j) for n, _ in points) for j in range(m)]
            + [sum(y * float(n) ** i for n, y in points)] for i in range(m)]
    for col in range(m):
        pivot = max(range(col, m), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(m):
            if r != col and rows[col][col]:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [x - factor * y for x, y in zip(rows[r], rows[col])]
    coefficients = [rows[i][m] / rows[i][i] if rows[i][i] else 0.0 for i in range(m)]
    if degree > 0 and coefficients[degree] < 0:
        return fit_quadratic(points, degree - 1)
    return tuple(coefficients + [0.0] * (3 - m))


def model(rows, ttl):
    """The etcd load model: fitted, checked against the largest size, used to
    predict."""
    runs = [r for _, results in rows for r in results]
    sizes = sorted({r["n"] for r in runs})
    if len(sizes) < 2:
        print("\nmodel: needs at least two sizes (--sizes)")
        return
    # At rest: per agent, least squares through the origin.
    at_rest = {key: sum(r[key] * r["n"] for r in runs) / sum(r["n"] ** 2 for r in runs)
               for key in ("rate", "sent", "cpu")}
    print(f"\nmodel of etcd's work, least squares over {len(runs)} run(s) of {len(sizes)} "
          f"size(s). At rest, per agent: {at_rest['rate']:.3f} requests/s (the keep-alives, "
          f"one a lease every TTL/3 = {3 / ttl:.2f}/s), {at_rest['sent']:.0f} bytes/s sent, "
          f"{1e3 * at_rest['cpu']:.3f} ms of CPU a second. A forming and a re-forming, less "
          "the load at rest over their agent-seconds, as a + b N + c N^2:")
    own = {"rate": "requests", "sent": "bytes", "cpu": "cpu"}

    def work(r, phase):
        # Agents start evenly over the start time, then all wait for the round.
        seconds = r["spawn"] / 2 + r["formed"] if phase == "forming" else r["reformed"]
        return {own[key]: r[phase][own[key]] - r[key] * seconds for key in own}
    measures = [("forming", "requests", 1, "requests"), ("forming", "bytes", 1e-6, "MB sent"),
                ("forming", "cpu", 1, "CPU s"), ("reforming", "requests", 1, "requests"),
                ("reforming", "bytes", 1e-6, "MB sent"), ("reforming", "cpu", 1, "CPU s")]
    largest = sizes[-1]
    print(f"| phase | measure | a | b | c | fit without N={largest}, at N={largest} | "
          f"measured at N={largest} | N=1,024 | N=4,096 |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    forming_cpu = None
    for phase, key, scale, unit in measures:
        points = [(r["n"], work(r, phase)[key] * scale) for r in runs]
        a, b, c = fit_quadratic(points)

        def at(n, f=(a, b, c)):
            return f[0] + f[1] * n + f[2] * n * n
        if (phase, key) == ("forming", "cpu"):
            forming_cpu = at
        held_out = fit_quadratic([p for p in points if p[0] != largest])
        measured = statistics.median(y for n, y in points if n == largest)
        print(f"| {phase} | {unit} | {a:.3g} | {b:.3g} | {c:.3g} | "
              f"{at(largest, held_out):.3g} | {measured:.3g} | {at(1024):.3g} | {at(4096):.3g} |")
    for n in (largest, 1024, 4096):
        left = 1 - at_rest["cpu"] * n
        time_to_form = (f"{forming_cpu(n) / left:.2f} s" if left > 0 else
                        "never (the load at rest alone takes the core)")
        print(f"N={n}: etcd at rest {100 * at_rest['cpu'] * n:.0f}% of a core; the forming's "
              f"work {forming_cpu(n):.2f} CPU s; formed, with etcd on one core and every agent "
              f"started at once, in at least {time_to_form}")


def scale_one(cli, n, ttl, directory):
    etcd = Etcd(directory)
    up = os.path.join(directory, "up.log")
    # One worker a node: records its round, world size, node and start time,
    # then sleeps (exec: the recorded shell is the sleeping process).
    worker = ["/bin/sh", "-c",
              f'echo "$DUCTILE_ROUND $WORLD_SIZE $DUCTILE_AGENT_NODE_ID $(date +%s%N)" >> {up}; '
              "exec sleep 1000000"]
    agents, logs = [], []
    first_start = time.time()
    at_start = etcd_counters(etcd)
    try:
        for i in range(n):
            log = open(os.path.join(directory, f"agent{i}.log"), "w")
            logs.append(log)
            agents.append(subprocess.Popen(
                [cli, "agent", "--rdzv", etcd.url.replace("http", "etcd"), "--job-id", "scale",
                 "--nnodes", f"1:{n}", "--nproc-per-node", "1", "--node-addr", "127.0.0.1",
                 "--node-id", f"n{i:03d}", "--lease-ttl", str(ttl), "--stop-grace", "1", "--"]
                + worker, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        last_start = time.time()
        wait_for(lambda: full_round(up, n), 300, f"a round of {n} workers")
        formed_round, formed_at = full_round(up, n)
        forming = difference(at_start, etcd_counters(etcd))

        # Steady state: every worker runs, nothing changes.
        time.sleep(3)
        before = etcd_counters(etcd)
        agents_before = sum(cpu_seconds(a.pid) for a in agents)
        time.sleep(10)
        after = etcd_counters(etcd)
        agents_cpu = sum(cpu_seconds(a.pid) for a in agents) - agents_before
        seconds = after[3] - before[3]
        rate = (after[0] - before[0]) / seconds
        sent = (after[1] - before[1]) / seconds
        cpu = (after[2] - before[2]) / seconds
        agents_cpu /= seconds

        # SIGKILL one agent and its worker: the youngest, unless it leads.
        victim = next(i for i in reversed(range(n)) if "leader:" not in open(
            os.path.join(directory, f"agent{i}.log")).read())
        at_kill = etcd_counters(etcd)
        killed = kill_node(agents[victim])
        wait_for(lambda: full_round(up, n - 1, formed_round), 300,
                 f"a round of the {n - 1} survivors' workers")
        _, reformed_at = full_round(up, n - 1, formed_round)
        reforming = difference(at_kill, etcd_counters(etcd))
        return {"n": n, "spawn": last_start - first_start, "formed": formed_at - last_start,
                "from_first": formed_at - first_start, "rounds": formed_round,
                "reformed": reformed_at - killed, "rate": rate, "sent": sent, "cpu": cpu,
                "agents_cpu": agents_cpu, "forming": forming, "reforming": reforming}
    finally:
        stop_all(agents, logs)
        etcd.stop()


def spread(values, fmt):
    values = sorted(values)
    median = statistics.median(values)
    if len(values) == 1:
        return format(median, fmt)
    return f"{format(median, fmt)} ({format(values[0], fmt)}-{format(values[-1], fmt)})"


def scale(args):
    print(f"ductile agent at scale: one etcd, N agents on loopback, 1 trivial worker each, "
          f"lease TTL {args.lease_ttl} s, poll interval 0.25 s (defaults otherwise); medians "
          f"(min-max) of {args.runs} run(s); {os.cpu_count()} CPU(s)", flush=True)
    rows = []
    for n in args.sizes:
        results = []
        for run in range(args.runs):
            if not may_start(args):
                break
            directory = tempfile.mkdtemp(prefix=f"ductile-bench-scale-{n}-")
            results.append(scale_one(args.cli, n, args.lease_ttl, directory))
            shutil.rmtree(directory, ignore_errors=True)  # kept when it failed: the logs
            r = results[-1]
            print(f"N={n} run {run + 1}: started in {r['spawn']:.2f} s, formed {r['formed']:.2f} s "
                  f"after the last start (round {r['rounds']}), re-formed {r['reformed']:.2f} s "
                  f"after the SIGKILL; at rest etcd {r['rate']:.0f} requests/s, "
                  f"{r['sent'] / 1e6:.2f} MB/s sent, {100 * r['cpu']:.0f}% CPU, agents "
                  f"{100 * r['agents_cpu']:.0f}% CPU; forming: etcd "
                  f"{r['forming']['requests']:.0f} requests, {r['forming']['bytes'] / 1e6:.2f} "
                  f"MB, {r['forming']['cpu']:.2f} CPU s; re-forming: "
                  f"{r['reforming']['requests']:.0f} requests, "
                  f"{r['reforming']['bytes'] / 1e6:.2f} MB, {r['reforming']['cpu']:.2f} CPU s",
                  flush=True)
        if results:
            rows.append((n, results))
    print()
    print("| agents | all started in (s) | formed, from the last start (s) | formed, from the "
          "first start (s) | rounds until formed | re-formed after a SIGKILL (s) | etcd "
          "requests/s | etcd sent (MB/s) | etcd CPU (%) | agents' CPU (%) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, results in rows:
        def col(k, f, m=1, results=results):
            return spread([m * r[k] for r in results], f)
        print(f"| {n} | {col('spawn', '.2f')} | {col('formed', '.2f')} | "
              f"{col('from_first', '.2f')} | {col('rounds', '.0f')} | {col('reformed', '.2f')} | "
              f"{col('rate', '.0f')} | {col('sent', '.2f', 1e-6)} | {col('cpu', '.0f', 100)} | "
              f"{col('agents_cpu', '.0f', 100)} |")
    model(rows, args.lease_ttl)
    print(f"\ngoals at 256 agents: formed within 2 s, re-formed within TTL + 1 = "
          f"{args.lease_ttl + 1} s")


def replay_one(program, n, ttl, in_flight, directory, joins_per_s=0):
    etcd = Etcd(directory)
    try:
        before = etcd.metric("etcd_network_client_grpc_sent_bytes_total")
        done = subprocess.run([program, etcd.url, str(etcd.process.pid), str(n), str(ttl), "10",
                               str(in_flight), str(joins_per_s)],
                              capture_output=True, text=True, timeout=600, check=False)
        sent = etcd.metric("etcd_network_client_grpc_sent_bytes_total") - before
    finally:
        etcd.stop()
    line = next((x for x in done.stdout.splitlines() if x.startswith("replay ")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"bench_agent.py: {program} failed (exit {done.returncode}): "
                 f"{done.stderr.strip()[-2000:]}")
    fields = dict(f.split("=", 1) for f in line.split()[1:])
    r = {k: float(v) for k, v in fields.items()}
    r["n"] = n
    r["rest"] = r["rest_cpu_s"] / r["rest_s"]  # of a core
    r["sent_mb"] = sent / 1e6
    return r


def replay(args):
    print(f"etcd's side of N agents, replayed by one process: one etcd on loopback, lease TTL "
          f"{args.lease_ttl} s, {args.in_flight} agents joining at a time"
          + (f", {args.join_rate} starting a second" if args.join_rate else "")
          + f"; medians (min-max) of "
          f"{args.runs} run(s); {os.cpu_count()} CPU(s)", flush=True)
    runs = []
    for n in args.sizes:
        for run in range(args.runs):
            if not may_start(args):
                break
            directory = tempfile.mkdtemp(prefix=f"ductile-bench-replay-{n}-")
            r = replay_one(args.replay, n, args.lease_ttl, args.in_flight, directory,
                           args.join_rate)
            shutil.rmtree(directory, ignore_errors=True)
            runs.append(r)
            print(f"N={n} run {run + 1}: joined in {r['joined_s']:.2f} s, the round at every "
                  f"watch {r['delivered_s']:.2f} s after its write; etcd {r['forming_cpu_s']:.2f} "
                  f"CPU s over both, {r['sent_mb']:.1f} MB sent in all; at rest "
                  f"{100 * r['rest']:.1f}% of a core ({r['renewals'] / r['rest_s']:.0f} "
                  "renewals/s)", flush=True)
    sizes = sorted({r["n"] for r in runs})
    print()
    print("| agents | joined (s) | round at every watch (s) | etcd CPU, forming (s) | "
          "per agent (ms) | etcd at rest (% of a core) | per agent (ms/s) | formed, etcd on "
          "one core (s) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    def on_one_core(r):
        return r["forming_cpu_s"] / (1 - r["rest"]) if r["rest"] < 1 else float("inf")

    for n in sizes:
        mine = [r for r in runs if r["n"] == n]

        def col(values, fmt, mine=mine):
            return spread([values(r) for r in mine], fmt)
        print(f"| {n} | {col(lambda r: r['joined_s'], '.2f')} | "
              f"{col(lambda r: r['delivered_s'], '.2f')} | "
              f"{col(lambda r: r['forming_cpu_s'], '.2f')} | "
              f"{col(lambda r, n=n: 1e3 * r['forming_cpu_s'] / n, '.2f')} | "
              f"{col(lambda r: 100 * r['rest'], '.1f')} | "
              f"{col(lambda r, n=n: 1e3 * r['rest'] / n, '.3f')} | "
              f"{col(on_one_core, '.2f')} |")
    if len(sizes) < 2:
        return
    a, b, c = fit_quadratic([(r["n"], r["forming_cpu_s"]) for r in runs])
    rest = sum(r["rest"] * r["n"] for r in runs) / sum(r["n"] ** 2 for r in runs)
    largest = sizes[-1]
    held_out = fit_quadratic([(r["n"], r["forming_cpu_s"]) for r in runs if r["n"] != largest])
    def at(n, f=(a, b, c)):
        return f[0] + f[1] * n + f[2] * n * n
    measured = statistics.median(r["forming_cpu_s"] for r in runs if r["n"] == largest)
    print(f"\nfit over {len(runs)} run(s): the forming's etcd CPU = {a:.3g} + {b:.3g} N + "
          f"{c:.3g} N^2 s (without N={largest}: {at(largest, held_out):.2f} s at N={largest}, "
          f"measured {measured:.2f} s); at rest {1e3 * rest:.3f} ms of CPU a second an agent")
    for n in (1024, 4096):
        left = 1 - rest * n
        formed = f"{at(n) / left:.2f} s" if left > 0 else "never (the load at rest takes the core)"
        print(f"N={n}: etcd at rest {100 * rest * n:.0f}% of a core; the forming's CPU "
              f"{at(n):.2f} s; formed, with etcd on one core, in {formed}")


RACE_WORKER = r'''
import os, sys, time
out = sys.argv[1]
def note(what):
    with open(out, "a") as f:
        f.write(f"{what} {os.environ['GROUP_RANK']}.{os.environ['LOCAL_RANK']} "
                f"{os.environ.get('TORCHELASTIC_RESTART_COUNT')} {os.environ['WORLD_SIZE']} "
                f"{time.time_ns()}\n")
note("started")
import datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
note("reduced")
while True:
    dist.all_reduce(t)
    time.sleep(0.1)
'''


def race_one(kind, args, directory):
    out = os.path.join(directory, f"{kind}.log")
    script = os.path.join(directory, "worker.py")
    with open(script, "w") as f:
        f.write(RACE_WORKER)
    etcd = Etcd(directory) if kind == "ductile" else None
    started_at = time.time()
    c10d = f"127.0.0.1:{free_port()}"
    nodes, logs = [], []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON_EXEC=args.python)
    if kind == "torchrun-own-store":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        for i in range(args.nodes):
            log = open(os.path.join(directory, f"{kind}-node{i}.log"), "w")
            logs.append(log)
            common = ["--nnodes", f"2:{args.nodes}", "--nproc-per-node", "2",
                      "--max-restarts", "3", "--rdzv-id", "race", "--local-addr", "127.0.0.1"]
            if kind.startswith("torchrun"):
                argv = [args.python, "-m", "torch.distributed.run", *common,
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", c10d]
            elif kind == "ductile-c10d":
                argv = [args.cli, "agent", *common, "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", c10d]
            else:
                argv = [args.cli, "agent", *common, "--rdzv-backend", "etcd",
                        "--rdzv-endpoint", etcd.url.replace("http://", "")]
            nodes.append(subprocess.Popen(argv + [script, out], stdout=log,
                                          stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
            time.sleep(0.2)  # node 0 first: it hosts torchrun's store, it leads the agents

        def lines(what, world):
            """(what, group.local rank, restarts, world size, s since the epoch)"""
            try:
                with open(out) as f:
                    rows = [line.split() for line in f]
            except FileNotFoundError:
                return []
            return [r for r in rows if len(r) == 5 and r[0] == what and r[3] == str(world)]

        full = 2 * args.nodes
        wait_for(lambda: len(lines("reduced", full)) >= full, 600, f"{kind}: the first group")
        formed = (max(int(x[4]) for x in lines("started", full)) / 1e9 - started_at,
                  max(int(x[4]) for x in lines("reduced", full)) / 1e9 - started_at)
        time.sleep(2)
        # The node to kill: the last started (not node 0: torchrun's store,
        # the agents' leader).
        killed = kill_node(nodes[-1])
        survivors = 2 * (args.nodes - 1)
        # Until the survivors' workers all-reduce, or every survivor's
        # launcher gave up (the job failed: no recovery).
        wait_for(lambda: len(lines("reduced", survivors)) >= survivors
                 or all(p.poll() is not None for p in nodes[:-1]), 600,
                 f"{kind}: the survivors' first all-reduce")
        if len(lines("reduced", survivors)) < survivors:
            codes = [p.returncode for p in nodes[:-1]]
            print(f"{kind}: the survivors' launchers exited ({codes}) "
                  f"{time.time() - killed:.1f} s after the SIGKILL without recovering",
                  flush=True)
            return formed + (None, None)
        restarted = max(int(x[4]) for x in lines("started", survivors)) / 1e9 - killed
        reduced = max(int(x[4]) for x in lines("reduced", survivors)) / 1e9 - killed
        return formed + (restarted, reduced)
    except Exception:
        kept = tempfile.mkdtemp(prefix=f"ductile-bench-race-failed-{kind}-")
        shutil.copytree(directory, kept, dirs_exist_ok=True)
        print(f"{kind}: failed; its logs are in {kept}", file=sys.stderr)
        raise
    finally:
        stop_nodes(nodes, logs)  # workers left behind: torchrun's, after a SIGTERM
        if etcd:
            etcd.stop()


LAUNCHERS = {"torchrun": "torchrun (c10d, defaults)",
             "torchrun-own-store": "torchrun (c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)",
             "ductile": "ductile agent (etcd, defaults)",
             "ductile-c10d": "ductile agent (c10d, torchrun's command line)"}


def race(args):
    results = {kind: [] for kind in args.launchers}
    for run in range(args.runs):
        if not may_start(args):
            break
        for kind in args.launchers:
            directory = tempfile.mkdtemp(prefix=f"ductile-bench-race-{kind}-")
            try:
                results[kind].append(race_one(kind, args, directory))
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            r = results[kind][-1]
            print(f"run {run + 1} {kind}: formed {r[0]:.2f} s (workers started), {r[1]:.2f} s "
                  "(first all-reduce); " + ("did not recover" if r[2] is None else
                  f"workers started again {r[2]:.2f} s, first all-reduce {r[3]:.2f} s after "
                  "the SIGKILL"), flush=True)
    print(f"\n{args.nodes} nodes x 2 gloo workers on loopback; formed: from the first "
          f"launcher's start; re-formed: one node SIGKILLed (launcher and workers); medians "
          f"(min-max) of the runs (re-formed: of the recovered runs); {os.cpu_count()} CPU(s)")
    print("| launcher | formed: workers started (s) | formed: first all-reduce (s) | recovered | "
          "re-formed: workers started again (s) | re-formed: first all-reduce (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind, runs in results.items():
        ok = [r for r in runs if r[2] is not None]
        def col(rows, i):
            return spread([r[i] for r in rows], ".2f") if rows else "-"
        print(f"| {LAUNCHERS[kind]} | {col(runs, 0)} | {col(runs, 1)} | {len(ok)} of {len(runs)} "
              f"| {col(ok, 2)} | {col(ok, 3)} |")
    # The goals are the launchers' own part: until the workers run. The
    # first all-reduce adds the workers' import of torch and gloo's set-up,
    # alike under both.
    goals = ((0, "formed, workers started", 0.2), (1, "formed, first all-reduce", None),
             (2, "re-formed, workers started again", 0.33),
             (3, "re-formed, first all-reduce", None))
    for ours in ("ductile", "ductile-c10d"):
        for rival in ("torchrun", "torchrun-own-store"):
            for i, what, goal in goals:
                mine = [r[i] for r in results.get(ours, []) if r[i] is not None]
                theirs = [r[i] for r in results.get(rival, []) if r[i] is not None]
                if not mine or not theirs:
                    continue
                # Every run against the rival's median: a goal is met when
                # every run meets it.
                rival_median = statistics.median(theirs)
                ratios = [m / rival_median for m in mine]
                print(f"{ours} / {rival} ({what}): {statistics.median(ratios):.2f} "
                      f"(worst run {max(ratios):.2f}"
                      + (f"; goal: at most {goal})" if goal else ")"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["scale", "replay", "race"])
    parser.add_argument("--cli", default=os.path.join(ROOT, "build", "bin", "ductile"))
    parser.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    parser.add_argument("--sizes", default=None,
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--lease-ttl", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quiet-file", help="start a run only while this file exists")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS),
                        type=lambda s: s.split(","))
    # Their defaults are each command's: scale 8,64,256 x 3; replay
    # 256,512,1024,2048 x 2.
    parser.add_argument("--scale-runs", type=int, default=None, dest="scale_runs")
    parser.add_argument("--replay", default=os.path.join(ROOT, "build", "bin", "agent_etcd_replay"))
    parser.add_argument("--in-flight", type=int, default=32, dest="in_flight")
    parser.add_argument("--join-rate", type=int, default=0, dest="join_rate")
    args = parser.parse_args()
    if args.what == "replay":
        if not os.access(args.replay, os.X_OK):
            sys.exit(f"bench_agent.py: --replay {args.replay} is not an executable; build it "
                     "(cmake --build build --target agent_etcd_replay)")
        args.sizes = args.sizes or [256, 512, 1024, 2048]
        args.runs = args.scale_runs or 2
        return replay(args)
    if not os.access(args.cli, os.X_OK):
        sys.exit(f"bench_agent.py: --cli {args.cli} is not an executable; build it (./run.sh, "
                 "or cmake --build build --target ductile_cli ductile_agent)")
    bad = [k for k in args.launchers if k not in LAUNCHERS]
    if bad:
        sys.exit(f"bench_agent.py: --launchers {bad[0]!r} is not valid; use "
                 f"{', '.join(LAUNCHERS)}")
    if args.what == "scale":
        args.sizes = args.sizes or [8, 64, 256]
        args.runs = args.scale_runs or 3
        scale(args)
    else:
        race(args)


if __name__ == "__main__":
    main()
