"""The model and data of the zero3 tests and benchmark (not a test by
itself): a small causal byte-level transformer LM whose embedding is tied to
the output head, and fixed-length windows of a real text
(tests/data/text/gpl-3.0.txt) chosen by step number, so that any rank count
splits the same global batch.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

CORPUS = os.path.join(os.environ.get("DUCTILE_TEST_DATA_DIR", os.path.join(
    os.path.dirname(__file__), "..", "data")), "text", "gpl-3.0.txt")


class Block(nn.Module):
    """`keyword_calls`: the block's layers get their input by keyword
    (`self.up(input=h)`), as a module's hooks see kwargs, not args."""

    def __init__(self, d, heads, keyword_calls=False, qkv_bias=False):
        super().__init__()
        self.heads = heads
        self.keyword_calls = keyword_calls
        self.ln1 = nn.LayerNorm(d)
        # No bias by default: a key bias cannot change attention (softmax is
        # shift-invariant), so its gradient is rounding noise, which Adam
        # would amplify into run-to-run differences of the parameter.
        self.qkv = nn.Linear(d, 3 * d, bias=qkv_bias)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def call(self, layer, h):
        return layer(input=h) if self.keyword_calls else layer(h)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.call(self.qkv, self.call(self.ln1, x)).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(causal, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.call(self.proj, y)
        up = self.call(self.up, self.call(self.ln2, x))
        return x + self.call(self.down, F.gelu(up))


class TiedLM(nn.Module):
    """Embedding tied to the head; `reuse_first_block` runs blocks[0] again
    after the last block (a module called twice per pass); `checkpoint` runs
    each block under non-reentrant activation checkpointing (its forward is
    computed again in backward)."""

    def __init__(self, vocab=256, d=64, heads=4, layers=4, context=32, reuse_first_block=False,
                 checkpoint=False, keyword_calls=False, qkv_bias=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, keyword_calls, qkv_bias)
                                    for _ in range(layers))
        self.checkpoint = checkpoint
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.reuse_first_block = reuse_first_block

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.reuse_first_block:
            x = self.blocks[0](x)
        return self.head(self.ln_f(x))


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class WithLoss(nn.Module):
    """The LM whose forward returns the loss (as a Hugging Face model given
    labels does): the loop's loss is the engine's output, so the engine can
    run a step again after a rejoin. `kwargs`: TiedLM's."""

    def __init__(self, seed=0, **kwargs):
        super().__init__()
        self.lm = make_model(seed=seed, **kwargs)

    def forward(self, x, y):
        return loss_of(self.lm(x), y)


class Windows:
    """Step s's global batch: `batch` windows of `context` + 1 bytes at
    offsets drawn from a generator seeded with s."""

    def __init__(self, batch=6, context=32, path=CORPUS):
        with open(path, "rb") as f:
            self.text = torch.tensor(list(f.read()), dtype=torch.int64)
        self.batch = batch
        self.context = context

    def step(self, s, rank=0, world=1):
        if self.batch % world:
            raise ValueError(f"global batch {self.batch} does not split over {world} ranks")
        g = torch.Generator().manual_seed(1000 + s)
        starts = torch.randint(0, len(self.text) - self.context - 1, (self.batch,), generator=g)
        rows = torch.stack([self.text[i:i + self.context + 1] for i in starts.tolist()])
        per = self.batch // world
        mine = rows[rank * per:(rank + 1) * per]
        return mine[:, :-1], mine[:, 1:]


def make_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    return TiedLM(**kwargs)
