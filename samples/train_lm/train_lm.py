"""Trains a small causal language model on the CPU with ductile's three
pieces at once, as a user's training script would (the main job of
run.sh):

- the elastic plan: the DeepSpeed config's "elasticity" block fixes the
  global batch and the world sizes it stays valid for (the agent started
  this run at one of them);
- dynamic batching: sequences of real lengths (SQuAD's, up to 384 tokens)
  packed into micro-batches by a token budget, flattened without padding,
  the learning rate scaled to each step's real batch;
- ZeRO-3: the Hugging Face Trainer's DeepSpeed integration on ductile's
  engine (ductile.hf.DuctileTrainer), parameters sharded across the ranks.

The model is a Llama built from a config (about 0.9 M parameters) learning
the bytes of this project's own documentation.

  ductile agent --standalone --nproc-per-node 2 --config samples/train_lm/ds_config.json \\
      samples/train_lm/train_lm.py --output-dir OUT
"""

import argparse
import csv
import glob
import json
import os
import resource
import sys
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

import ductile.elasticity
from ductile.hf import DuctileTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LENGTHS = os.path.join(ROOT, "samples", "data", "squad11_bert384_hist.csv")


def documentation_bytes():
    """The text the model learns: README.md and docs/*.md, as bytes."""
    paths = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs",
                                                                           "*.md")))
    text = b"\n\n".join(open(path, "rb").read() for path in paths)
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def real_lengths(count, seed):
    """`count` sequence lengths drawn from SQuAD 1.1's histogram."""
    with open(LENGTHS, newline="", encoding="utf-8") as f:
        rows = [(int(row["length"]), int(row["count"])) for row in csv.DictReader(f)]
    lengths = np.array([length for length, _ in rows])
    weights = np.array([n for _, n in rows], dtype=np.float64)
    rng = np.random.default_rng(seed)
    return rng.choice(lengths, size=count, p=weights / weights.sum())


class Passages(torch.utils.data.Dataset):
    """Consecutive passages of the text, one per length (the labels are the
    inputs: the model shifts them)."""

    def __init__(self, text, lengths):
        self.text = torch.from_numpy(text)
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) % (len(text) - 400)
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        start = int(self.starts[i])
        return {"input_ids": self.text[start:start + int(self.lengths[i])]}


class Summary(TrainerCallback):
    """What the run did, for the summary: tokens trained and the time the
    steps took."""

    def __init__(self):
        self.started = None
        self.seconds = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.started


def peak_memory_mib():
    """This process's peak resident memory, the largest over the ranks."""
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return peak.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--config", default=os.path.join(HERE, "ds_config.json"),
                        help="DeepSpeed config: ZeRO-3 and the elasticity block")
    parser.add_argument("--samples", type=int, default=2560)
    parser.add_argument("--epochs", type=float, default=1)
    cli = parser.parse_args()

    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    with open(cli.config, encoding="utf-8") as f:
        ds_config = json.load(f)
    global_batch, valid_sizes, micro_batch = ductile.elasticity.compute_elastic_config(
        ds_config, "0.9.0", world_size=world_size)
    lengths = real_lengths(cli.samples, seed=0)
    # A micro-batch's token budget: the plan's micro-batch of passages of
    # the average length. Packed, a step takes fewer passages than the
    # plan's batch (the budget is never exceeded) and the learning rate is
    # scaled down to match (lr_rule "sqrt", base_batch_size = the plan's).
    max_tokens = int(micro_batch * lengths.mean())
    accumulation = global_batch // (micro_batch * world_size)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"elastic plan: global batch {global_batch} samples, valid world sizes "
              f"{valid_sizes}; at world size {world_size}: micro-batches of "
              f"{max_tokens} tokens (about {micro_batch} passages), {accumulation} per rank "
              "and step", flush=True)

    args = TrainingArguments(
        output_dir=cli.output_dir, deepspeed=ds_config, use_cpu=True, ddp_backend="gloo",
        num_train_epochs=cli.epochs, learning_rate=2e-3, lr_scheduler_type="cosine",
        warmup_steps=4, weight_decay=0.01, max_grad_norm=1.0, adam_beta2=0.95,
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
        logging_steps=5, save_strategy="no",
        report_to=[], seed=0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    parameters = model.num_parameters()  # before ZeRO-3 shards them
    summary = Summary()
    trainer = DuctileTrainer(model=model, args=args,
                             train_dataset=Passages(documentation_bytes(), lengths),
                             lengths=lengths.tolist(), max_tokens=max_tokens, lr_rule="sqrt",
                             base_batch_size=global_batch, callbacks=[summary])
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    peak = peak_memory_mib()
    if args.process_index == 0:
        tokens = int(lengths.sum() * cli.epochs)
        print(f"trained {trainer.state.global_step} steps, {tokens:,} tokens in "
              f"{summary.seconds:.1f} s: {tokens / summary.seconds:,.0f} tokens/s; loss "
              f"{losses[0]:.3f} -> {losses[-1]:.3f} (mean {result.training_loss:.3f}); peak "
              f"memory {peak:.0f} MiB a rank; {parameters:,} parameters; files in "
              f"{cli.output_dir}", flush=True)


def end_rank():
    """Ends the rank once its results are printed: the ranks meet, the
    process group goes, and the interpreter's finalisation is skipped. A
    gloo thread that drops a finished collective's tensors while the
    interpreter finalises aborts the process ("terminate called without an
    active exception", torch's own issue)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    end_rank()
