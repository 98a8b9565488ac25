"""Worker of the agent tests: ZeRO-3 training (ductile.torch.zero3, cpu
backend) that survives a change of world size. Started by
`ductile agent --mpi-world`, the workers of a round join one MPI world
(DUCTILE_MPI_JOIN) without mpirun. Each run resumes from the newest
checkpoint in OUT, whatever world size saved it, trains the tied LM of
tests/python on the round's global batch (DUCTILE_GLOBAL_BATCH windows a
step, split over the ranks), saves a checkpoint after every step and
appends a line a step to OUT/losses.jsonl (rank 0). Exits 0 after STEPS.

usage: zero3_resume.py OUT STEPS                  (a worker)
       zero3_resume.py OUT STEPS --on-request     (a worker that saves only when
                                                   the agent asks, then exits:
                                                   ductile.torch.elastic)
       zero3_resume.py OUT STEPS --memory         (a worker that saves nothing to
                                                   disk: it resumes from the snapshot
                                                   the agent restores from memory)
       zero3_resume.py OUT STEPS --plain BATCH    (one process, torch alone:
                                                   the reference, OUT/plain.json)
"""
import json
import os
import sys
import time

import torch

from zero3_model import Windows, loss_of, make_model

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)

LR = 3e-3
MODEL = {"d": 32, "heads": 2, "layers": 2, "context": 16}


def plain(out, steps, batch):
    model = make_model(seed=0, **MODEL)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    windows = Windows(batch=batch, context=MODEL["context"])
    losses = []
    for s in range(steps):
        x, y = windows.step(s)
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with open(os.path.join(out, "plain.json"), "w") as f:
        json.dump(losses, f)


def newest_checkpoint(out):
    try:
        with open(os.path.join(out, "LATEST")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def save(engine, out, step, world, env):
    name = f"step{step}-round{env['DUCTILE_ROUND']}"
    engine.save(os.path.join(out, name), client_state={"step": step, "world": world})
    if engine.rank == 0:
        with open(os.path.join(out, "LATEST.part"), "w") as f:
            f.write(name)
        os.replace(os.path.join(out, "LATEST.part"), os.path.join(out, "LATEST"))


def worker(out, steps, on_request, memory):
    import ductile
    import ductile.torch.zero3 as zero3
    from ductile.torch import elastic

    env = os.environ
    world = int(env["WORLD_SIZE"])
    batch = int(env["DUCTILE_GLOBAL_BATCH"])
    micro, accumulation = int(env["DUCTILE_MICRO_BATCH"]), int(env["DUCTILE_GRADIENT_ACCUMULATION_STEPS"])
    assert batch == micro * accumulation * world, "the agent's plan splits the global batch"
    config = ductile.load_config(
        {"accelerator": {"backend": "cpu", "communicator": "auto", "timeout": 120},
         "zero": {"coordinator": "partitioned", "prefetch_bucket_size": 5000,
                  "max_live_parameters": 20000, "param_persistence_threshold": 100}},
        format="toml")
    engine = zero3.initialize(make_model(seed=0, **MODEL),
                              lambda params: torch.optim.Adam(params, lr=LR), config)
    assert engine.world_size == world and engine.rank == int(env["RANK"]), "the joined MPI world"
    start, resumed = 0, None
    latest = None if memory else newest_checkpoint(out)
    if memory and engine.restored_from_memory is not None:
        # zero3.initialize restored the agent's DUCTILE_SNAPSHOT_RESTORE.
        start = engine.global_step
        resumed = {"step": start, "from": "memory"}
    if latest:
        client = engine.load(os.path.join(out, latest))
        start, resumed = client["step"], {"step": client["step"], "world": client["world"]}
    windows = Windows(batch=batch, context=MODEL["context"])
    for s in range(start, steps):
        # Each rank takes its share of the step's global batch at once (the
        # agent's micro x accumulation split gives the same gradient).
        x, y = windows.step(s, engine.rank, world)
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        mean = engine.all_reduce(loss.detach().clone(), "mean").item()
        if engine.rank == 0:
            # The loss before the optimizer step (which takes the snapshot
            # with --memory) and the save: a run stopped in between resumes
            # at this step again rather than past an unlogged one.
            with open(os.path.join(out, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"round": int(env["DUCTILE_ROUND"]), "world": world,
                                    "step": s, "loss": mean, "resumed": resumed}) + "\n")
            print(f"zero3 round={env['DUCTILE_ROUND']} world={world} step={s} loss={mean:.6f}",
                  flush=True)
        engine.step()  # with --memory, it also takes the snapshot of the step
        if memory:
            pass
        elif not on_request:
            save(engine, out, s + 1, world, env)
        elif elastic.should_checkpoint(engine):
            # Every rank sees the same answer: the save is collective.
            save(engine, out, s + 1, world, env)
            elastic.checkpoint_saved()
            print(f"zero3 saved round={env['DUCTILE_ROUND']} rank={engine.rank} at step {s + 1} "
                  f"({elastic.checkpoint_reason()})", flush=True)
            return
        # Slow enough for the test to stop an agent in the middle of the run.
        time.sleep(float(env.get("ZERO3_STEP_PAUSE", "0")))
    print(f"zero3 done round={env['DUCTILE_ROUND']} rank={engine.rank} world={world}", flush=True)


if __name__ == "__main__":
    out, steps = sys.argv[1], int(sys.argv[2])
    if "--plain" in sys.argv[3:]:
        plain(out, steps, int(sys.argv[sys.argv.index("--plain") + 1]))
    else:
        worker(out, steps, "--on-request" in sys.argv[3:], "--memory" in sys.argv[3:])
