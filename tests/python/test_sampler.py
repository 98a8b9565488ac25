"""DynamicBatchSampler resumed at another world size (elastic re-forms 2 -> 3
-> 1 ranks): every sample of the epoch reaches an optimizer step once, the
learning rates follow the steps as they ran, and bad states are refused.
Its step totals normalise the loss of every micro-batch by the whole step:
the gradients of one big batch."""

import csv
import os

import numpy as np
import pytest
import torch
from hf_models import padded_loss, random_samples, tiny_model

import ductile
from ductile.torch import DynamicBatchSampler, FlattenCollate, VariableBatchLRScheduler

DATA = os.environ["DUCTILE_TEST_DATA_DIR"]
MAX_TOKENS = 1024
BASE_LR, BASE_BATCH = 0.1, 8.0


def azure_lengths(count):
    with open(os.path.join(DATA, "lengths", "AzureLLMInferenceTrace_conv.csv"), newline="") as f:
        trace = [int(row["ContextTokens"]) // 8 for row in csv.DictReader(f)]
    return np.maximum(np.array(trace[:count], dtype=np.int64), 1)


LENGTHS = azure_lengths(700)


class Phase:
    """world_size ranks in one process, each with its sampler (and rank 0
    with the LR scheduler), resumed from `state` when given."""

    def __init__(self, world_size, ga, sampler_state=None, scheduler_state=None,
                 order="random"):
        self.ga = ga
        self.samplers = [DynamicBatchSampler(LENGTHS, max_tokens=MAX_TOKENS, order=order,
                                             seed=7, rank=r, world_size=world_size,
                                             gradient_accumulation_steps=ga)
                         for r in range(world_size)]
        self.optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=BASE_LR)
        self.scheduler = VariableBatchLRScheduler(self.optimizer, self.samplers[0],
                                                  lr_rule="linear", base_batch_size=BASE_BATCH)
        if sampler_state is not None:
            for s in self.samplers:
                s.load_state_dict(sampler_state)
            self.scheduler.load_state_dict(scheduler_state)
        self.iterators = [iter(s) for s in self.samplers]

    def step(self):
        """One optimizer step: every rank's ga micro-batches, or None at the
        end of the epoch. Checks the step's learning rate."""
        taken = []
        for it in self.iterators:
            for _ in range(self.ga):
                mb = next(it, None)
                if mb is None:
                    return None
                taken.extend(mb)
        lr = self.optimizer.param_groups[0]["lr"]
        assert lr == pytest.approx(BASE_LR * len(taken) / BASE_BATCH, rel=1e-12)
        assert self.scheduler.batch_size() == len(taken)
        self.scheduler.step()
        return taken

    def run(self, steps=None):
        done = []
        while steps is None or len(done) < steps:
            taken = self.step()
            if taken is None:
                break
            done.append(taken)
        return done


def all_ids():
    return set(range(len(LENGTHS)))


def check_epoch(steps, last_plan, effective_batch_size):
    seen = [i for step in steps for i in step]
    assert len(seen) == len(set(seen)), "a sample reached the optimizer twice"
    rest = set(last_plan.leftover_ids.tolist()) | set(last_plan.dropped_ids.tolist())
    assert set(seen) | rest == all_ids(), "a sample was skipped"
    assert not set(seen) & rest
    # Left over: less than one more step of the last packing.
    assert LENGTHS[last_plan.leftover_ids].sum() < effective_batch_size * MAX_TOKENS


