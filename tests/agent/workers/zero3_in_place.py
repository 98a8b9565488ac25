"""Worker of the agent tests: the documented zero3 loop (``loss = engine(x, y);
engine.backward(loss); engine.step()``) over torch.distributed's gloo group,
with a snapshot every step, so that ``ductile agent`` can make it go on in
place when a node is lost (round notices, engine.rejoin). Each node trains on
its own batches (chosen by its node id and the step, the same at any world
size), so that a run's losses do not depend on how ranks were numbered.

With ``--deepspeed ACC`` the same through ``ductile.deepspeed.initialize``
(a DeepSpeed JSON config, ACC gradient accumulation steps: the loop of a
DeepSpeed script, ``engine.backward`` dividing each micro-batch's loss).

After every step it appends {round, world, rank, step, loss, pid} to
OUT/losses-<node id>.jsonl (the loss: the mean of the step's micro-batches')
and prints one line. Exits 0 once the engine's step reaches STEPS. With
ZERO3_WAIT=K:FILE in its environment it waits after step K until FILE
exists (a test starts another node meanwhile).

usage: zero3_in_place.py OUT STEPS [--deepspeed ACC]          (a worker)
       zero3_in_place.py OUT STEPS [--deepspeed ACC] --plain NODES CHANGE REST
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


def batch_of(windows, node, step, micro=0, accumulation=1):
    return windows.step(1000 * (1 + sum(ord(c) for c in node)) + step * accumulation + micro)


def plain(out, steps, nodes, change, rest, accumulation):
    model = WithLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    windows = Windows(batch=2)
    losses = {}
    for step in range(1, steps + 1):
        members = nodes if step <= change else rest
        total = 0.0
        optimizer.zero_grad()
        for node in members:
            for micro in range(accumulation):
                loss = model(*batch_of(windows, node, step, micro, accumulation)) / (
                    len(members) * accumulation)
                loss.backward()
                total += loss.item()
        optimizer.step()
        losses[step] = total
    with open(os.path.join(out, "plain.json"), "w") as f:
        json.dump(losses, f)


def log_step(log, node, world, rank, step, loss):
    entry = {"round": int(os.environ["DUCTILE_ROUND"]), "world": world, "rank": rank,
             "step": step, "loss": loss, "pid": os.getpid()}
    log.write(json.dumps(entry) + "\n")
    log.flush()
    print(f"in_place round={entry['round']} world={entry['world']} node={node} "
          f"step={entry['step']}", flush=True)


def hold_after(step):
    """ZERO3_WAIT=K:FILE: after step K, wait until FILE exists."""
    wait = os.environ.get("ZERO3_WAIT")
    if wait:
        at, path = wait.split(":", 1)
        while step == int(at) and not os.path.exists(path):
            time.sleep(0.05)


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
            log_step(log, node, engine.world_size, engine.rank, engine.global_step, loss.item())
            hold_after(engine.global_step)
            time.sleep(pause)
    print(f"in_place done node={node} pid={os.getpid()}", flush=True)


def deepspeed_worker(out, steps, accumulation):
    """A DeepSpeed script's loop, with ductile.deepspeed in place of deepspeed."""
    import ductile.deepspeed as deepspeed

    node = os.environ["DUCTILE_AGENT_NODE_ID"]
    pause = float(os.environ.get("ZERO3_STEP_PAUSE", "0"))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "Adam", "params": {"lr": LR}},
              "zero_optimization": {"stage": 3}, "snapshot": {"interval": 1, "replicas": 1}}
    model = WithLoss()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    windows = Windows(batch=2)
    with open(os.path.join(out, f"losses-{node}.jsonl"), "a") as log:
        while engine.global_steps < steps:
            total = 0.0
            for micro in range(accumulation):
                step = engine.global_steps + 1
                loss = engine(*batch_of(windows, node, step, micro, accumulation))
                engine.backward(loss)
                engine.step()
                total += loss.item() / accumulation
            log_step(log, node, engine.world_size, engine.global_rank, engine.global_steps, total)
            hold_after(engine.global_steps)
            time.sleep(pause)
    print(f"in_place done node={node} pid={os.getpid()}", flush=True)


if __name__ == "__main__":
    out, steps = sys.argv[1], int(sys.argv[2])
    options = sys.argv[3:]
    accumulation = None
    if options[:1] == ["--deepspeed"]:
        accumulation, options = int(options[1]), options[2:]
    if options[:1] == ["--plain"]:
        plain(out, steps, options[1].split(","), int(options[2]), options[3].split(","),
              accumulation or 1)
    elif accumulation is not None:
        deepspeed_worker(out, steps, accumulation)
    else:
        worker(out, steps)
