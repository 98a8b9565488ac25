"""ductile.torch in one process: pipeline-parallel shapes, the wrapped-scheduler
mode, several param groups, DeepSpeed's entry point with metrics_path, and
bad input (wrong lengths, mismatched state_dicts)."""

import json

import numpy as np
import pytest

import torch

import ductile
import ductile.torch as dt
from ductile import batching


class Ramp(torch.utils.data.Dataset):
    """Sample i: a 1-D tensor of 1 + (i * 7) % 23 tokens."""

    def __init__(self, n=120):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.arange(1 + (i * 7) % 23)


def test_pipeline_parallel_steps_have_one_shape():
    dataset = Ramp()
    pad = lambda sample, length: torch.nn.functional.pad(sample, (0, length - len(sample)))  # noqa
    loader, _, sampler = dt.variable_batch_dataloader(
        dataset, max_tokens=64, gradient_accumulation_steps=3, rank=1, world_size=2,
        same_size_microbatches=True, sample_padding_fn=pad, order="seqlen")
    plan = sampler.plan(0)
    shapes = [tokens.shape for tokens, _ in loader]
    assert len(shapes) == len(plan.rank_microbatches[1]) and len(shapes) % 3 == 0
    for step in range(len(shapes) // 3):
        got = shapes[3 * step:3 * step + 3]
        assert len(set(got)) == 1, got
        assert got[0][1] == plan.batch_max_seqlens[step]


def test_wrapped_torch_scheduler_is_scaled_by_the_rule():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.1},
                                 {"params": [model.bias], "lr": 0.02}])
    lengths = np.array([1 + (i * 5) % 17 for i in range(200)], dtype=np.int64)
    sampler = dt.DynamicBatchSampler(lengths, max_tokens=40, rank=0, world_size=1)
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    scheduler = dt.VariableBatchLRScheduler(optimizer, sampler, lr_rule="linear",
                                            base_batch_size=4, lr_scheduler=step_lr)
    sizes = sampler.batch_sizes(0)
    for step in range(8):
        for group, base in zip(optimizer.param_groups, (0.1, 0.02)):
            assert group["lr"] == pytest.approx(base * 0.5 ** (step // 3) * sizes[step] / 4,
                                                rel=1e-12)
        optimizer.step()
        scheduler.step()
    # Resume: a fresh optimizer/scheduler pair continues with the same rates.
    state = scheduler.state_dict()
    optimizer2 = torch.optim.SGD([{"params": [model.weight], "lr": 0.1},
                                  {"params": [model.bias], "lr": 0.02}])
    scheduler2 = dt.VariableBatchLRScheduler(
        optimizer2, sampler, lr_rule="linear", base_batch_size=4,
        lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer2, step_size=3, gamma=0.5))
    scheduler2.load_state_dict(state)
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    scheduler.step()
    scheduler2.step()
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()


@pytest.mark.parametrize("change, message", [
    (dict(version=2), "state version 2 is not supported; this ductile reads version 1"),
    (dict(last_step=-4), "last_step = -4 must be an integer >= 0: the state is damaged"),
    (dict(last_step=True), "last_step = True must be an integer >= 0"),
    (dict(last_step="3"), "last_step = '3' must be an integer >= 0"),
    (dict(unscaled=[0.1]), "unscaled = \\[0.1\\] must be 2 finite rates, one per param group"),
    (dict(unscaled=[0.1, float("nan")]), "must be 2 finite rates"),
    (dict(rule="sqrt"), "the state has rule = 'sqrt', this scheduler 'linear'"),
    ("last_step", "the state lacks last_step: it is damaged"),
    ("lr_scheduler", "the state lacks lr_scheduler: it is damaged"),
])
def test_a_damaged_or_foreign_scheduler_state_is_refused_by_name(change, message):
    model = torch.nn.Linear(2, 1)

    def make():
        optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.1},
                                     {"params": [model.bias], "lr": 0.02}])
        sampler = dt.DynamicBatchSampler([5, 7, 9, 11] * 10, max_tokens=40, rank=0,
                                         world_size=1)
        return dt.VariableBatchLRScheduler(
            optimizer, sampler, lr_rule="linear", base_batch_size=4,
            lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5))

    saved = make()
    for _ in range(3):
        saved.step()
    state = saved.state_dict()
    if isinstance(change, dict):
        state.update(change)
    else:
        del state[change]
    fresh = make()
    before = fresh.get_last_lr()
    with pytest.raises(ductile.InvalidArgumentError, match=message):
        fresh.load_state_dict(state)
    assert fresh.get_last_lr() == before and fresh.last_step == 0