@pytest.mark.parametrize("order", ["random", "seqlen", "dataloader"])
def test_resumed_2_3_1_ranks_train_every_sample_once(order):
    whole = Phase(2, 2, order=order)
    uninterrupted = whole.run()
    check_epoch(uninterrupted, whole.samplers[0].plan(0), 4)

    a = Phase(2, 2, order=order)
    steps = a.run(5)
    # Rank 1 hands out one micro-batch of step 6 and the job stops: that
    # step never reaches the optimizer, so its samples must come again.
    unfinished = next(a.iterators[1])
    state = (a.samplers[1].state_dict(), a.scheduler.state_dict())
    assert state[0]["position"] == 5 * 2 + 1

    b = Phase(3, 2, *state, order=order)
    assert b.scheduler.last_step == 5
    steps += b.run(4)
    state = (b.samplers[2].state_dict(), b.scheduler.state_dict())

    c = Phase(1, 3, *state, order=order)
    assert c.scheduler.last_step == 9
    steps += c.run()
    check_epoch(steps, c.samplers[0].plan(0), 3)
    assert set(unfinished) <= {i for step in steps[5:] for i in step}
    # The same samples as the uninterrupted run, apart from the tail each
    # run's last packing leaves over.
    plain = {i for step in uninterrupted for i in step}
    resumed = {i for step in steps for i in step}
    assert plain - resumed <= set(c.samplers[0].plan(0).leftover_ids.tolist())
    assert resumed - plain <= set(whole.samplers[0].plan(0).leftover_ids.tolist())
    # The LR schedule went on through the re-forms: global steps 0, 1, ...
    assert c.scheduler.last_step == len(steps)
    assert c.samplers[0].first_step(0) == 0 and c.samplers[0].resume_epoch == 0


def test_the_next_epoch_after_a_resume_is_packed_whole_at_the_new_size():
    a = Phase(2, 2)
    a.run(3)
    b = Phase(3, 1, a.samplers[0].state_dict(), a.scheduler.state_dict())
    first = b.run()
    for s in b.samplers:
        s.set_epoch(1)
    b.iterators = [iter(s) for s in b.samplers]
    second = b.run()
    fresh = DynamicBatchSampler(LENGTHS, max_tokens=MAX_TOKENS, order="random", seed=7, rank=0,
                                world_size=3)
    assert [len(s) for s in second] == fresh.batch_sizes(1).tolist()
    assert b.scheduler.last_step == 3 + len(first) + len(second)
    assert b.samplers[0].first_step(1) == 3 + len(first)


def test_a_resume_at_the_same_world_size_continues_exactly():
    a = Phase(2, 2)
    a.run(4)
    rest = Phase(2, 2).run()[4:]
    b = [DynamicBatchSampler(LENGTHS, max_tokens=MAX_TOKENS, order="random", seed=7, rank=r,
                             world_size=2, gradient_accumulation_steps=2) for r in range(2)]
    for r in range(2):
        b[r].load_state_dict(a.samplers[r].state_dict())
    iterators = [iter(s) for s in b]
    resumed = []
    for _ in rest:
        resumed.append([i for it in iterators for _ in range(2) for i in next(it)])
    assert resumed == rest


def bad(state, **changes):
    out = dict(state)
    out.update(changes)
    for key, value in list(out.items()):
        if value is KeyError:
            del out[key]
    return out


@pytest.mark.parametrize("changes, message", [
    (dict(version=7), "state version 7 is not supported; this ductile reads versions 1 and 2"),
    (dict(position=KeyError), "the state lacks position: it is damaged"),
    (dict(position=-1), "position = -1 must be an integer between 0 and 700"),
    (dict(position=10 ** 6), "position = 1000000 must be an integer between 0 and 700"),
    (dict(position=699), "position 699 is out of range; rank 0 has"),
    (dict(epoch=True), "epoch = True must be an integer between 0 and 2147483647"),
    (dict(rank=1), "the state is rank 1's and this sampler is rank 0 at the same world size 2"),
    (dict(lengths_sha256="0" * 64), "lengths_sha256 = '0000"),
    (dict(samples=5), "samples = 5, this sampler 700"),
    (dict(segments=[[0, 1]]), "segment \\[0, 1\\] must be \\[effective_batch_size >= 1"),
    (dict(segments=[[4, 300]], world_size=4, effective_batch_size=4),
     "ran 300 steps of epoch 0 at effective_batch_size 4"),
    (dict(version=1, world_size=4, effective_batch_size=4, lengths_sha256=KeyError,
          first_step=KeyError, segments=KeyError),
     "a version 1 state \\(world_size 4, effective_batch_size 4\\) resumes only at those"),
])
def test_bad_states_are_refused_by_name(changes, message):
    sampler = DynamicBatchSampler(LENGTHS, max_tokens=MAX_TOKENS, seed=7, rank=0, world_size=2)
    state = bad(sampler.state_dict(), **changes)
    fresh = DynamicBatchSampler(LENGTHS, max_tokens=MAX_TOKENS, seed=7, rank=0, world_size=2)
    with pytest.raises(ductile.InvalidArgumentError, match=message):
        fresh.load_state_dict(state)
        len(fresh)  # a bad segment shows when the epoch is packed


