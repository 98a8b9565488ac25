"""The agent's part in the in-place recovery tests and benchmark (not a test
by itself): a TCPStore for the workers, ranks of zero3_rejoin_worker.py
started as the agent starts them, a restore folder assembled from the nodes'
snapshot folders, and the round notices."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from zero3_launch import CONFIG, environment, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "zero3_rejoin_worker.py")


def serve_store():
    """A TCPStore served here, as the leading agent serves the workers'."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    return store, port


def start(out, spec, world, port, round_=1, notices=True, restore=None):
    """`world` ranks of the worker; a list of Popen."""
    os.makedirs(out, exist_ok=True)
    config = os.path.join(out, "zero.toml")
    with open(config, "w") as f:
        f.write(CONFIG + "snapshot_interval = 1\n")
    spec_path = os.path.join(out, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(dict(spec, out=str(out), zero_config=config), f)
    procs = []
    for r in range(world):
        env = dict(environment(), RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0",
                   LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_USE_AGENT_STORE="True", DUCTILE_ROUND=str(round_),
                   DUCTILE_SNAPSHOT_DIR=os.path.join(out, f"node{r}"),
                   DUCTILE_ROUND_END_WAIT="60")
        env.pop("DUCTILE_SNAPSHOT_RESTORE", None)
        env.pop("DUCTILE_ROUND_NOTICE", None)
        if notices:
            env["DUCTILE_ROUND_NOTICE"] = os.path.join(out, f"notice-rank{r}.json")
        if restore is not None:
            env["DUCTILE_SNAPSHOT_RESTORE"] = str(restore)
        log = open(os.path.join(out, f"stderr-rank{r}.txt"), "w")
        procs.append(subprocess.Popen([sys.executable, WORKER, spec_path], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_for(path, procs, timeout=240):
    """Waits until `path` exists; fails when a rank exits first."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        for p in procs:
            assert p.poll() is None, f"a rank exited ({p.returncode}) before {path}"
        assert time.monotonic() < deadline, f"no {path} within {timeout} s"
        time.sleep(0.01)


def committed(node):
    """The tag a node's `latest` names."""
    with open(os.path.join(node, "latest")) as f:
        return f.read().split("\n")[0]


def assemble(out, world, tag):
    """A complete snapshot folder of `tag` from the nodes' folders (the lost
    node's files as its replica would hold them), as the agent assembles
    one: every rank's file and the manifest, identical on every node."""
    folder = os.path.join(out, "restore", tag)
    os.makedirs(folder)
    for r in range(world):
        source = os.path.join(out, f"node{r}", tag)
        for name in os.listdir(source):
            if not os.path.exists(os.path.join(folder, name)):
                shutil.copy(os.path.join(source, name), folder)
    return folder


def write_notice(path, fields):
    """The agent's write: staged, then renamed over the path."""
    staged = path + ".tmp"
    with open(staged, "w") as f:
        json.dump(fields, f)
    os.replace(staged, path)


def notice(round_, rank, world, port, restore):
    return {"round": round_, "rank": rank, "world_size": world, "local_rank": 0,
            "local_world_size": 1, "master_addr": "127.0.0.1", "master_port": port,
            "store_prefix": f"ductile/round{round_}/", "restore": str(restore)}


def kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def losses(out, rank):
    """The last record of each step of a rank's log: {step: record}."""
    by_step = {}
    with open(os.path.join(out, f"losses-rank{rank}.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            by_step[record["step"]] = record
    return by_step


def finish(procs, timeout=240):
    """Waits for the ranks; their exit statuses."""
    return [p.wait(timeout=timeout) for p in procs]


class Releases:
    """Takes the leaders' release requests (`<node>/release`) as the agents
    do, on a thread, while running (a context manager)."""

    def __init__(self, nodes):
        import threading
        self.nodes = nodes
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            for node in self.nodes:
                path = os.path.join(node, "release")
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            time.sleep(0.005)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        return False