def test_param_groups_follow_the_cpp_schedule():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam([{"params": [model.weight], "lr": 1e-3},
                                  {"params": [model.bias], "lr": 5e-3}])
    lengths = np.array([1 + (i * 5) % 17 for i in range(300)], dtype=np.int64)
    sampler = dt.DynamicBatchSampler(lengths, max_tokens=50, rank=0, world_size=1,
                                     order="random", seed=3)
    scheduler = dt.VariableBatchLRScheduler(optimizer, sampler, lr_rule="sqrt",
                                            base_batch_size=5, schedule="warmup_cosine",
                                            warmup_steps=4, total_steps=40, min_lr=1e-5)
    plans = [batching.pack(lengths, max_tokens=50, order="random", seed=3,
                           effective_batch_size=1, lr_rule="sqrt", base_batch_size=5,
                           base_lr=base, schedule="warmup_cosine", warmup_steps=4,
                           total_steps=40, min_lr=1e-5) for base in (1e-3, 5e-3)]
    for step in range(plans[0].step_count):
        assert scheduler.get_last_lr() == [plans[0].lrs[step], plans[1].lrs[step]]
        scheduler.step()


def test_deepspeed_entry_point_reads_and_writes_metrics_path(tmp_path):
    dataset = Ramp(90)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "data_efficiency": {"enabled": True, "seed": 5, "data_sampling": {"dynamic_batching": {
              "enabled": True, "max_tokens": 60, "lr_scaling_method": "sqrt",
              "sequence_picking_order": "random", "min_batch_size": 1, "max_batch_size": 8,
              "metrics_path": str(tmp_path / "metrics")}}}}
    loader, scheduler, sampler = dt.get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset, ds, optimizer, rank=1, world_size=2)
    written = ductile.metrics.read_metric(ductile.metrics.seqlen_prefix(tmp_path / "metrics"))
    assert written.tolist() == [len(dataset[i]) for i in range(len(dataset))]
    assert sampler.gradient_accumulation_steps == 2 and sampler.effective_batch_size == 4
    plan = batching.pack(written, max_tokens=60, order="random", seed=5, max_batch_size=8,
                         effective_batch_size=4, ranks=2, lr_rule="sqrt", base_batch_size=4,
                         base_lr=1e-3)
    assert [ids for ids in sampler] == [plan.microbatch(m).tolist()
                                        for m in plan.rank_microbatches[1]]
    assert scheduler.get_last_lr()[0] == plan.lrs[0]


def test_bad_input_is_reported():
    dataset = Ramp(10)
    with pytest.raises(ductile.InvalidArgumentError, match="9 entries but the dataset has 10"):
        dt.variable_batch_dataloader(dataset, lengths=np.ones(9, np.int64), max_tokens=8)
    with pytest.raises(ductile.InvalidArgumentError, match="sample 2 has length -1"):
        dt.DynamicBatchSampler(np.array([3, 2, -1], np.int64), max_tokens=8, rank=0,
                               world_size=1)
    with pytest.raises(ductile.InvalidArgumentError, match="int64"):
        dt.DynamicBatchSampler(np.array([3.0, 2.0]), max_tokens=8, rank=0, world_size=1)
    with pytest.raises(ductile.InvalidArgumentError, match="rank 2 of world_size 2"):
        dt.DynamicBatchSampler([3, 2], max_tokens=8, rank=2, world_size=2)
    sampler = dt.DynamicBatchSampler([3, 2, 4, 1], max_tokens=8, rank=0, world_size=1)
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ductile.NotFoundError, match="no lr plugin named 'cubic'"):
        dt.VariableBatchLRScheduler(optimizer, sampler, lr_rule="cubic", base_batch_size=2)
    other = dt.DynamicBatchSampler([3, 2, 4, 1], max_tokens=9, rank=0, world_size=1)
    with pytest.raises(ductile.InvalidArgumentError, match="max_tokens = 9"):
        sampler.load_state_dict(other.state_dict())
    with pytest.raises(ductile.InvalidArgumentError, match="not a DynamicBatchSampler"):
        sampler.load_state_dict(json.loads("{}"))
