"""Worker of the agent tests: the documented zero3 loop (``loss = engine(x, y);
engine.backward(loss); engine.step()``) over torch.distributed's gloo group,
with a snapshot every step, so that ``ductile agent`` can make it go on in
place when a node is lost (round notices, engine.rejoin). Each node trains on
its own batches (chosen by its node id and the step, the same at any world
size), so that a run's losses do not depend on how ranks were numbered.

After every step it appends {round, world, rank, step, loss, pid} to
OUT/losses-<node id>.jsonl and prints one line. Exits 0 once
engine.global_step reaches STEPS.

usage: zero3_in_place.py OUT STEPS                        (a worker)
       zero3_in_place.py OUT STEPS --plain NODES CHANGE REST
           (one process, torch alone: the nodes NODES (ids, comma-separated)
            train steps 1..CHANGE, the nodes REST the steps after; each
            step's mean loss over its nodes into OUT/plain.json)
"""
import faulthandler
import json
import os
import signal
import sys
import time

import torch

from zero3_launch import CONFIG
from zero3_model import Windows, WithLoss

faulthandler.register(signal.SIGUSR1)  # a hung rank's stacks, for its diagnosis
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)

LR = 1e-2


def batch_of(windows, node, step):
    return windows.step(1000 * (1 + sum(ord(c) for c in node)) + step)


def plain(out, steps, nodes, change, rest):
    model = WithLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    windows = Windows(batch=2)
    losses = {}
    for step in range(1, steps + 1):
        members = nodes if step <= change else rest
        total = 0.0
        optimizer.zero_grad()
        for node in members:
            loss = model(*batch_of(windows, node, step)) / len(members)
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses[step] = total
    with open(os.path.join(out, "plain.json"), "w") as f:
        json.dump(losses, f)


def worker(out, steps):
    import torch.distributed as dist

    import ductile.torch.zero3 as zero3

    node = os.environ["DUCTILE_AGENT_NODE_ID"]
    pause = float(os.environ.get("ZERO3_STEP_PAUSE", "0"))
    dist.init_process_group("gloo")
    engine = zero3.initialize(WithLoss(), lambda shards: torch.optim.Adam(shards, lr=LR),
                              CONFIG + "snapshot_interval = 1\nsnapshot_replicas = 1\n")
    windows = Windows(batch=2)
    with open(os.path.join(out, f"losses-{node}.jsonl"), "a") as log:
        while engine.global_step < steps:
            step = engine.global_step + 1
            loss = engine(*batch_of(windows, node, step))
            engine.backward(loss)
            engine.step()
            entry = {"round": int(os.environ["DUCTILE_ROUND"]), "world": engine.world_size,
                     "rank": engine.rank, "step": engine.global_step, "loss": loss.item(),
                     "pid": os.getpid()}
            log.write(json.dumps(entry) + "\n")
            log.flush()
            print(f"in_place round={entry['round']} world={entry['world']} node={node} "
                  f"step={entry['step']}", flush=True)
            time.sleep(pause)
    print(f"in_place done node={node} pid={os.getpid()}", flush=True)


if __name__ == "__main__":
    out, steps = sys.argv[1], int(sys.argv[2])
    if "--plain" in sys.argv[3:]:
        at = sys.argv.index("--plain")
        plain(out, steps, sys.argv[at + 1].split(","), int(sys.argv[at + 2]),
              sys.argv[at + 3].split(","))
    else:
        worker(out, steps)
