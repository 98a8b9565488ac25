"""Recovery from a lost node, raced: `ductile agent` restoring the training
state from the survivors' memory against torchrun with torch's distributed
checkpoint (DCP) read back from disk. It prints tables; nothing asserts on
time.

The same job on every side: 3 nodes x 1 worker as processes on loopback, the
tied transformer LM of the zero3 tests (about 2 M parameters), Adam, a
global batch of 24 windows, every optimizer step checkpointed:
  ductile-in-place  `ductile agent` on etcd, zero3 workers over torch's gloo
            group, the documented loop: at a loss the survivors' agents write
            round notices and the same worker processes rejoin the next
            round from the snapshot in memory (engine.rejoin); only the
            SIGKILL to first step and the steps trained again apply;
  ductile   `ductile agent` on etcd, --mpi-world, zero3 workers (cpu backend)
            with snapshot_interval 1 and snapshot_replicas 1: each step's
            state goes to the agents' memory and one other node's;
  ductile-warm  the same with --warm-workers: the survivors' new workers
            start in spare interpreters that imported torch ahead;
  trainer-in-place  a Hugging Face Trainer script on ductile.hf.DuctileTrainer
            (a Llama of the same size made by from_config under zero.Init,
            ZeRO-3 through ductile.deepspeed, 8 windows a rank and step):
            the survivors' Trainers rejoin in place and enter their loop
            again at the restored step;
  trainer   the same script with its workers started again in the next
            round (--checkpoint-timeout 60 turns notices off), each new
            Trainer entering its loop at the restored step;
  torchrun  torchrun (c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it
            the survivors' workers never meet, pytorch/pytorch#135712),
            DistributedDataParallel over gloo, and
            torch.distributed.checkpoint.save after every step into a local
            folder, loaded by the next round's workers.
After --kill-after steps, the last node started is SIGKILLed (its launcher
and every process below it). From the kill, per run: the survivors'
workers started again (detection and re-form), torch imported (process
start), the group joined and the state restored (ductile: zero3.initialize,
which restores; torchrun: init_process_group, then DCP's load), the first
step of the new round completed; and the steps trained again. For ductile,
each live agent's snapshot area is sampled every few milliseconds: the
peak its rank files reach, against (1 + snapshot_replicas) x 2 x its node's
state, is printed for the steady training before the kill and after the
restore (from the survivors' fourth step); and, not bound, in between.

usage: bench_recovery.py [--cli PATH] [--python PATH] [--runs 2] [--kill-after 6]
                         [--steps 12] [--lease-ttl S]
                         [--launchers ductile-in-place,ductile,ductile-warm,trainer-in-place,
                                      trainer,torchrun]
"""

import argparse
import fcntl
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_agent import ROOT, Etcd, free_port, kill_node, signal_node, spread, stop_nodes

NODES = 3
BATCH = 24
MODEL = {"d": 192, "heads": 4, "layers": 4, "context": 32}
JOB_TOML = """[elasticity]
policy = "v0.1"
max_train_batch_size = 24
micro_batch_sizes = [1, 2, 3]
min_gpus = 1
max_gpus = 6
"""

# Each worker appends "<event> <round> <world> <rank> <step> <ns since the epoch>"
# to the run's notes file; <step>: the step trained or resumed at, else -1.
COMMON = r'''
import os, sys, time
out, steps = sys.argv[1], int(sys.argv[2])
def note(event, round_, world, rank, step=-1):
    with open(out, "a") as f:
        f.write(f"{event} {round_} {world} {rank} {step} {time.time_ns()}\n")
ROUND = os.environ.get("DUCTILE_ROUND") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
note("started", ROUND, os.environ["WORLD_SIZE"], os.environ["RANK"])
import torch
torch.set_num_threads(1)
from zero3_model import Windows, WithLoss, loss_of, make_model
note("imported", ROUND, os.environ["WORLD_SIZE"], os.environ["RANK"])
MODEL = %r
BATCH = %d
'''

