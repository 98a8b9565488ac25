"""ductile.torch.FlattenCollate: Hugging Face's DataCollatorWithFlattening
contract, checked against the installed transformers in the same process, and
a flattened micro-batch through real transformers models (Llama and GPT-2
configurations, eager and sdpa attention) giving the loss of the same samples
padded."""

import random

import pytest
import torch
from hf_models import VOCAB, padded_loss, random_samples, tiny_encoder, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening

import ductile
from ductile.torch import DynamicBatchSampler, FlattenCollate, variable_batch_dataloader


def same_batch(ours, theirs):
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        mine = ours[key]
        if torch.is_tensor(value):
            assert torch.is_tensor(mine) and mine.dtype == value.dtype, key
            assert torch.equal(mine, value), key
        else:
            assert type(mine) is type(value) and mine == value, key


samples_strategy = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
                            min_size=1, max_size=8)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(samples=samples_strategy, with_labels=st.booleans(), flash=st.booleans(),
       seq_idx=st.booleans(), positions=st.booleans(), start=st.integers(0, 3),
       separator=st.sampled_from([-100, -1, 0]), as_tensors=st.booleans())
def test_the_batch_equals_transformers_data_collator_with_flattening(
        samples, with_labels, flash, seq_idx, positions, start, separator, as_tensors):
    features = []
    for ids in samples:
        f = {"input_ids": torch.tensor(ids) if as_tensors else list(ids)}
        if with_labels:
            f["labels"] = [(t * 7 + 3) % VOCAB for t in ids]
        features.append(f)
    options = dict(return_position_ids=positions, separator_id=separator,
                   return_flash_attn_kwargs=flash, return_seq_idx=seq_idx,
                   position_ids_start=start)
    theirs = DataCollatorWithFlattening(**options)([dict(f) for f in features])
    ours = FlattenCollate(**options)([dict(f) for f in features])
    same_batch(ours, theirs)


def test_plain_token_sequences_are_samples_too():
    batch = FlattenCollate(return_flash_attn_kwargs=True)([torch.tensor([5, 6, 7]), [8, 9]])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert batch["max_length_k"] == 3


