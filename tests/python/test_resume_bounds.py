"""Resumes are bounded: a scheduler or sampler state is checked against
what the dataset and the packing can reach before any work, and resuming
far ahead packs each epoch on the way once (O(epochs); O(1) without the
random order) instead of re-packing and re-listing every step. The probe's
VariableBatchLRScheduler.load_state_dict with last_step = 10**9 re-packed
epochs for some 50 minutes; states with extra keys, epoch = 10**18 or
first_step = 10**9 were accepted; a lengths array of 10 for a dataset of
200 gave 10 samples silently."""

import time

import numpy as np
import pytest
import torch

import ductile
from ductile.torch import DynamicBatchSampler, VariableBatchLRScheduler
from ductile.torch import _sampler

LENGTHS = np.array([1 + (i * 37) % 200 for i in range(200)], dtype=np.int64)


def counted(sampler):
    """The sampler, counting its packings from now on."""
    pack = sampler._pack
    sampler.packs = 0

    def counting(*args, **kwargs):
        sampler.packs += 1
        return pack(*args, **kwargs)
    sampler._pack = counting
    return sampler


def sampler_of(order="random"):
    return counted(DynamicBatchSampler(LENGTHS, max_tokens=400, rank=0, world_size=1, seed=7,
                                       order=order))


def scheduler_of(sampler):
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    return VariableBatchLRScheduler(optimizer, sampler, lr_rule="linear", base_batch_size=4)


def test_a_scheduler_state_at_step_10_9_is_answered_at_once():
    sampler = sampler_of()
    scheduler = scheduler_of(sampler)
    before = scheduler.get_last_lr()
    steps = len(sampler.batch_sizes(0))
    state = dict(scheduler.state_dict(), last_step=10**9)
    sampler.packs = 0
    start = time.monotonic()
    with pytest.raises(ductile.InvalidArgumentError,
                       match=rf"step 1000000000 lies in epoch {10**9 // steps} or about \(epoch 0 "
                             rf"has {steps} steps\), more than 4096 epochs after epoch 0, the "
                             "first this sampler knows: a resume that far ahead loads the "
                             "sampler's state_dict"):
        scheduler.load_state_dict(state)
    seconds = time.monotonic() - start
    # Refused from one epoch's step count, before packing any other.
    assert sampler.packs == 0
    assert scheduler.last_step == 0 and scheduler.get_last_lr() == before
    print(f"last_step = 10**9 (random order): refused after {seconds * 1e3:.1f} ms, "
          f"{sampler.packs} packings")


def test_without_the_random_order_step_10_9_is_found_in_constant_time():
    """Every epoch after the first is packed alike: step 10**9's epoch is a
    division, its rate the rule's scaling of that epoch's step."""
    sampler = sampler_of(order="seqlen")
    scheduler = scheduler_of(sampler)
    state = dict(scheduler.state_dict(), last_step=10**9)
    sampler.packs = 0
    start = time.monotonic()
    scheduler.load_state_dict(state)
    seconds = time.monotonic() - start
    assert sampler.packs <= 1  # epoch 1, once (epoch 0 was packed at construction)
    sizes = sampler.batch_sizes(0)
    assert scheduler.last_step == 10**9
    assert scheduler.batch_size() == sizes[10**9 % len(sizes)]
    assert scheduler.get_last_lr() == pytest.approx([0.1 * sizes[10**9 % len(sizes)] / 4])
    print(f"last_step = 10**9 (seqlen order): loaded after {seconds * 1e3:.1f} ms, "
          f"{sampler.packs} packings")


def test_resuming_epochs_ahead_packs_each_epoch_once():
    sampler = sampler_of()
    starts = [0]
    reference = sampler_of()
    for epoch in range(40):
        starts.append(starts[-1] + len(reference.batch_sizes(epoch)))
    step = starts[37] + 3  # 37 epochs ahead, without the sampler's state
    scheduler = scheduler_of(sampler)
    sampler.packs = 0
    scheduler.load_state_dict(dict(scheduler.state_dict(), last_step=step))
    assert scheduler.last_step == step and sampler.epoch_of(step) == 37
    assert scheduler.batch_size() == reference.batch_sizes(37)[3]
    assert 37 <= sampler.packs <= 38  # epochs 1..37 (or 38), each once
    for _ in range(5):  # and it steps on from there
        scheduler.step()
    assert scheduler.batch_size() == reference.batch_sizes(37)[8]
    assert sampler.packs <= 38


def test_a_scheduler_state_with_extra_keys_is_refused():
    scheduler = scheduler_of(sampler_of())
    with pytest.raises(ductile.InvalidArgumentError,
                       match="the state has keys a version 1 state does not have: 'surplus'"):
        scheduler.load_state_dict(dict(scheduler.state_dict(), surplus=1))


@pytest.mark.parametrize("changes,message", [
    (dict(surplus=1), "the state has keys a version 2 state does not have: 'surplus': it was "
                      "not written by DynamicBatchSampler.state_dict"),
    (dict(epoch=10**18), "epoch = 1000000000000000000 must be an integer between 0 and "
                         "2147483647"),
    (dict(epoch=2**70), "epoch = 1180591620717411303424 must be an integer between 0 and "
                        "2147483647"),
    (dict(epoch=1, first_step=10**9), "first_step = 1000000000 must be an integer between 0 "
                                      "and 200"),
    (dict(position=201), "position = 201 must be an integer between 0 and 200"),
    (dict(world_size=10**6), "world_size = 1000000 must be an integer between 1 and 200"),
    (dict(segments=[[1, 150], [1, 100]]), "the segments ran 250 steps of epoch 0, more than "
                                          "its 200 samples allow"),
    (dict(segments=[[1, 0]] * 5000), "segments must be a list of at most 4096"),
])
def test_a_sampler_state_out_of_reach_is_refused_before_any_work(changes, message):
    sampler = sampler_of()
    state = dict(sampler.state_dict(), **changes)
    sampler.packs = 0
    with pytest.raises(ductile.InvalidArgumentError, match=message):
        sampler.load_state_dict(state)
    assert sampler.packs == 0


def test_an_epoch_past_the_seed_is_named_as_the_epoch():
    sampler = DynamicBatchSampler(LENGTHS, max_tokens=400, rank=0, world_size=1,
                                  seed=2**63 - 10)
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"set_epoch: epoch = 20 with seed = 9223372036854775798: the random "
                             r"order's seed, seed \+ epoch, exceeds 2\^63 - 1"):
        sampler.set_epoch(20)
    with pytest.raises(ductile.InvalidArgumentError,
                       match=f"set_epoch: epoch = {2**70} is out of range; must be between 0 "
                             f"and {_sampler.MAX_EPOCH}"):
        sampler_of().set_epoch(2**70)


def test_lengths_that_do_not_match_the_dataset_name_both_sizes(tmp_path):
    from transformers import TrainingArguments
    from hf_models import tiny_model
    from ductile.hf import DuctileTrainer
    data = [{"input_ids": torch.tensor([1, 2, 3])}] * 200
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ductile.InvalidArgumentError,
                       match="DuctileTrainer: lengths has 10 entries but train_dataset has 200 "
                             "samples"):
        DuctileTrainer(model=tiny_model("llama", "sdpa"), args=args, train_dataset=data,
                       lengths=[3] * 10, max_tokens=8, base_batch_size=4)
    with pytest.raises(ductile.InvalidArgumentError,
                       match="lengths has 10 entries but the dataset has 200 samples"):
        ductile.torch.variable_batch_dataloader(data, lengths=np.full(10, 3), max_tokens=8)