DUCTILE_WORKER = COMMON + r'''
import ductile, ductile.torch.zero3 as zero3
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
config = ductile.load_config(
    {"accelerator": {"backend": "cpu", "communicator": "auto", "timeout": 120},
     "zero": {"coordinator": "partitioned", "snapshot_interval": 1,
              "snapshot_replicas": %d}},
    format="toml")
model = make_model(seed=0, **MODEL)
note("built", ROUND, world, rank)
engine = zero3.initialize(model, lambda params: torch.optim.Adam(params, lr=3e-3), config)
start = engine.global_step if engine.restored_from_memory is not None else 0
note("ready", ROUND, world, rank, start)
windows = Windows(batch=BATCH, context=MODEL["context"])
for s in range(start, steps):
    x, y = windows.step(s, rank, world)
    engine.backward(loss_of(engine(x), y))
    engine.step()
    note("stepped", ROUND, world, rank, s)
'''

# The documented loop over torch's gloo group (the loss is the forward's
# output): when a node is lost, the survivors' agents write round notices and
# these same processes rejoin the next round (engine.rejoin).
IN_PLACE_WORKER = COMMON + r'''
import ductile, ductile.torch.zero3 as zero3
import torch.distributed as dist
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
dist.init_process_group("gloo")
config = ductile.load_config(
    {"accelerator": {"backend": "cpu", "communicator": "auto", "timeout": 120},
     "zero": {"coordinator": "partitioned", "snapshot_interval": 1,
              "snapshot_replicas": %d}},
    format="toml")
note("built", ROUND, world, rank)
engine = zero3.initialize(WithLoss(seed=0, **MODEL),
                          lambda params: torch.optim.Adam(params, lr=3e-3), config)
note("ready", ROUND, world, rank, 0)
windows = Windows(batch=BATCH, context=MODEL["context"])
while engine.global_step < steps:
    s = engine.global_step
    engine.backward(engine(*windows.step(s, engine.rank, engine.world_size)))
    engine.step()
    note("stepped", os.environ["DUCTILE_ROUND"], engine.world_size, engine.rank,
         engine.global_step - 1)
'''

# A Hugging Face Trainer script on DuctileTrainer: the arguments first (ZeRO-3
# through ductile.deepspeed), then the model from its config, as in
# transformers' examples; "ready" once the engine exists, "stepped" at each
# step's end.
TRAINER_WORKER = COMMON + r'''
import transformers
from ductile.hf import DuctileTrainer
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 256, (BATCH * 64, MODEL["context"]),
                                 generator=torch.Generator().manual_seed(1))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
class Notes(transformers.TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        note("ready", os.environ["DUCTILE_ROUND"], torch.distributed.get_world_size(),
             torch.distributed.get_rank(), state.global_step)
    def on_step_end(self, args, state, control, **kwargs):
        note("stepped", os.environ["DUCTILE_ROUND"], torch.distributed.get_world_size(),
             torch.distributed.get_rank(), state.global_step - 1)
args = transformers.TrainingArguments(
    output_dir=os.path.join(os.path.dirname(out), "trainer"), use_cpu=True,
    ddp_backend="gloo", max_steps=steps, per_device_train_batch_size=BATCH // 3,
    learning_rate=3e-3, logging_steps=1000, save_strategy="no", report_to=[],
    disable_tqdm=True, seed=0, dataloader_num_workers=0,
    deepspeed={"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
               "train_batch_size": "auto", "zero_optimization": {"stage": 3},
               "snapshot": {"interval": 1, "replicas": %d}})
model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
    vocab_size=256, hidden_size=MODEL["d"], intermediate_size=4 * MODEL["d"],
    num_hidden_layers=MODEL["layers"], num_attention_heads=MODEL["heads"],
    max_position_embeddings=MODEL["context"]))
note("built", ROUND, world, rank)
DuctileTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Notes()]).train()
'''

