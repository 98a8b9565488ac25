"""One rank of the zero3 Hugging Face test (not a test by itself;
test_zero3_hf.py starts it on 2 ranks under torchrun or mpirun).

  zero3_hf_worker.py SPEC.json

SPEC: out, zero_config, steps, save_at. For each family of zero3_hf.py:
- fp32: train `steps` Adam steps on this rank's half of each global batch,
  saving a checkpoint after `save_at` steps into out/<family>/ckpt, then
  write the consolidated safetensors to out/<family>/hf and the logits of
  the probe batch;
- bf16: the same training with MixedPrecision("bf16");
- checkpointing: fp32 again, with Hugging Face's gradient checkpointing
  (non-reentrant torch.utils.checkpoint in every layer).
Rank 0 writes out/result.json: per family, the per-step mean losses of both
runs, the probe logits, and the engine's counters.
"""

import json
import os
import sys

import torch

from zero3_hf import FAMILIES, LR, batch, build, loss_of, probe
from zero3_worker import init_distributed

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)


def train(family, spec, precision, checkpointing=False):
    import ductile.torch.zero3 as zero3

    model = build(family)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=LR),
                              spec["zero_config"], mixed_precision=precision)
    losses = []
    for s in range(spec["steps"]):
        loss = loss_of(engine, batch(s, engine.rank, engine.world_size))
        engine.backward(loss)
        engine.step()
        losses.append(engine.all_reduce(loss.detach().float().clone(), "mean").item())
        if precision is None and not checkpointing and s + 1 == spec["save_at"]:
            engine.save(os.path.join(spec["out"], family, "ckpt"), client_state={"step": s + 1})
    return engine, losses


def main(spec):
    init_distributed()
    result = {}
    rank = None
    for family in FAMILIES:
        engine, losses = train(family, spec, None)
        rank = engine.rank
        engine.save_consolidated(os.path.join(spec["out"], family, "hf"))
        with torch.no_grad():
            logits = engine(input_ids=probe()).logits
        stats = engine.stats()
        _, bf16 = train(family, spec, "bf16")
        _, recomputed = train(family, spec, None, checkpointing=True)
        result[family] = {"fp32": losses, "bf16": bf16, "logits": logits.tolist(),
                          "checkpointing": recomputed,
                          "world": engine.world_size, "kind": stats["world"],
                          "reduce_scatters": stats["reduce_scatters"]}
    if rank == 0:
        with open(os.path.join(spec["out"], "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
