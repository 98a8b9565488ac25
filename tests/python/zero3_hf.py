"""Hugging Face models of the zero3 tests (not a test by itself): GPT-2
(tied embeddings, absolute positions), Llama (rotary positions, grouped
keys) and BERT (a masked LM whose decoder weight and bias are shared with
other modules), built from small configurations with random weights; the
batches; and one plain-torch training run to compare with."""

import torch
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM)

FAMILIES = ("gpt2", "llama", "bert")
VOCAB = 128
CONTEXT = 16
BATCH = 4  # global: 2 per rank on 2 ranks
LR = 3e-3


def config_of(family):
    if family == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                          eos_token_id=0, attn_implementation="eager")
    if family == "llama":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64, attn_implementation="eager")
    return BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      attn_implementation="eager")


def model_class(family):
    return {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "bert": BertForMaskedLM}[family]


def build(family, seed=0):
    torch.manual_seed(seed)
    return model_class(family)(config_of(family))


def batch(step, rank=0, world=1):
    """Step `step`'s global batch of token ids, this rank's rows: counting
    sequences (each token the previous one plus a row's stride) from random
    starts, which a model learns within a few steps."""
    g = torch.Generator().manual_seed(5000 + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    ids = (start + stride * torch.arange(CONTEXT)) % VOCAB
    per = BATCH // world
    return ids[rank * per:(rank + 1) * per]


def probe():
    return torch.randint(0, VOCAB, (2, CONTEXT), generator=torch.Generator().manual_seed(99))


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def train_plain(family, steps, autocast=None):
    """Per-step losses of plain torch on the whole batch (one process)."""
    model = build(family)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for s in range(steps):
        ids = batch(s)
        if autocast is not None:
            with torch.autocast("cpu", dtype=autocast):
                loss = loss_of(model, ids)
        else:
            loss = loss_of(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses
