"""ductile.deepspeed.lr_schedules against DeepSpeed's own schedulers
(deepspeed.runtime.lr_schedules, the release pinned in requirements.txt), in
the same process on twin optimizers: every rate and beta of every step equal
to 1e-12 relative, state_dicts that load both ways, and a config's scheduler
block read, checked and built through the DeepSpeed mapping."""

import json
import logging
import os
import warnings

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from deepspeed.runtime import lr_schedules as ds_schedules

from ductile import _ductile
from ductile._errors import ConfigError, IncompatibleError, InvalidArgumentError
from ductile.deepspeed import lr_schedules

# DeepSpeed logs a warning for every rate asked before the first step.
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)

STEPS = 200
REL = 1e-12


def optimizer(group_lrs=(0.05,), kind=torch.optim.Adam):
    """An optimizer with one param group per rate, on fresh parameters."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in group_lrs]
    return kind(groups, lr=group_lrs[0])


def close(ours, theirs):
    if isinstance(theirs, (tuple, list)):
        assert isinstance(ours, (tuple, list)) and len(ours) == len(theirs), (ours, theirs)
        for a, b in zip(ours, theirs):
            close(a, b)
        return
    assert abs(float(ours) - float(theirs)) <= REL * max(abs(float(ours)), abs(float(theirs))), \
        (ours, theirs)


def groups_state(opt):
    return [(g["lr"], g.get("betas")) for g in opt.param_groups]


def same_groups(ours, theirs):
    close([lr for lr, _ in groups_state(ours)], [lr for lr, _ in groups_state(theirs)])
    for (_, a), (_, b) in zip(groups_state(ours), groups_state(theirs)):
        assert (a is None) == (b is None)
        if a is not None:
            close(list(a), list(b))


def twins(type_name, params, group_lrs=(0.05,), kind=torch.optim.Adam):
    """ductile's scheduler and DeepSpeed's, each on its own optimizer."""
    ours_opt, theirs_opt = optimizer(group_lrs, kind), optimizer(group_lrs, kind)
    ours = getattr(lr_schedules, type_name)(ours_opt, **params)
    theirs = getattr(ds_schedules, type_name)(theirs_opt, **params)
    return ours, theirs


def run_twins(ours, theirs, steps=STEPS):
    same_groups(ours.optimizer, theirs.optimizer)
    for _ in range(steps):
        ours.step()
        theirs.step()
        assert ours.last_batch_iteration == theirs.last_batch_iteration
        same_groups(ours.optimizer, theirs.optimizer)
        close(ours.get_last_lr(), theirs.get_last_lr())
        close(ours.get_lr(), theirs.get_lr())
        if isinstance(theirs, ds_schedules.OneCycle) and theirs.cycle_momentum:
            close(ours.get_mom(), theirs.get_mom())
    assert ours.state_dict() == theirs.state_dict()


CASES = [
    ("WarmupLR", {}, (0.05,)),
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.1, "warmup_num_steps": 50}, (0.05,)),
    ("WarmupLR", {"warmup_num_steps": 60, "warmup_type": "linear"}, (0.05, 0.2)),
    ("WarmupLR", {"warmup_num_steps": 1}, (0.05,)),
    ("WarmupLR", {"warmup_min_lr": [0.0, 0.01], "warmup_max_lr": [0.1, 0.3],
                  "warmup_num_steps": 40, "warmup_type": "log"}, (0.05, 0.2)),
    ("WarmupDecayLR", {"total_num_steps": 150}, (0.05,)),
    ("WarmupDecayLR", {"total_num_steps": 180, "warmup_min_lr": 1e-4, "warmup_max_lr": 0.02,
                       "warmup_num_steps": 30, "warmup_type": "linear"}, (0.05,)),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 50}, (0.05,)),
    ("WarmupDecayLR", {"total_num_steps": 120, "warmup_max_lr": None, "warmup_num_steps": 25},
     (0.05, 0.3)),
    ("WarmupDecayLR", {"total_num_steps": 160, "warmup_min_lr": [0.001, 0.0],
                       "warmup_max_lr": [0.01, 0.04], "warmup_num_steps": 10}, (0.05, 0.2)),
    ("WarmupCosineLR", {"total_num_steps": 150}, (0.05,)),
    ("WarmupCosineLR", {"total_num_steps": 170, "warmup_num_steps": 30, "warmup_type": "linear",
                        "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}, (0.05, 0.2)),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 40}, (0.05,)),
    ("WarmupCosineLR", {"total_num_steps": 100, "warmup_num_steps": 1, "cos_min_ratio": 0.0},
     (0.03,)),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}, (0.05,)),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 40,
                  "cycle_second_step_size": 60, "decay_step_size": 10, "decay_lr_rate": 0.1,
                  "decay_mom_rate": 0.01}, (0.05,)),
    ("OneCycle", {"cycle_min_lr": [0.001, 0.002], "cycle_max_lr": [0.01, 0.05],
                  "cycle_first_step_size": 30, "cycle_second_step_size": 45,
                  "cycle_first_stair_count": 4, "cycle_second_stair_count": 3,
                  "decay_step_size": 7, "decay_lr_rate": 0.5, "cycle_min_mom": [0.85, 0.8],
                  "cycle_max_mom": [0.95, 0.9], "decay_mom_rate": 0.001}, (0.05, 0.2)),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 33,
                  "cycle_first_stair_count": 5, "cycle_momentum": False,
                  "decay_step_size": 3, "decay_lr_rate": 0.02}, (0.05,)),
    ("OneCycle", {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 50,
                  "cycle_second_step_size": 0}, (0.05,)),
    ("LRRangeTest", {}, (0.05,)),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 20,
                     "lr_range_test_step_rate": 0.5}, (0.05,)),
    ("LRRangeTest", {"lr_range_test_min_lr": [1e-4, 1e-3], "lr_range_test_step_size": 17,
                     "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True},
     (0.05, 0.2)),
]


@pytest.mark.parametrize("type_name,params,group_lrs", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rates_and_betas_equal_deepspeed_at_every_step(type_name, params, group_lrs):
    ours, theirs = twins(type_name, params, group_lrs)
    run_twins(ours, theirs)


def test_one_cycle_on_an_optimizer_without_betas_cycles_no_momentum():
    ours, theirs = twins("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                      "cycle_first_step_size": 20}, kind=torch.optim.SGD)
    assert not ours.cycle_momentum and not theirs.cycle_momentum
    assert ours.get_mom() is None
    run_twins(ours, theirs, steps=60)
    assert all("betas" not in g for g in ours.optimizer.param_groups)


def test_explicit_steps_and_a_scheduler_made_mid_run_follow_deepspeed():
    params = {"total_num_steps": 90, "warmup_num_steps": 20, "last_batch_iteration": 35}
    ours, theirs = twins("WarmupDecayLR", params)
    same_groups(ours.optimizer, theirs.optimizer)  # made mid-run: the rates are not touched
    with pytest.raises(IncompatibleError, match="call step"):
        ours.get_last_lr()
    with pytest.raises(AssertionError):
        theirs.get_last_lr()
    run_twins(ours, theirs, steps=80)
    for index in (5, 0, -1, 150):
        ours.step(index)
        theirs.step(index)
        same_groups(ours.optimizer, theirs.optimizer)
    ours, theirs = twins("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                      "cycle_first_step_size": 10})
    with pytest.raises(IncompatibleError):  # DeepSpeed's OneCycle sets no last rate when made
        ours.get_last_lr()
    ours.step(batch_iteration=12)
    theirs.step(batch_iteration=12)
    same_groups(ours.optimizer, theirs.optimizer)


@pytest.mark.parametrize("type_name,params,group_lrs", [CASES[4], CASES[9], CASES[12], CASES[16],
                                                        CASES[21]])
def test_state_dict_round_trips_and_loads_both_ways(type_name, params, group_lrs):
    reference, _ = twins(type_name, params, group_lrs)
    for _ in range(120):
        reference.step()
    expected = groups_state(reference.optimizer)

    def resumed(saver, loader_module):
        for _ in range(70):
            saver.step()
        loader = getattr(loader_module, type_name)(optimizer(group_lrs), **params)
        loader.load_state_dict(saver.state_dict())
        assert loader.last_batch_iteration == 69
        for _ in range(50):
            loader.step()
        return loader

    for saver_module in (lr_schedules, ds_schedules):
        for loader_module in (lr_schedules, ds_schedules):
            saver = getattr(saver_module, type_name)(optimizer(group_lrs), **params)
            loader = resumed(saver, loader_module)
            got = groups_state(loader.optimizer)
            close([lr for lr, _ in got], [lr for lr, _ in expected])
            for (_, a), (_, b) in zip(got, expected):
                if b is not None:
                    close(list(a), list(b))
    assert set(reference.state_dict()) == set(
        getattr(ds_schedules, type_name)(optimizer(group_lrs), **params).state_dict())


def test_load_state_dict_refuses_a_damaged_state():
    scheduler = lr_schedules.WarmupLR(optimizer())
    with pytest.raises(InvalidArgumentError, match="last_batch_iteration"):
        scheduler.load_state_dict({"step": 3})
    with pytest.raises(InvalidArgumentError, match=r"last_batch_iteration = -4; valid"):
        scheduler.load_state_dict({"last_batch_iteration": -4})


@pytest.mark.parametrize("type_name,params,message", [
    ("WarmupLR", {"warmup_num_steps": -1}, r"^warmup_num_steps = -1; valid: an integer >= 1$"),
    ("WarmupLR", {"warmup_num_steps": 10.0}, r"warmup_num_steps = 10\.0; valid: an integer"),
    ("WarmupLR", {"warmup_type": "cosine"}, r"warmup_type = \"cosine\"; valid: \"log\" or"),
    ("WarmupLR", {"warmup_min_lr": True}, r"warmup_min_lr = true; valid: a number >= 0"),
    ("WarmupLR", {"warmup_max_lr": [0.1, 0.2, 0.3]},
     r"warmup_max_lr = \[0\.1,0\.2,0\.3\] has 3 values, but the optimizer has 2 param groups"),
    ("WarmupDecayLR", {"total_num_steps": -5}, r"total_num_steps = -5; valid: an integer >= 0"),
    ("WarmupCosineLR", {"total_num_steps": 10, "cos_min_ratio": float("nan")},
     r"^cos_min_ratio = nan; valid: a finite number$"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0},
     r"cycle_first_step_size = 0; valid: a number > 0"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_max_mom": 1.5},
     r"cycle_max_mom = 1\.5; valid: a number in \[0, 1\)"),
    ("LRRangeTest", {"lr_range_test_step_size": 0}, r"lr_range_test_step_size = 0; valid"),
    ("LRRangeTest", {"last_batch_iteration": -3}, r"last_batch_iteration = -3; valid: an"),
])
def test_bad_arguments_name_the_argument_its_value_and_what_is_valid(type_name, params, message):
    with pytest.raises(InvalidArgumentError, match=message):
        getattr(lr_schedules, type_name)(optimizer((0.05, 0.1)), **params)


def from_deepspeed(config):
    return _ductile.Runtime.from_deepspeed(json.dumps(config), "ds.json", read_training=True)


def test_the_mapping_reads_the_scheduler_block_and_builds_deepspeeds_scheduler():
    block = {"type": "WarmupDecayLR",
             "params": {"total_num_steps": 140, "warmup_min_lr": "auto", "warmup_max_lr": 0.01,
                        "warmup_num_steps": 25, "warmup_type": "linear", "gamma": 0.5}}
    _, warnings_, training = from_deepspeed({"train_batch_size": 4, "scheduler": block})
    scheduler = training["scheduler"]
    assert scheduler["type"] == "WarmupDecayLR"
    assert scheduler["params"]["total_num_steps"] == 140
    assert scheduler["params"]["warmup_type"] == "linear"
    assert scheduler["params"]["warmup_min_lr"] == lr_schedules.WarmupDecayLR(
        optimizer(), 1).params["warmup_min_lr"]  # "auto": DeepSpeed's default
    assert "gamma" not in scheduler["params"]
    assert any("ds.json: scheduler.params.gamma is accepted but ignored: WarmupDecayLR has no "
               "such parameter" in w for w in warnings_), warnings_
    ours = lr_schedules.scheduler_from_config(scheduler, optimizer())
    given = {k: v for k, v in block["params"].items() if k not in ("gamma", "warmup_min_lr")}
    theirs = ds_schedules.WarmupDecayLR(optimizer(), **given)
    assert isinstance(ours, lr_schedules.WarmupDecayLR)
    run_twins(ours, theirs, steps=160)

    _, _, training = from_deepspeed({"train_batch_size": 4})
    assert training["scheduler"] is None
    assert lr_schedules.scheduler_from_config(None, optimizer()) is None


def test_one_cycle_from_a_config_cycles_betas_as_deepspeed():
    block = {"type": "OneCycle",
             "params": {"cycle_min_lr": [0.001, 0.002], "cycle_max_lr": 0.01,
                        "cycle_first_step_size": 15, "cycle_second_stair_count": 2,
                        "decay_step_size": 4, "decay_mom_rate": 0.01, "decay_lr_rate": 0.1}}
    _, _, training = from_deepspeed({"scheduler": block})
    assert training["scheduler"]["params"]["cycle_min_lr"] == [0.001, 0.002]
    ours = lr_schedules.scheduler_from_config(training["scheduler"], optimizer((0.05, 0.1)))
    theirs = ds_schedules.OneCycle(optimizer((0.05, 0.1)), **block["params"])
    run_twins(ours, theirs, steps=80)


@pytest.mark.parametrize("block,message", [
    ({"type": "WarmupLR", "params": {"warmup_num_steps": -1}},
     "scheduler.params.warmup_num_steps = -1; valid: an integer >= 1"),
    ({"type": "warmuplr"}, 'scheduler.type = "warmuplr"; valid: "WarmupLR", "WarmupDecayLR", '
                           '"WarmupCosineLR", "OneCycle", "LRRangeTest"'),
    ({"params": {}}, "scheduler.type is missing; valid: \"WarmupLR\""),
    ({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}},
     "scheduler.params.total_num_steps is missing; WarmupCosineLR needs it: an integer >= 0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": "0.1", "cycle_max_lr": 1}},
     'scheduler.params.cycle_min_lr = "0.1"; valid: a number >= 0, or a list of them'),
    ({"type": "LRRangeTest", "params": [1]}, "scheduler.params must be an object, got [1]"),
])
def test_a_bad_scheduler_block_is_a_config_error_naming_the_key(block, message):
    with pytest.raises(ConfigError) as error:
        from_deepspeed({"scheduler": block})
    assert message in str(error.value)


def test_the_binding_reads_a_params_dict_as_the_mapping_does():
    schedule = _ductile.lr_schedules.DeepSpeedSchedule(
        "WarmupCosineLR", {"total_num_steps": 50, "warmup_num_steps": "auto"}, [0.1, 0.2])
    assert schedule.params["warmup_num_steps"] == 1000  # DeepSpeed's default
    assert schedule.groups == 2
    assert schedule.initial_lrs() == [0.0, 0.0]
    with pytest.raises(InvalidArgumentError, match="scheduler.params.total_num_steps is missing"):
        _ductile.lr_schedules.DeepSpeedSchedule("WarmupCosineLR", {}, [0.1],
                                                key_prefix="scheduler.params.")
    with pytest.raises(InvalidArgumentError, match="last_batch_iteration = 1.5"):
        schedule.lrs(1.5)
