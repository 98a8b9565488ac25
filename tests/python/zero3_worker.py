"""One rank of a zero3 test run (not a test by itself; test_zero3.py starts
it, under mpirun for more than one rank).

  zero3_worker.py SPEC.json

SPEC keys: mode ("plain": torch alone, one process; "zero3"), out (folder),
steps, start (first step, after `load`), load (checkpoint folder or null),
save_at (steps after which to save to out/step<k>), zero_config (TOML path),
model (TiedLM keyword arguments), external (declare the root's use of
blocks[-1].up.weight), frozen (parameter names that get no gradient),
eval_after (after this many steps: one no_grad pass, then two more steps),
lr. Rank 0 writes out/result.json (per-step losses, coordinator counters,
the modules released while backward ran) and out/params.pt (the final
parameters, whole).
"""

import json
import os
import sys

import torch
import torch.nn as nn

from zero3_model import Windows, loss_of, make_model

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)


class ExternalUse(nn.Module):
    """TiedLM whose root forward also reads blocks[-1].up.weight (a
    parameter of another module)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        logits = self.lm(tokens)
        w = self.lm.blocks[-1].up.weight  # (4 d, d) = (vocab, d) in the tests' sizes
        return logits + 0.01 * (logits[..., :w.shape[1]] @ w.t())


def build(spec):
    model = make_model(seed=0, **spec.get("model", {}))
    if spec.get("external"):
        model = ExternalUse(model)
    for name, p in model.named_parameters():
        if name in spec.get("frozen", []):
            p.requires_grad_(False)
    return model


def run_plain(spec):
    model = build(spec)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                 lr=spec.get("lr", 3e-3))
    windows = Windows()
    losses = {}
    for s in range(spec.get("start", 0), spec["steps"]):
        x, y = windows.step(s)
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[s] = loss.item()
    os.makedirs(spec["out"], exist_ok=True)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
               os.path.join(spec["out"], "params.pt"))
    with open(os.path.join(spec["out"], "result.json"), "w") as f:
        json.dump({"losses": losses}, f)


def run_zero3(spec):
    import ductile.torch.zero3 as zero3

    model = build(spec)
    if spec.get("external"):
        zero3.register_external_parameter(model, model.lm.blocks[-1].up.weight)
    engine = zero3.initialize(model, lambda params: torch.optim.Adam(params, lr=spec.get("lr", 3e-3)),
                              spec["zero_config"])
    rank, world = engine.rank, engine.world_size
    stats = engine.stats()
    memory = {
        "shard_bytes": stats["shard_bytes"], "parameter_bytes": stats["parameter_bytes"],
        "placeholder_numel": sum(p.data.numel() for p in model.parameters()),
        "shard_numel": sum(p.numel() for p in engine.shard_parameters()),
    }
    bound = {"worst": 0, "checks": 0}
    released_in_backward = set()

    def check_live(event, module, s):
        bound["checks"] += 1
        over = s["live_numel"] - (s["max_live_numel"] + s["largest_module_numel"])
        bound["worst"] = max(bound["worst"], over)
        if event == "release" and engine._backward_active:
            released_in_backward.add(module)

    engine.module_callback = check_live
    client = engine.load(spec["load"]) if spec.get("load") else None
    windows = Windows()
    losses, per_step = {}, []
    before = engine.stats()

    def train_step(s):
        x, y = windows.step(s, rank, world)
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        return engine.all_reduce(loss.detach().clone(), "mean").item()

    for s in range(spec.get("start", 0), spec["steps"]):
        losses[s] = train_step(s)
        after = engine.stats()
        per_step.append({k: after[k] - before[k] for k in (
            "gathers", "demand_gathered_params", "prefetched_params", "trace_invalidations",
            "trace_warnings", "reduce_scatters")})
        per_step[-1]["trace_mode"] = after["trace_mode"]
        before = after
        if s + 1 in spec.get("save_at", []):
            engine.save(os.path.join(spec["out"], f"step{s + 1}"), client_state={"step": s + 1})
        engine.check_invariants()

    full = engine.full_parameters()
    evaluation = None
    if spec.get("eval_after") is not None:
        x, y = windows.step(10_000, rank, world)
        start = engine.stats()
        with torch.no_grad():
            eval_loss = loss_of(engine(x), y)
        after_eval = engine.stats()
        extra = [train_step(10_001 + i) for i in range(3)]
        end = engine.stats()
        evaluation = {
            "loss": eval_loss.item(), "finite": all(map(lambda v: v == v, extra)),
            "invalidations": end["trace_invalidations"] - start["trace_invalidations"],
            "warnings": end["trace_warnings"] - start["trace_warnings"],
            "mode_after_eval": after_eval["trace_mode"], "mode_at_end": end["trace_mode"],
            "live_after_eval": after_eval["live_numel"],
        }

    final = engine.stats()
    if rank == 0:
        os.makedirs(spec["out"], exist_ok=True)
        torch.save(full, os.path.join(spec["out"], "params.pt"))
        with open(os.path.join(spec["out"], "result.json"), "w") as f:
            json.dump({"losses": losses, "per_step": per_step, "memory": memory,
                       "bound": bound, "world": world, "client_state": client,
                       "evaluation": evaluation, "trace": engine.trace(),
                       "released_in_backward": sorted(released_in_backward),
                       "stats": {k: v for k, v in final.items()}}, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    (run_plain if spec["mode"] == "plain" else run_zero3)(spec)
