"""One rank of a zero3 offload test run (not a test by itself;
test_zero3_offload.py starts it under torchrun).

  zero3_offload_worker.py SPEC.json [SPEC.json ...]

(several specs: one run after another, in the same process group.)
SPEC keys: out (folder), zero_config (TOML path, or a DeepSpeed JSON path
when it ends in .json), steps, start (first step, after `load`), load
(checkpoint folder), save_at (steps after which to save to out/step<k>),
offload (zero3.initialize's offload_optimizer), budget (max_device_memory),
precision (mixed_precision: "bf16", "fp16"), accumulate (micro-batches a
step; all but the last under no_sync() when no_sync is true), clip
(clip_grad_norm_'s max_norm, every step), step_in_backward, optimizer
("adam" or "adamw"), device ("cuda": the model and batches on the GPU,
torch.distributed over NCCL), sync_debug (cuda: every step after the first
under torch.cuda.set_sync_debug_mode("error"): a host wait for the GPU
raises). Every run but those with step_in_backward has a LambdaLR
schedule (the learning rate changes every step). Rank 0 writes
out/result.json: per-step losses, norms, the engine's device high-water
bytes, the stats at the end; and
out/params.pt (the final parameters, whole).
"""

import atexit
import json
import os
import sys

import torch
import torch.distributed as dist

from zero3_model import Windows, loss_of, make_model

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)

LR = 3e-3


def main(spec):
    import ductile.torch.zero3 as zero3
    device = spec.get("device", "cpu")
    if not dist.is_initialized():  # the first run of the job
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        atexit.register(dist.destroy_process_group)
    kind = torch.optim.AdamW if spec.get("optimizer") == "adamw" else torch.optim.Adam
    kwargs = {"weight_decay": 0.01} if kind is torch.optim.AdamW else {}
    engine = zero3.initialize(
        make_model(seed=0).to(device), lambda ps: kind(ps, lr=LR, **kwargs), spec["zero_config"],
        mixed_precision=spec.get("precision"), step_in_backward=spec.get("step_in_backward", False),
        offload_optimizer=spec.get("offload"), max_device_memory=spec.get("budget"))
    # step_in_backward's per-parameter optimizers are not one torch optimizer:
    # no schedule there.
    schedule = None if spec.get("step_in_backward") else torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    rank, world = engine.rank, engine.world_size
    client = engine.load(spec["load"]) if spec.get("load") else None
    start = spec.get("start", 0)
    for _ in range(start):
        schedule.step()  # the resumed runs have one
    accumulate = spec.get("accumulate", 1)
    windows = Windows(batch=6 * accumulate)
    out = {"losses": {}, "norms": {}, "high_water": {}, "lr": {}, "client_state": client}
    losses = {}
    # On the device before the steps: a copy from pageable host memory
    # synchronises, and sync_debug would count it against the engine.
    batches = {s: tuple(t.to(device) for t in windows.step(s, rank, world))
               for s in range(start, spec["steps"])}
    for s in range(start, spec["steps"]):
        if spec.get("sync_debug") and s == start + 1:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        x, y = batches[s]
        per = x.shape[0] // accumulate
        total = 0.0
        for k in range(accumulate):
            last = k == accumulate - 1
            sync = last or not spec.get("no_sync")
            xs, ys = x[k * per:(k + 1) * per], y[k * per:(k + 1) * per]
            if sync:
                loss = loss_of(engine(xs), ys) / accumulate
                engine.backward(loss)
            else:
                with engine.no_sync():
                    loss = loss_of(engine(xs), ys) / accumulate
                    engine.backward(loss)
            total += loss.detach()
        if spec.get("clip"):
            out["norms"][s] = float(engine.clip_grad_norm_(spec["clip"]))
        out["lr"][s] = engine.optimizer.param_groups[0]["lr"]
        engine.step()
        if schedule is not None:
            schedule.step()
        losses[s] = engine.all_reduce(total.reshape(1).clone(), "mean")
        out["high_water"][s] = engine.stats()["device_high_water_bytes"]
        if s + 1 in spec.get("save_at", []):
            engine.save(os.path.join(spec["out"], f"step{s + 1}"), client_state={"step": s + 1})
    if spec.get("sync_debug"):
        torch.cuda.set_sync_debug_mode(0)
    out["losses"] = {s: loss.item() for s, loss in losses.items()}
    full = engine.full_parameters()
    stats = engine.stats()
    engine.close()
    if rank == 0:
        out["stats"] = {k: v for k, v in stats.items() if k != "trace"}
        out["world"] = world
        torch.save(full, os.path.join(spec["out"], "params.pt"))
        with open(os.path.join(spec["out"], "result.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            spec = json.load(f)
        if spec.get("device") == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        main(spec)