@pytest.mark.parametrize("samples, message", [
    ([], "an empty micro-batch"),
    ([{"input_ids": []}], "sample 0's input_ids has no tokens"),
    ([[1, 2], {"tokens": [1]}], "sample 1 of the micro-batch has no 'input_ids' \\(its keys: "
                                "tokens\\)"),
    ([{"input_ids": [1, 2], "labels": [1]}], "sample 0 has 2 input_ids but 1 labels"),
    ([[[1, 2], [3, 4]]], "sample 0 has shape \\(2, 2\\)"),
    ([[0.5, 1.5]], "sample 0 has dtype torch.float32; token ids must be integers"),
])
def test_bad_samples_are_refused_by_name(samples, message):
    with pytest.raises(ductile.InvalidArgumentError, match=message):
        FlattenCollate()(samples)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_flattened_micro_batch_has_the_loss_of_the_padded_samples(family, attention):
    model = tiny_model(family, attention)
    with torch.no_grad():
        for seed in range(5):
            samples = random_samples(seed, count=5, longest=40)
            batch = FlattenCollate()(samples)
            flat = model(**batch, use_cache=False).loss
            padded = padded_loss(model, samples)
            assert abs(flat.item() - padded.item()) <= 1e-5, (seed, flat.item(), padded.item())
            # The check can fail: without restarting positions the samples
            # attend to each other and the loss moves.
            leaky = dict(batch, position_ids=torch.arange(batch["input_ids"].shape[1])[None])
            assert abs(model(**leaky, use_cache=False).loss.item() - padded.item()) > 1e-4


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_block_mask_keeps_the_flattened_samples_of_an_encoder_apart(attention):
    model = tiny_encoder(attention)
    samples = random_samples(3, count=4, longest=30)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s])).last_hidden_state[0] for s in samples]
        batch = FlattenCollate(block_attention_mask="bidirectional")(samples)
        assert batch["attention_mask"].shape == (1, 1, sum(map(len, samples)),
                                                 sum(map(len, samples)))
        flat = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     attention_mask=batch["attention_mask"]).last_hidden_state[0]
        torch.testing.assert_close(flat, torch.cat(alone), rtol=1e-5, atol=1e-5)
        # Without the mask BERT ignores the restarted positions: every token
        # attends to the whole row, and the states move.
        leaky = model(input_ids=batch["input_ids"],
                      position_ids=batch["position_ids"]).last_hidden_state[0]
        assert (leaky - torch.cat(alone)).abs().max() > 1e-3


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_causal_block_mask_gives_a_causal_lm_the_padded_loss(attention):
    model = tiny_model("llama", attention)
    samples = random_samples(5, count=5, longest=40)
    with torch.no_grad():
        batch = FlattenCollate(block_attention_mask="causal")(samples)
        flat = model(**batch, use_cache=False).loss
        assert abs(flat.item() - padded_loss(model, samples).item()) <= 1e-5
        # With a block mask that is not causal the tokens see ahead.
        ahead = FlattenCollate(block_attention_mask="bidirectional")(samples)
        assert abs(model(**ahead, use_cache=False).loss.item() - flat.item()) > 1e-4


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_attention_mask="full"), "block_attention_mask='full' is not valid; use None, "
                                        "'bidirectional' or 'causal'"),
    (dict(block_attention_mask="causal", mask_dtype=torch.int64),
     "mask_dtype=torch.int64 is not valid; use a floating-point torch.dtype"),
])
def test_bad_block_mask_options_are_refused_by_name(kwargs, message):
    with pytest.raises(ductile.InvalidArgumentError, match=message):
        FlattenCollate(**kwargs)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gradients_of_a_flattened_micro_batch_equal_the_padded_ones(family):
    samples = random_samples(11, count=4, longest=30)
    flat_model, padded_model = tiny_model(family, "sdpa"), tiny_model(family, "sdpa")
    flat_model(**FlattenCollate()(samples), use_cache=False).loss.backward()
    padded_loss(padded_model, samples).backward()
    for (name, a), b in zip(flat_model.named_parameters(), padded_model.parameters()):
        if b.grad is None:
            assert a.grad is None or not a.grad.any(), name
            continue
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_sampler_and_flatten_collate_feed_every_token_once():
    rng = random.Random(3)
    dataset = [{"input_ids": torch.randint(0, VOCAB, (rng.randint(1, 60),))} for _ in range(200)]
    lengths = [len(d["input_ids"]) for d in dataset]
    sampler = DynamicBatchSampler(lengths, max_tokens=128, order="random", seed=5, rank=0,
                                  world_size=1)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                         collate_fn=FlattenCollate(return_flash_attn_kwargs=True))
    micro_batches = list(sampler)  # epoch 0; a finished pass moves the sampler on
    sampler.set_epoch(0)
    batches = list(loader)
    assert len(batches) == len(micro_batches) > 0
    seen = 0
    for micro_batch, batch in zip(micro_batches, batches):
        ids = batch["input_ids"][0]
        assert ids.numel() <= 128
        assert torch.equal(ids, torch.cat([dataset[i]["input_ids"] for i in micro_batch]))
        assert batch["cu_seq_lens_k"].tolist()[-1] == ids.numel()
        seen += len(micro_batch)
    plan = sampler.plan(0)
    assert seen == len(dataset) - len(plan.leftover_ids) - len(plan.dropped_ids)


def test_variable_batch_dataloader_flattens_with_collate_flatten():
    rng = random.Random(4)
    dataset = [{"input_ids": torch.randint(0, VOCAB, (rng.randint(1, 40),))} for _ in range(120)]
    loader, _, sampler = variable_batch_dataloader(dataset, max_tokens=96, collate="flatten",
                                                   rank=0, world_size=1, seed=2)
    micro_batches = list(sampler)
    sampler.set_epoch(0)
    batches = list(loader)
    assert len(batches) == len(micro_batches) > 0
    for micro_batch, batch in zip(micro_batches, batches):
        assert set(batch) == {"input_ids", "labels", "position_ids"}
        assert torch.equal(batch["input_ids"][0],
                           torch.cat([dataset[i]["input_ids"] for i in micro_batch]))
    padded, _, _ = variable_batch_dataloader(dataset, max_tokens=96, collate="pad", rank=0,
                                             world_size=1, seed=2)
    assert "lengths" in next(iter(padded))


@pytest.mark.parametrize("kwargs, message", [
    (dict(collate="packed"), "collate='packed' is not valid; use 'pad' or 'flatten'"),
    (dict(collate="flatten", collate_fn=FlattenCollate()),
     "collate='flatten' and collate_fn are both given; give one of them"),
])
def test_bad_collate_choices_are_refused_by_name(kwargs, message):
    dataset = [[1, 2, 3]] * 4
    with pytest.raises(ductile.InvalidArgumentError, match=message):
        variable_batch_dataloader(dataset, max_tokens=8, rank=0, world_size=1, **kwargs)
