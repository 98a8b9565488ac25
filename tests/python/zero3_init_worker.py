"""One rank of test_zero3_init.py (not a test by itself): partitioned
construction.

  zero3_init_worker.py SPEC.json

Modes (SPEC "mode"):
- equal: for each model of SPEC "families" (zero3_model's tied LM and the
  Hugging Face ones of zero3_hf.py), build it under zero3.init() (each
  parameter initialised straight into this rank's shard) and write its
  whole parameters (rank 0: out/init-<family>.pt); then, for the Hugging
  Face ones, build it on the meta device and fill the shards from the
  safetensors folder SPEC "pretrained"/<family> (out/load-<family>.pt);
- cap: build the tied LM of SPEC "model" under zero3.init() and train it
  SPEC "steps" SGD steps with step_in_backward; every rank writes
  out/result-rank<r>.json with its peak resident memory above the one it
  had right before building the model;
- plain_cap: one process, no ductile: limit the address space to the
  current one plus SPEC "cap_bytes" (RLIMIT_AS), then build the same model
  with plain torch; writes out/result.json with what happened.
"""

import json
import os
import resource
import sys

import torch

from zero3_model import Windows, loss_of, make_model

torch.set_num_threads(1)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(family, seed=0):
    if family == "tiedlm":
        return make_model(seed=seed, layers=2, d=32, context=16)
    from zero3_hf import build as build_hf
    return build_hf(family, seed)


def equal(spec):
    import ductile.torch.zero3 as zero3
    from ductile.torch.zero3._param import shard_of
    from zero3_hf import config_of, model_class
    for family in spec["families"]:
        with zero3.init():
            model = build(family)
        # Each parameter holds nothing outside a gather, and keeps its slice.
        assert all(p.numel() == 0 and shard_of(p) is not None for p in model.parameters()), \
            "zero3.init left a whole parameter"
        engine = zero3.initialize(model, None, spec["zero_config"])
        full = engine.full_parameters()
        if engine.rank == 0:
            torch.save(full, os.path.join(spec["out"], f"init-{family}.pt"))
        if family == "tiedlm":
            continue
        with torch.device("meta"):
            model = model_class(family)(config_of(family))
        engine = zero3.initialize(model, None, spec["zero_config"],
                                  load_from=os.path.join(spec["pretrained"], family))
        full = engine.full_parameters()
        if engine.rank == 0:
            torch.save(full, os.path.join(spec["out"], f"load-{family}.pt"))
    if engine.rank == 0:
        with open(os.path.join(spec["out"], "result.json"), "w") as f:
            json.dump({"world": engine.world_size}, f)


def cap(spec):
    import ductile.torch.zero3 as zero3
    from zero3_worker import init_distributed
    init_distributed()
    baseline = rss_bytes()
    with zero3.init():
        model = make_model(seed=0, **spec["model"])
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    engine = zero3.initialize(model, lambda ps: torch.optim.SGD(ps, lr=spec["lr"]), spec["zero_config"],
                              step_in_backward=True)
    windows = Windows(batch=2, context=spec["model"]["context"])
    losses = []
    for s in range(spec["steps"]):
        x, y = windows.step(s, engine.rank, engine.world_size)
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(engine.all_reduce(loss.detach().clone(), "mean").item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    stats = engine.stats()
    with open(os.path.join(spec["out"], f"result-rank{engine.rank}.json"), "w") as f:
        json.dump({"peak": peak, "built": built, "losses": losses,
                   "parameter_bytes": stats["parameter_bytes"],
                   "shard_bytes": stats["shard_bytes"],
                   "gather_high_water_bytes": stats.get("gather_high_water_bytes")}, f)


def plain_cap(spec):
    size = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = size + spec["cap_bytes"]
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    outcome = {"built": False}
    try:
        model = make_model(seed=0, **spec["model"])
        outcome["built"] = True
        outcome["numel"] = sum(p.numel() for p in model.parameters())
    except (RuntimeError, MemoryError) as e:
        outcome["error"] = f"{type(e).__name__}: {e}"[:300]
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    with open(os.path.join(spec["out"], "result.json"), "w") as f:
        json.dump(outcome, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if spec["mode"] == "equal":
        from zero3_worker import init_distributed
        init_distributed()
    {"equal": equal, "cap": cap, "plain_cap": plain_cap}[spec["mode"]](spec)
