"""Padding-free packs against padded ones and against Hugging Face's default
(a program that prints figures, medians; not a test).

One causal LM (a Llama configuration, random weights), one set of samples and
one token budget, three ways of feeding it, each trained for one pass over the
same samples (forward, backward and AdamW every micro-batch, use_cache=False):

  hf         HF's default: a fixed batch size (the budget over the mean
             length), shuffled, padded to each batch's longest sample
             (DataCollatorWithPadding's rule: right padding, attention mask)
  padded     ductile packs (DynamicBatchSampler, greedy, random order) through
             PadCollate, with an attention mask
  flattened  the same packs through FlattenCollate: one row, no padding

Throughput counts real tokens only, padding excluded. Lengths are drawn from
the Azure LLM inference trace (conversation), divided by SCALE so that a pass
fits a 2-core CPU; the token budget is divided the same way.

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_flatten.py \
      [SAMPLES [ROUNDS [SCALE]]]
"""

import csv
import os
import random
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ductile
from ductile.torch import DynamicBatchSampler, FlattenCollate, PadCollate

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TRACE = os.path.join(ROOT, "tests", "data", "lengths", "AzureLLMInferenceTrace_conv.csv")
VOCAB = 4096
BUDGET = 8192  # tokens of a micro-batch before scaling (the trace's p99 is 4,142)


def azure_lengths(count, scale, seed):
    with open(TRACE, newline="") as f:
        trace = [int(row["ContextTokens"]) for row in csv.DictReader(f)]
    rng = random.Random(seed)
    return [max(1, rng.choice(trace) // scale) for _ in range(count)]


def make_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=16384, attn_implementation="sdpa",
                         use_cache=False)
    return LlamaForCausalLM(config)


def padded_batch(samples):
    padded, lengths = PadCollate(pad_value=0)(samples)
    mask = (torch.arange(padded.shape[1])[None, :] < lengths[:, None]).long()
    labels = padded.masked_fill(mask == 0, -100)
    return {"input_ids": padded, "attention_mask": mask, "labels": labels}


def hf_batches(dataset, batch_size, seed):
    order = list(range(len(dataset)))
    random.Random(seed).shuffle(order)
    for i in range(0, len(order), batch_size):
        yield padded_batch([dataset[j] for j in order[i:i + batch_size]])


def ductile_batches(dataset, lengths, budget, seed, collate):
    sampler = DynamicBatchSampler(lengths, max_tokens=budget, order="random", seed=seed,
                                  rank=0, world_size=1)
    for ids in sampler:
        yield collate([dataset[i] for i in ids])


def one_pass(batches):
    """Trains one pass; returns (real tokens, padded positions, seconds)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    real = positions = 0
    seconds = 0.0
    for batch in batches:
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - start
        ids = batch["input_ids"]
        positions += ids.numel()
        real += int(batch["attention_mask"].sum()) if "attention_mask" in batch else ids.numel()
    return real, positions, seconds


def main():
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 600
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    scale = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    lengths = azure_lengths(count, scale, seed=1)
    rng = torch.Generator().manual_seed(2)
    dataset = [torch.randint(0, VOCAB, (n,), generator=rng) for n in lengths]
    budget = BUDGET // scale
    batch_size = max(1, round(budget / statistics.mean(lengths)))
    setups = {
        "hf": lambda: hf_batches(dataset, batch_size, seed=3),
        "padded": lambda: ductile_batches(dataset, lengths, budget, 3, padded_batch),
        "flattened": lambda: ductile_batches(dataset, lengths, budget, 3, FlattenCollate()),
    }
    print(f"ductile {ductile.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; Llama config (4 layers, hidden 256, vocab "
          f"{VOCAB}, sdpa), {count} samples drawn from the Azure conversation trace / {scale} "
          f"(mean {statistics.mean(lengths):.0f}, max {max(lengths)} tokens), budget "
          f"{budget} tokens a micro-batch, HF batch size {batch_size}; median of {rounds} "
          "interleaved rounds")
    rates = {name: [] for name in setups}
    shape = {}
    for _ in range(rounds):
        for name, batches in setups.items():
            real, positions, seconds = one_pass(batches())
            rates[name].append(real / seconds)
            shape[name] = (real, positions)
    for name in setups:
        real, positions = shape[name]
        print(f"  {name:10s} {statistics.median(rates[name]):10.0f} real tokens/s   "
              f"padding {100 * (1 - real / positions):5.1f} % of {positions} positions")
    flat = statistics.median(rates["flattened"])
    print(f"  flattened / padded {flat / statistics.median(rates['padded']):.2f}x   "
          f"flattened / hf {flat / statistics.median(rates['hf']):.2f}x   "
          "(issue 23's goal: >= 1.3x and >= 1.5x)")


if __name__ == "__main__":
    main()
