"""A rank of the 2-rank in-memory snapshot tests (not a test by itself),
under torchrun. Each rank plays a node of its own: LOCAL_RANK 0 and its own
DUCTILE_SNAPSHOT_DIR (out/node<rank>), as ``ductile agent`` would set them
on two nodes. It trains 3 steps (a snapshot after each), copies its node's
folder to out/after3/node<rank> and its shards to out/state-rank<rank>.pt;
rank 0 then merges both nodes' step-3 files into out/merged, which a second
engine loads at world size 2 and compares with the trained one's shards
(out/result-rank<rank>.json). Last, step 4's snapshot: rank 1 exits in the
middle of writing its shard file, which ends the job.

With "one_node" in the spec, both ranks share out/node as on one node
(torchrun's LOCAL_RANK: rank 0 leads), train 3 steps, save their shards
to out/state-rank<rank>.pt (rank 0 copies out/node to out/node-after3)
and a disk checkpoint into out/ckpt from step
3's snapshot in the background, then train step 4; last, a background
save from a snapshot damaged on rank 1 (out/failed-rank<rank>.json: the
error each rank raised)."""

import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

import ductile
import ductile.torch.zero3 as zero3
from ductile.torch.zero3 import _checkpoint_files

spec = json.load(open(sys.argv[1]))
out = spec["out"]
rank = int(os.environ["RANK"])
if spec.get("one_node"):
    # Both ranks on one node (torchrun's LOCAL_RANK): one folder, rank 0 leads.
    node = os.path.join(out, "node")
else:
    os.environ["LOCAL_RANK"] = "0"  # every rank leads its own "node"
    node = os.path.join(out, f"node{rank}")
os.environ["DUCTILE_SNAPSHOT_DIR"] = node

from zero3_model import Windows, loss_of, make_model  # noqa: E402

dist.init_process_group("gloo")
config = open(spec["zero_config"]).read()


def adam(shards):
    return torch.optim.Adam(shards, lr=1e-2)


engine = zero3.initialize(make_model(seed=0), adam, config)
windows = Windows(batch=2)


def train(steps):
    for _ in range(steps):
        x, y = windows.step(engine.global_step)
        engine.backward(loss_of(engine(x), y))
        engine.step()


def shards_of(e):
    state = {}
    for info in e._params:
        state[info.name] = info.shard.clone()
        for key, value in e.optimizer.state[info.shard].items():
            state[f"{info.name}.{key}"] = value.clone()
    return state


if spec.get("one_node"):
    train(3)
    torch.save(shards_of(engine), os.path.join(out, f"state-rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        shutil.copytree(node, os.path.join(out, "node-after3"))
    # A disk checkpoint from step 3's snapshot, committed while step 4 trains.
    engine.save(os.path.join(out, "ckpt"), client_state={"at": 3}, background=True)
    train(1)
    # Rank 1's step-4 snapshot damaged: its copy fails, rank 0's thread stops
    # waiting for it, and both ranks raise when they wait for the save.
    if rank == 1:
        damaged = os.path.join(node, "step4", "rank1-of-2.bin")
        os.truncate(damaged, os.path.getsize(damaged) - 4)
    dist.barrier()
    engine.save(os.path.join(out, "ckpt-failed"), background=True)
    try:
        engine.wait_for_save()
        failure = None
    except ductile.Error as e:
        failure = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"failed-rank{rank}.json"), "w") as f:
        json.dump(failure, f)
    dist.destroy_process_group()
    sys.exit(0)

train(3)
shutil.copytree(node, os.path.join(out, "after3", f"node{rank}"))
trained = shards_of(engine)
torch.save(trained, os.path.join(out, f"state-rank{rank}.pt"))
dist.barrier()
merged = os.path.join(out, "merged")
if rank == 0:
    # What an agent assembles for a restore: the manifest and every rank's file.
    os.makedirs(merged)
    for r in range(2):
        folder = os.path.join(out, f"node{r}", "step3")
        for name in os.listdir(folder):
            if name.startswith("manifest") or name == f"rank{r}-of-2.bin":
                shutil.copy(os.path.join(folder, name), merged)
dist.barrier()
os.environ.pop("DUCTILE_SNAPSHOT_DIR")
other = zero3.initialize(make_model(seed=1), adam, config)
other.load(merged)
loaded = shards_of(other)
equal = trained.keys() == loaded.keys() and all(torch.equal(trained[k], loaded[k])
                                                for k in trained)
with open(os.path.join(out, f"result-rank{rank}.json"), "w") as f:
    json.dump({"equal": equal, "global_step": other.global_step}, f)
other.close()
os.environ["DUCTILE_SNAPSHOT_DIR"] = node
dist.barrier()


def die_in_shard(operation, path):
    if rank == 1 and operation == "write" and path.endswith(os.path.join("step4.tmp",
                                                                         "rank1-of-2.bin")):
        os._exit(9)


_checkpoint_files._fault_hook = die_in_shard
train(1)
sys.exit(3)  # not reached on either rank: rank 1 exits, torchrun stops rank 0