TORCHRUN_WORKER = COMMON + r'''
import datetime
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
note("joined", ROUND, world, rank)
model = DistributedDataParallel(make_model(seed=0, **MODEL))
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
folder = os.path.join(os.path.dirname(out), "dcp")
start = 0
try:
    with open(os.path.join(folder, "LATEST")) as f:
        start = int(f.read())
except FileNotFoundError:
    pass
if start:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=os.path.join(folder, f"step{start}"))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
note("ready", ROUND, world, rank, start)
windows = Windows(batch=BATCH, context=MODEL["context"])
for s in range(start, steps):
    x, y = windows.step(s, rank, world)
    loss_of(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state},
             checkpoint_id=os.path.join(folder, f"step{s + 1}"))
    if rank == 0:
        with open(os.path.join(folder, "LATEST.tmp"), "w") as f:
            f.write(str(s + 1))
        os.replace(os.path.join(folder, "LATEST.tmp"), os.path.join(folder, "LATEST"))
    note("stepped", ROUND, world, rank, s)
'''


def notes(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                p = line.split()
                if len(p) == 6:
                    rows.append((p[0], p[1], int(p[2]), int(p[3]), int(p[4]), int(p[5]) / 1e9))
    except FileNotFoundError:
        pass
    return rows


REPLICAS = 1  # the workers' snapshot_replicas
# A node's snapshot memory, at most: its own snapshots and those of each node
# it keeps replicas of, double-buffered, in its node's state bytes.
BOUND = (1 + REPLICAS) * 2


def area_bytes(base):
    """Per live agent's snapshot area: (bytes its rank files take, bytes its
    other files take, bytes the rank files of its node's newest snapshot
    take: the node's state). Bytes are blocks (st_blocks x 512), each inode
    counted once: a restore's hard links to the area's own files take
    nothing more."""
    out = {}
    for area in os.listdir(base):
        try:  # a live agent holds its area's lock; a killed one's is free
            with open(os.path.join(base, area, "lock")) as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                continue
        except BlockingIOError:
            pass
        except OSError:
            continue
        shards, small, seen = 0, 0, set()
        for folder, _, files in os.walk(os.path.join(base, area)):
            for name in files:
                try:
                    info = os.lstat(os.path.join(folder, name))
                except FileNotFoundError:
                    continue  # removed meanwhile (a snapshot superseded)
                if (info.st_dev, info.st_ino) in seen:
                    continue
                seen.add((info.st_dev, info.st_ino))
                if name.startswith("rank"):
                    shards += info.st_blocks * 512
                else:
                    small += info.st_blocks * 512
        own = os.path.join(base, area, "own")
        state = 0
        try:
            with open(os.path.join(own, "latest")) as f:
                tag = f.readline().strip()
            for name in os.listdir(os.path.join(own, tag)):
                if name.startswith("rank"):
                    state += os.lstat(os.path.join(own, tag, name)).st_blocks * 512
        except OSError:
            continue
        if state:
            out[area] = (shards, small, state)
    return out


class MemorySampler:
    """Samples the live areas every few milliseconds on a thread; peak()
    is each area's highest held / state ratio among the samples taken in a
    time window."""

    def __init__(self, base):
        self.base, self.samples = base, []  # (time, area, shards, small, state)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            now = time.time()
            for area, (shards, small, state) in area_bytes(self.base).items():
                self.samples.append((now, area, shards, small, state))
            self.stop.wait(0.005)

    def close(self):
        self.stop.set()
        self.thread.join()

    def states(self, start):
        """{area: its node's state in the last sample taken from `start` on}."""
        return {area: state for at, area, _, _, state in self.samples if at >= start}

    def peak(self, start, end):
        """{area: (its highest rank files / state ratio, the most bytes its
        other files took)} among the samples taken from `start` to `end`."""
        peaks = {}
        for at, area, shards, small, state in self.samples:
            if start <= at < end:
                ratio, most = peaks.get(area, (0.0, 0))
                peaks[area] = (max(ratio, shards / state), max(most, small))
        return peaks


def wait_for(predicate, limit, what, alive):
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        if not any(p.poll() is None for p in alive):
            raise RuntimeError(f"every launcher exited before {what}")
        time.sleep(0.02)


def race_one(kind, args, directory):
    out = os.path.join(directory, "notes")
    script = os.path.join(directory, "worker.py")
    with open(script, "w") as f:
        f.write(TORCHRUN_WORKER % (MODEL, BATCH) if kind == "torchrun" else
                IN_PLACE_WORKER % (MODEL, BATCH, REPLICAS) if kind == "ductile-in-place" else
                TRAINER_WORKER % (MODEL, BATCH, REPLICAS) if kind.startswith("trainer") else
                DUCTILE_WORKER % (MODEL, BATCH, REPLICAS))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(args.build, "python"),
                                           os.path.join(ROOT, "tests", "python")]),
               DUCTILE_TEST_DATA_DIR=os.path.join(ROOT, "tests", "data"))
    if kind == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if kind.startswith("trainer"):
        env["DS_ACCELERATOR"] = "cpu"
    etcd = None if kind == "torchrun" else Etcd(directory)
    os.makedirs(os.path.join(directory, "dcp"), exist_ok=True)
    config = os.path.join(directory, "job.toml")
    with open(config, "w") as f:
        f.write(JOB_TOML)
    # Each run's agents in a folder of their own: the areas measured are
    # theirs, never those a killed agent of an earlier run left.
    shm = os.path.join(directory if args.snapshot_dir is None else args.snapshot_dir,
                       f"shm-{os.path.basename(directory)}")
    os.makedirs(shm, exist_ok=True)
    c10d = f"127.0.0.1:{free_port()}"
    nodes, logs = [], []
    sampler = None if kind == "torchrun" else MemorySampler(shm)
    try:
        for i in range(NODES):
            log = open(os.path.join(directory, f"node{i}.log"), "w")
            logs.append(log)
            if kind == "torchrun":
                argv = [args.python, "-m", "torch.distributed.run", "--nnodes", f"2:{NODES}",
                        "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-id", "race",
                        "--local-addr", "127.0.0.1", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", c10d]
            else:
                argv = [args.cli, "agent", "--config", config, "--rdzv", etcd.url,
                        "--job-id", "race", "--node-addr", "127.0.0.1", "--nproc-per-node", "1",
                        "--min-nodes", "2", "--snapshot-dir", shm]
                argv += ["--lease-ttl", str(args.lease_ttl)] if args.lease_ttl else []
                argv += ["--heartbeat", str(args.heartbeat)] if args.heartbeat else []
                argv += ["--mpi-world"] if kind in ("ductile", "ductile-warm") else []
                argv += ["--checkpoint-timeout", "60"] if kind == "trainer" else []
                argv += ["--warm-workers"] if kind == "ductile-warm" else []
                argv += ["--", args.python]
            nodes.append(subprocess.Popen(argv + [script, out, str(args.steps)], stdout=log,
                                          stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
            time.sleep(0.2)

        def stepped(world, at_least):
            return [r for r in notes(out) if r[0] == "stepped" and r[2] == world
                    and r[4] >= at_least]
        wait_for(lambda: len(stepped(NODES, args.kill_after - 1)) >= NODES, 900,
                 f"{kind}: step {args.kill_after} at world size {NODES}", nodes)
        done = max(r[4] for r in notes(out) if r[0] == "stepped") + 1
        victim = nodes[-1] if args.victim == "last" else random.choice(nodes)
        survivors_of = [p for p in nodes if p is not victim]
        # SIGSTOP: the node goes silent (a cut cable, a hung host), its
        # connections stay open.
        killed = (kill_node(victim) if args.signal == "KILL"
                  else signal_node(victim, signal.SIGSTOP))
        survivors = NODES - 1

        def after(event):
            rows = [r for r in notes(out) if r[0] == event and r[2] == survivors
                    and r[5] > killed]
            return rows if len(rows) >= survivors else None
        wait_for(lambda: after("stepped") is not None, 900,
                 f"{kind}: the survivors' first step", survivors_of)
        if args.signal == "STOP":
            kill_node(victim)  # it never comes back
        if kind in ("ductile-in-place", "trainer-in-place"):
            # The same processes go on: no start, import or build to time.
            stepped_after = after("stepped")
            first_step = min(r[5] for r in stepped_after) - killed
            resumed_at = min(r[4] for r in stepped_after)
            return (None, None, None, None, first_step, done - resumed_at)
        ready = after("ready")
        for i in range(NODES - 1):  # the agents' word on what they restored
            with open(os.path.join(directory, f"node{i}.log")) as f:
                for line in f:
                    if "from memory" in line or "snapshot" in line:
                        print(f"{kind} node {i}: {line.rstrip()}", flush=True)
        times = [max(r[5] for r in after(e)[:survivors]) - killed
                 for e in ("started", "imported", "ready")]
        first_step = min(r[5] for r in after("stepped")) - killed
        built = after("built")
        if built is not None:  # ductile's join and restore, in two
            built_at = max(r[5] for r in built[:survivors]) - killed
            print(f"{kind}: join and restore = {built_at - times[1]:.2f} s importing "
                  f"ductile and building the model + {times[2] - built_at:.2f} s in "
                  "zero3.initialize (world, shards, restore)", flush=True)
        resumed_at = ready[0][4]
        # detection and re-form, process start (torch imported), join and
        # restore, first step; the total; steps trained again.
        if sampler:
            # Until the survivors' workers took 8 snapshots of their own.
            wait_for(lambda: len([r for r in notes(out) if r[0] == "stepped" and
                                  r[2] == survivors and r[5] > killed]) >= 8 * survivors
                     or all(p.poll() is not None for p in survivors_of), 300,
                     f"{kind}: 8 steps after the restore", survivors_of)
            sampler.close()
            # Steady training: up to the kill; and from the survivors'
            # fourth step on, once the last round's snapshots, the restored
            # copy and the lost node's replicas are released (two
            # snapshots of the new round committed and replicated).
            steps = [sorted(r[5] for r in notes(out) if r[0] == "stepped" and
                            r[2] == survivors and r[3] == rank) for rank in range(survivors)]
            windows = [("before the kill", 0, killed)]
            if all(len(t) >= 4 for t in steps):
                steady = max(t[3] for t in steps)
                # The restored copy is held until every node's first new
                # snapshot is replicated: bound against the new round's
                # state with 2 survivors and one replica (elastic-agent.md).
                windows += [("in the restore's transition", killed, steady),
                            ("after the restore", steady, float("inf"))]
            # After the kill, the survivors' areas only (the killed node's is
            # sampled as it dies).
            survivors_areas = sampler.peak(windows[-1][1], float("inf"))
            # The transition is measured against the last round's state (what
            # own/latest names until the new round commits); the new round's
            # (after the restore) is 3/2 of it here, and is what the bound
            # holds to from then on.
            new_states = sampler.states(windows[-1][1])
            for when, start, end in windows:
                for area, (ratio, small) in sorted(sampler.peak(start, end).items()):
                    if start >= killed and area not in survivors_areas:
                        continue
                    held = max(x[2] for x in sampler.samples
                               if x[1] == area and start <= x[0] < end)
                    new = f" ({held / new_states[area]:.2f}x the new round's)" \
                        if when == "in the restore's transition" else ""
                    print(f"{kind}: {area} {when}: rank files at most {ratio:.2f}x its node's "
                          f"state{new} (bound {BOUND}x: (1 + {REPLICAS} replica) x 2), other "
                          f"files at most {small / 2**10:.0f} KiB", flush=True)
        return (times[0], times[1] - times[0], times[2] - times[1], first_step - times[2],
                first_step, done - resumed_at)
    except Exception:
        kept = tempfile.mkdtemp(prefix=f"ductile-bench-recovery-failed-{kind}-")
        shutil.copytree(directory, kept, dirs_exist_ok=True, ignore_dangling_symlinks=True)
        print(f"{kind}: failed; its logs are in {kept}", file=sys.stderr)
        raise
    finally:
        if sampler:
            sampler.close()
        stop_nodes(nodes, logs)
        if etcd:
            etcd.stop()
        shutil.rmtree(shm, ignore_errors=True)


COLUMNS = ("detection and re-form (s)", "process start (s)", "join and restore (s)",
           "first step (s)", "SIGKILL to first step (s)", "steps trained again")
NAMES = {"ductile-in-place": "ductile agent (etcd), survivors rejoin in place from memory",
         "ductile": "ductile agent (etcd), restore from memory",
         "ductile-warm": "ductile agent (etcd), restore from memory, --warm-workers",
         "trainer-in-place": "DuctileTrainer, ductile agent (etcd), survivors in place",
         "trainer": "DuctileTrainer, ductile agent (etcd), restarted, restore from memory",
         "torchrun": "torchrun (c10d), DCP from disk"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cli", default=os.path.join(ROOT, "build", "bin", "ductile"))
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-after", type=int, default=6, dest="kill_after",
                        help="the step after which a node is killed (0: a random one of each run)")
    parser.add_argument("--victim", default="last", choices=("last", "random"),
                        help="the node killed: the last started, or any of the 3 at random")
    parser.add_argument("--snapshot-dir", default=None, dest="snapshot_dir",
                        help="where each run's agents get a folder for their snapshot areas "
                             "(default: the run's temporary folder; /dev/shm: in memory)")
    parser.add_argument("--lease-ttl", type=int, default=0, dest="lease_ttl",
                        help="the agents' --lease-ttl (0: the agent's default)")
    parser.add_argument("--heartbeat", type=float, default=0,
                        help="the agents' --heartbeat (0: the agent's default)")
    parser.add_argument("--signal", default="KILL", choices=("KILL", "STOP"),
                        help="how the node is lost: SIGKILL of its processes, or SIGSTOP "
                             "(silent; killed once the survivors stepped)")
    parser.add_argument("--launchers", default="ductile-in-place,ductile,torchrun",
                        type=lambda s: s.split(","))
    args = parser.parse_args()
    bad = [k for k in args.launchers if k not in NAMES]
    if bad:
        sys.exit(f"bench_recovery.py: --launchers {bad[0]!r} is not valid; use "
                 f"{', '.join(NAMES)}")
    if args.kill_after == 0:
        pass  # drawn per run
    elif not 1 <= args.kill_after < args.steps:
        sys.exit(f"bench_recovery.py: --kill-after {args.kill_after}: give 1 to --steps - 1 "
                 f"({args.steps - 1})")
    results = {kind: [] for kind in args.launchers}
    for run in range(args.runs):
        drawn = random.randint(2, args.steps - 3) if args.kill_after == 0 else args.kill_after
        for kind in args.launchers:
            directory = tempfile.mkdtemp(prefix=f"ductile-bench-recovery-{kind}-")
            try:
                r = race_one(kind, argparse.Namespace(**{**vars(args), "kill_after": drawn}),
                             directory)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            results[kind].append(r)
            print(f"run {run + 1} {kind} (killed after step {drawn}): " + ", ".join(
                f"{name} {value:.2f}" if isinstance(value, float) else f"{name} {value}"
                for name, value in zip(COLUMNS, r) if value is not None), flush=True)
    when = "a random step" if args.kill_after == 0 else f"step {args.kill_after}"
    who = "a random node" if args.victim == "random" else "the last node started"
    lost = f"SIG{args.signal}ed"
    print(f"\n{NODES} nodes x 1 worker on loopback, {who} {lost} after {when}; medians "
          f"(min-max) of {args.runs} run(s); {os.cpu_count()} CPU(s)")
    print("| launcher | " + " | ".join(COLUMNS) + " |")
    print("| --- |" + " ---: |" * len(COLUMNS))
    for kind, runs in results.items():
        cells = ["-" if runs[0][i] is None else spread([r[i] for r in runs],
                                                       ".2f" if i < 5 else ".1f")
                 for i in range(len(COLUMNS))]
        print(f"| {NAMES[kind]} | " + " | ".join(cells) + " |")
    if "ductile-in-place" in results and "ductile" in results:
        restart = statistics.median(r[4] for r in results["ductile"])
        ratios = [r[4] / restart for r in results["ductile-in-place"]]
        print(f"ductile-in-place / ductile (SIGKILL to first step): "
              f"{statistics.median(ratios):.3f} (worst run {max(ratios):.3f})")
    for kind in ("ductile-in-place", "ductile", "ductile-warm"):
        if kind in results and "torchrun" in results:
            rival = statistics.median(r[4] for r in results["torchrun"])
            ratios = [r[4] / rival for r in results[kind]]
            print(f"{kind} / torchrun (SIGKILL to first step): {statistics.median(ratios):.2f} "
                  f"(worst run {max(ratios):.2f}; goal: at most 0.2)")


if __name__ == "__main__":
    main()
