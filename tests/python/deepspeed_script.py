"""A DeepSpeed ZeRO-3 training script in the shape of DeepSpeed's
getting-started loop (not a test by itself): argparse with
deepspeed.add_config_arguments, init_distributed, initialize with the
model's parameters and a JSON config, engine(batch), engine.backward,
engine.step, save_checkpoint / load_checkpoint. test_deepspeed_engine.py
runs it as it is and with its import line alone changed to
``import ductile.deepspeed as deepspeed``.

Each optimizer step prints one JSON line on rank 0: the step, the mean loss
of its micro-batches on this rank, and the learning rate after it.
"""

import argparse
import json

import torch
import deepspeed
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 97
CONTEXT = 16


def batch_of(step, micro, rank, micro_batch):
    """The micro-batch `micro` of optimizer step `step` on `rank`: seeded
    tokens, the same whichever engine trains."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (micro_batch, CONTEXT), generator=generator)


def main():
    parser = argparse.ArgumentParser(description="tiny GPT-2 under ZeRO-3")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save_dir", required=True)
    parser.add_argument("--resume", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters())

    first = 0
    if args.resume:
        path, client_state = engine.load_checkpoint(args.save_dir)
        first = client_state["step"]
    rank = torch.distributed.get_rank()
    accumulation = engine.gradient_accumulation_steps()
    micro_batch = engine.train_micro_batch_size_per_gpu()
    for step in range(first, first + args.steps):
        losses = []
        for micro in range(accumulation):
            tokens = batch_of(step, micro, rank, micro_batch)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if rank == 0:
            print(json.dumps({"step": step + 1, "loss": sum(losses) / len(losses),
                              "lr": lr_scheduler.get_last_lr()[0],
                              "global_steps": engine.global_steps,
                              "global_samples": engine.global_samples,
                              "grad_norm": float(engine.get_global_grad_norm())}), flush=True)
    if not args.resume:
        engine.save_checkpoint(args.save_dir, client_state={"step": first + args.steps})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