def test_the_scheduler_needs_its_state_after_an_elastic_resume_in_a_later_epoch():
    a = Phase(2, 2)
    epoch0 = a.run()
    for s in a.samplers:
        s.set_epoch(1)
    a.iterators = [iter(s) for s in a.samplers]
    a.run(2)
    sampler = DynamicBatchSampler(LENGTHS, max_tokens=MAX_TOKENS, order="random", seed=7,
                                  rank=0, world_size=3)
    sampler.load_state_dict(a.samplers[0].state_dict())
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=BASE_LR)
    scheduler = VariableBatchLRScheduler(optimizer, sampler, lr_rule="linear",
                                         base_batch_size=BASE_BATCH)
    with pytest.raises(ductile.InvalidArgumentError,
                       match=f"step 1 is before step {len(epoch0)}, where the sampler "
                       "resumed \\(epoch 1\\)"):
        scheduler.step()
    # With its state, it goes on at global step len(epoch0) + 2.
    scheduler.load_state_dict(a.scheduler.state_dict())
    assert scheduler.last_step == len(epoch0) + 2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(
        BASE_LR * scheduler.batch_size() / BASE_BATCH)


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_num_items_in_batch_from_the_sampler_gives_the_gradients_of_one_big_batch(family):
    world, ga = 2, 2
    samples = random_samples(5, count=48, longest=30)
    lengths = [len(x) for x in samples]
    samplers = [DynamicBatchSampler(lengths, max_tokens=64, order="random", seed=3, rank=r,
                                    world_size=world, gradient_accumulation_steps=ga)
                for r in range(world)]
    collate = FlattenCollate()
    iterators = [iter(s) for s in samplers]
    for step in range(3):
        split = tiny_model(family, "sdpa")
        step_samples, counted = [], 0
        for r, sampler in enumerate(samplers):
            totals = sampler.step_totals()
            for _ in range(ga):
                position = sampler.position
                ids = next(iterators[r])
                assert sampler.step_of(position) == step
                items = int(totals["labels"][step])
                batch = collate([samples[i] for i in ids])
                counted += int((batch["labels"][0, 1:] != -100).sum())
                # DDP would scale rank r's loss by the world size and average
                # the ranks' gradients: the same as summing them here.
                split(**batch, use_cache=False, num_items_in_batch=items).loss.backward()
                step_samples += [samples[i] for i in ids]
        # Every rank knew the step's label count without communicating.
        assert counted == items == sum(len(x) - 1 for x in step_samples)
        assert int(totals["samples"][step]) == len(step_samples)
        assert int(totals["tokens"][step]) == sum(len(x) for x in step_samples)
        whole = tiny_model(family, "sdpa")
        padded_loss(whole, step_samples).backward()
        for a, b in zip(grads(split), grads(whole)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # The check can fail: each micro-batch's own mean weights them wrongly.
    per_batch = tiny_model(family, "sdpa")
    sampler = DynamicBatchSampler(lengths, max_tokens=64, order="random", seed=3, rank=0,
                                  world_size=1, gradient_accumulation_steps=4)
    it = iter(sampler)
    step_samples = []
    for _ in range(4):
        ids = next(it)
        (per_batch(**collate([samples[i] for i in ids]), use_cache=False).loss / 4).backward()
        step_samples += [samples[i] for i in ids]
    whole = tiny_model(family, "sdpa")
    padded_loss(whole, step_samples).backward()
    assert any(not torch.allclose(a, b, rtol=1e-4, atol=1e-6)
               for a, b in zip(grads(per_batch), grads(whole)))
