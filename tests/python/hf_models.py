"""Tiny Hugging Face causal LMs and a BERT encoder built from configurations
(random weights, no download) and the padded reference loss, for the tests of padding-free
micro-batches (not a test by itself)."""

import random

import torch
from transformers import (BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM)

VOCAB = 97


def tiny_model(family, attention):
    """A 2-layer model in eval mode (no dropout: GPT-2 has some); gradients
    still flow."""
    torch.manual_seed(0)
    if family == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, attn_implementation=attention)
        model = LlamaForCausalLM(config)
    else:
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                            bos_token_id=0, eos_token_id=0,
                            attn_implementation=attention)
        model = GPT2LMHeadModel(config)
    return model.eval()


def tiny_encoder(attention):
    """A 2-layer BERT in eval mode: bidirectional attention, whose mask
    transformers 5.23 builds without looking at position_ids."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                        attn_implementation=attention)
    return BertModel(config, add_pooling_layer=False).eval()


def padded_loss(model, samples):
    """The token-weighted loss of the samples padded to the longest: the
    mean over every predicted token of every sample."""
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask = torch.zeros(len(samples), longest, dtype=torch.int64)
    labels = torch.full((len(samples), longest), -100, dtype=torch.int64)
    for i, s in enumerate(samples):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
        labels[i, :len(s)] = torch.tensor(s)
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def random_samples(seed, count, longest):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(2, longest))] for _ in range(count)]
