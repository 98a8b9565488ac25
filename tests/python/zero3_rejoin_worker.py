"""A rank of the in-place recovery tests and benchmark (not a test by
itself), started by the test as ``ductile agent`` would start it: RANK,
WORLD_SIZE, MASTER_ADDR/MASTER_PORT of a TCPStore the test serves
(TORCHELASTIC_USE_AGENT_STORE), its own node (LOCAL_RANK 0, its own
DUCTILE_SNAPSHOT_DIR), DUCTILE_ROUND and, for the in-place runs,
DUCTILE_ROUND_NOTICE.

The script is the documented loop, unchanged by recovery: ``loss =
engine(x, y); engine.backward(loss); engine.step()`` until
``engine.global_step`` reaches the spec's "steps", each rank's batch chosen
by its rank and the step (the same at any world size). After every step it
appends {step, loss, world_size, rank, pid, time} to out/losses-rank<r>.jsonl.
With "pause": {"rank": r, "step": k, "where": "boundary" | "backward" |
"step"}, rank r stops after step k ("boundary"), or after step k + 1's
forward ("backward") or backward ("step"), writes out/paused-rank<r> and
sleeps until the test kills it."""

import faulthandler
import json
import signal
import os
import sys
import time

import torch
import torch.distributed as dist

import ductile.torch.zero3 as zero3
from zero3_model import Windows, WithLoss

faulthandler.register(signal.SIGUSR1)  # a hung rank's stacks, for its diagnosis
spec = json.load(open(sys.argv[1]))
out = spec["out"]
rank = int(os.environ["RANK"])
pause = spec.get("pause") or {}


def paused():
    with open(os.path.join(out, f"paused-rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1)


dist.init_process_group("gloo")
engine = zero3.initialize(WithLoss(), lambda shards: torch.optim.Adam(shards, lr=1e-2),
                          open(spec["zero_config"]).read())
windows = Windows(batch=2)
log = open(os.path.join(out, f"losses-rank{rank}.jsonl"), "a")
while engine.global_step < spec["steps"]:
    step = engine.global_step + 1
    x, y = windows.step(1000 * engine.rank + step)
    loss = engine(x, y)
    if pause.get("rank") == rank and pause.get("where") == "backward" and \
            step == pause["step"] + 1:
        paused()
    engine.backward(loss)
    if pause.get("rank") == rank and pause.get("where") == "step" and \
            step == pause["step"] + 1:
        paused()
    engine.step()
    log.write(json.dumps({"step": engine.global_step, "loss": loss.item(),
                          "world_size": engine.world_size, "rank": engine.rank,
                          "pid": os.getpid(), "time": time.time(),
                          "recoveries": engine._recovery.recoveries
                          if engine._recovery is not None else None}) + "\n")
    log.flush()
    if pause.get("rank") == rank and pause.get("where") == "boundary" and \
            engine.global_step == pause["step"]:
        paused()
log.close()
