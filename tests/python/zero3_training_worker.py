"""One rank of test_zero3_training.py (not a test by itself): the
training-loop semantics and mixed precision of a zero3 engine on 2 ranks.

  zero3_training_worker.py SPEC.json

Scenarios (SPEC "scenarios", each on a fresh engine over zero3_model's tied
LM; the global batch of every step split over the ranks):
- accumulate / accumulate_no_sync: ACCUMULATION micro-batches a step, loss
  divided by their number; every micro-batch reduce-scattered into the
  shards, or full gradients kept locally (engine.no_sync()) until the last;
- clip: engine.clip_grad_norm_(CLIP) before every step, the returned norm;
- gathered: GatheredParameters(ln_f.weight, modifier_rank=0) after step 2:
  rank 0 fills it with 0.5, every rank reads it back whole;
- state_dict: engine.state_dict() after the steps;
- fp16: DeepSpeed JSON with fp16 (initial scale 2^15, which overflows a
  loss near 5.5 in fp16; hysteresis 1, window 2), the loss scale after
  every step;
- bf16_json: DeepSpeed JSON with bf16 enabled.
Rank 0 writes out/result.json and out/<scenario>.pt (final parameters, the
state dict for state_dict).
"""

import json
import os
import sys
import time

import torch

from zero3_model import Windows, loss_of, make_model
from zero3_worker import init_distributed

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)

MODEL = dict(d=32, heads=4, layers=2, context=16)
STEPS = 5
ACCUMULATION = 2
CLIP = 0.05
LR = 3e-3


def deepspeed_config(precision):
    return {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 20000,
                                  "stage3_max_live_parameters": 40000,
                                  "stage3_param_persistence_threshold": 300},
            precision: {"enabled": True, "initial_scale_power": 15, "hysteresis": 1,
                        "loss_scale_window": 2}}


def run(name, spec):
    import ductile.torch.zero3 as zero3

    config = spec["zero_config"]
    if name == "fp16":
        config = json.dumps(deepspeed_config("fp16"))
    elif name == "bf16_json":
        config = json.dumps(deepspeed_config("bf16"))
    model = make_model(seed=0, **MODEL)
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=LR), config)
    rank, world = engine.rank, engine.world_size
    windows = Windows(batch=4 * ACCUMULATION if name.startswith("accumulate") else 4,
                      context=MODEL["context"])
    out = {"losses": [], "norms": [], "scales": [], "seconds": []}
    before = engine.stats()
    for s in range(STEPS):
        start = time.perf_counter()
        if name.startswith("accumulate"):
            x, y = windows.step(s, rank, world)
            per = x.shape[0] // ACCUMULATION
            total = 0.0
            for m in range(ACCUMULATION):
                xm, ym = x[m * per:(m + 1) * per], y[m * per:(m + 1) * per]
                last = m == ACCUMULATION - 1
                if name == "accumulate_no_sync" and not last:
                    with engine.no_sync():
                        loss = loss_of(engine(xm), ym) / ACCUMULATION
                        engine.backward(loss)
                else:
                    loss = loss_of(engine(xm), ym) / ACCUMULATION
                    engine.backward(loss)
                total += loss.item()
            loss = torch.tensor(total)
        else:
            x, y = windows.step(s, rank, world)
            loss = loss_of(engine(x), y)
            engine.backward(loss)
        if name == "clip":
            out["norms"].append(engine.clip_grad_norm_(CLIP).item())
        engine.step()
        out["seconds"].append(time.perf_counter() - start)
        out["scales"].append(engine.loss_scale)
        out["losses"].append(engine.all_reduce(loss.detach().float().clone(), "mean").item())
        if name == "gathered" and s == 1:
            weight = model.ln_f.weight
            with zero3.GatheredParameters([weight], modifier_rank=0):
                assert weight.shape == (MODEL["d"],), weight.shape
                if rank == 0:
                    weight.data.fill_(0.5)
            with zero3.GatheredParameters(weight):  # read back: the same on every rank
                out["gathered"] = weight.tolist()
    after = engine.stats()
    out["reduce_scatters"] = after["reduce_scatters"] - before["reduce_scatters"]
    out["reduced_params"] = after["reduced_params"] - before["reduced_params"]
    out["groups"] = after["groups"]
    out["accumulated_grads"] = after["accumulated_grads"] - before["accumulated_grads"]
    out["shard_bytes"], out["master_bytes"] = after["shard_bytes"], after["master_bytes"]
    out["skipped"] = getattr(engine._scaler, "skipped_steps", 0)
    out["optimizer_dtypes"] = sorted({str(t.dtype) for st in engine.optimizer.state.values()
                                      for t in st.values() if t.dim() > 0})
    saved = engine.state_dict() if name == "state_dict" else engine.full_parameters()
    if rank == 0:
        torch.save(saved, os.path.join(spec["out"], f"{name}.pt"))
    return out


def main(spec):
    init_distributed()
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else int(
        os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    result = {name: run(name, spec) for name in spec["scenarios"]}
    if rank == 0:
        with open(os.path.join(spec["out"], "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
