"""One rank of test_zero_to_fp32.py (not a test by itself): a small GPT-2
trained a few steps with ductile.deepspeed under ZeRO-3, saved with
save_checkpoint; rank 0 also writes the engine's own whole fp32 parameters
(out/expected.pt) and the model's config (the HF checkpoint's config.json).

  torchrun --nproc-per-node 2 zero_to_fp32_worker.py OUT [frozen]
"""

import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ductile.deepspeed as deepspeed
from hf_clm_script import end_rank  # the ranks' end (hf_clm_script.py says why)

CONFIG = {"train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3}}



def main():
    out = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                       n_positions=16))
    if "frozen" in sys.argv[2:]:
        model.transformer.wpe.weight.requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=CONFIG)
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(7 + rank)
    for _ in range(3):
        ids = torch.randint(0, 96, (2, 16), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(os.path.join(out, "checkpoint"))
    expected = engine.zero3.state_dict()
    if rank == 0:
        torch.save(expected, os.path.join(out, "expected.pt"))
        model.config.save_pretrained(os.path.join(out, "checkpoint"))
        with open(os.path.join(out, "done.json"), "w") as f:
            json.dump({"world": torch.distributed.get_world_size()}, f)
    end_rank()


if __name__ == "__main__":
    main()
