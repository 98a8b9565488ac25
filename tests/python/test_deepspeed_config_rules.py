"""DeepSpeedConfig's elasticity rules (pipeline/src/elasticity/deepspeed_rules.cpp)
against DeepSpeed 0.19.7's own DeepSpeedConfig, run live in this process: an
elasticity block beside the batch keys (ignore_non_elastic_batch_info absent,
false, true), disabled blocks (non-elastic jobs), the scheduler's copy in
DEEPSPEED_ELASTICITY_CONFIG, model-parallel sizes and world sizes outside the
valid list. Each config goes through `ductile elastic --json`, `ductile config
check`, ductile.elasticity.deepspeed_config_plan and ductile.load_config:
each accepts exactly when DeepSpeed does, and when both accept, the batch,
micro batch and gradient accumulation steps agree.

DeepSpeedConfig reads the world size from its mpu (the data-parallel size)
once a process group exists: one process in a gloo group is enough.
`ductile elastic --world-size` is the total GPU count, model-parallel ranks
included, so it is given data-parallel size x model_parallel_size."""

import copy
import json
import logging
import os
import subprocess

import pytest
import torch.distributed as torch_dist

import ductile
from ductile.elasticity import deepspeed_config_plan
from conftest import CLI

SCHEDULER_ENV = "DEEPSPEED_ELASTICITY_CONFIG"
# DeepSpeedConfig's messages for its batch keys (the elasticity block beside
# them; none given; their product not the batch).
DEEPSPEED_BATCH_RULES = ("One or more batch related parameters were found",
                         "Either train_batch_size or train_micro_batch_size_per_gpu",
                         "Check batch related parameters")

V01 = {"enabled": True, "version": 0.1, "max_train_batch_size": 2000,
       "micro_batch_sizes": [2, 4, 6], "min_gpus": 1, "max_gpus": 64}
V02 = dict(V01, version=0.2)
V02_MP = dict(V02, model_parallel_size=2, num_gpus_per_node=4)
DISABLED = dict(V01, enabled=False)
V01_STRICT = dict(V01, ignore_non_elastic_batch_info=False)
V01_IGNORING = dict(V01, ignore_non_elastic_batch_info=True)
NO_SWITCH = {k: v for k, v in V01.items() if k != "enabled"}  # DeepSpeed's default: disabled


def case(name, config, world_size, *, scheduler=None, model_parallel=1, other_world_size=None):
    """A config, the data-parallel size DeepSpeedConfig sees, the scheduler's
    copy (None: unset), and for a config DeepSpeed refuses only at this
    world size, one where it accepts it (which `config check` must then
    accept: it knows no world size)."""
    return pytest.param(config, world_size, scheduler, model_parallel, other_world_size, id=name)


CASES = [
    case("elastic", {"elasticity": V01}, 4),
    case("train_batch_size, ignore absent", {"train_batch_size": 8, "elasticity": V01}, 4),
    case("micro batch, ignore false", {"train_micro_batch_size_per_gpu": 2,
                                       "elasticity": V01_STRICT}, 4),
    case("accumulation null, ignore absent", {"gradient_accumulation_steps": None,
                                              "elasticity": V01}, 4),
    case("all three, ignore true", {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                    "gradient_accumulation_steps": 2,
                                    "elasticity": V01_IGNORING}, 4),
    case("train_batch_size, ignore true", {"train_batch_size": 8, "elasticity": V01_IGNORING},
         6),
    case("disabled, batch and accumulation", {"train_batch_size": 32,
                                              "gradient_accumulation_steps": 2,
                                              "elasticity": DISABLED}, 4),
    case("disabled, batch not divisible by world size", {"train_batch_size": 32,
                                                         "gradient_accumulation_steps": 2,
                                                         "elasticity": DISABLED}, 3,
         other_world_size=8),
    case("enabled absent, micro batch only", {"train_micro_batch_size_per_gpu": 4,
                                              "elasticity": NO_SWITCH}, 3),
    case("disabled, all three", {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
                                 "gradient_accumulation_steps": 2, "elasticity": DISABLED}, 3),
    case("disabled, all three, other world size", {"train_batch_size": 24,
                                                   "train_micro_batch_size_per_gpu": 4,
                                                   "gradient_accumulation_steps": 2,
                                                   "elasticity": DISABLED}, 2, other_world_size=3),
    case("disabled, no batch", {"elasticity": DISABLED}, 4),
    case("disabled, accumulation only", {"gradient_accumulation_steps": 2,
                                         "elasticity": DISABLED}, 4),
    case("disabled, batch fits no world size", {"train_batch_size": 30,
                                                "train_micro_batch_size_per_gpu": 4,
                                                "elasticity": DISABLED}, 1),
    case("scheduler's copy equal", {"elasticity": V01}, 4, scheduler=V01),
    case("scheduler's copy different", {"elasticity": V01}, 4,
         scheduler=dict(V01, max_train_batch_size=1000)),
    case("scheduler's copy different, disabled job", {"train_batch_size": 16,
                                                      "elasticity": DISABLED}, 4,
         scheduler=dict(V01, max_train_batch_size=1000)),
    case("v0.1 world size outside the valid list", {"elasticity": V01}, 9, other_world_size=8),
    case("v0.1 world size above max_gpus", {"elasticity": V01}, 70, other_world_size=60),
    case("v0.2 world size outside the valid list (fallback)", {"elasticity": V02}, 13),
    case("v0.2 model parallel 2, 4 data-parallel ranks", {"elasticity": V02_MP}, 4,
         model_parallel=2),
    case("v0.2 model parallel 2, 8 data-parallel ranks", {"elasticity": V02_MP}, 8,
         model_parallel=2),
    case("v0.1 model parallel 2", {"elasticity": dict(V01, model_parallel_size=2)}, 4,
         model_parallel=2),
    case("model parallel 0", {"elasticity": dict(V02, model_parallel_size=0)}, 4),
    case("num_gpus_per_node 0", {"elasticity": dict(V02, num_gpus_per_node=0)}, 4),
    case("v0.2 nodes not whole model replicas", {"elasticity": dict(V02, model_parallel_size=2,
                                                                    num_gpus_per_node=3)}, 4,
         model_parallel=2),
]


class DataParallelMpu:
    """The part of an mpu DeepSpeedConfig reads: the data-parallel size."""

    def __init__(self, size):
        self.size = size

    def get_data_parallel_world_size(self):
        return self.size


@pytest.fixture(scope="module")
def deepspeed_config(tmp_path_factory):
    """DeepSpeedConfig with a one-process gloo group (it reads the rank, then
    the mpu's world size)."""
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig
    store = tmp_path_factory.mktemp("gloo") / "store"
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    deepspeed.comm.init_distributed(dist_backend="gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    yield DeepSpeedConfig
    torch_dist.destroy_process_group()


def deepspeed_answer(deepspeed_config, config, world_size):
    """(train_batch_size, micro batch, accumulation) or the exception."""
    try:
        # DeepSpeedConfig writes nothing into the dict; a copy makes sure.
        c = deepspeed_config(copy.deepcopy(config), mpu=DataParallelMpu(world_size))
    except Exception as e:  # DeepSpeed refuses with several classes, AssertionError included
        return None, e
    return (c.train_batch_size, c.train_micro_batch_size_per_gpu,
            c.gradient_accumulation_steps), None


def cli(args, scheduler):
    env = {k: v for k, v in os.environ.items() if k not in (SCHEDULER_ENV,
                                                             "DUCTILE_ELASTICITY_CONFIG")}
    if scheduler is not None:
        env[SCHEDULER_ENV] = json.dumps(scheduler)
    proc = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode in (0, 2), f"ductile {args} exited {proc.returncode}: {proc.stderr}"
    return proc


@pytest.fixture
def scheduler_env(monkeypatch):
    def set_to(scheduler):
        monkeypatch.delenv("DUCTILE_ELASTICITY_CONFIG", raising=False)
        if scheduler is None:
            monkeypatch.delenv(SCHEDULER_ENV, raising=False)
        else:
            monkeypatch.setenv(SCHEDULER_ENV, json.dumps(scheduler))
    return set_to


def batch_of(plan):
    return plan["final_batch_size"], plan["micro_batch_size"], plan["gradient_accumulation_steps"]


@pytest.mark.parametrize("config, world_size, scheduler, model_parallel, other_world_size", CASES)
def test_ductile_accepts_exactly_what_deepspeed_config_accepts(
        deepspeed_config, scheduler_env, tmp_path, config, world_size, scheduler, model_parallel,
        other_world_size):
    scheduler_env(scheduler)
    theirs, their_error = deepspeed_answer(deepspeed_config, config, world_size)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))

    # ductile elastic, for the same job on data-parallel size x model-parallel GPUs.
    run = cli(["elastic", "--config", path, "--world-size", world_size * model_parallel,
               "--json"], scheduler)
    ours = json.loads(run.stdout)
    assert ("error" not in ours) == (their_error is None), (their_error, ours)
    if their_error is None:
        assert run.returncode == 0
        assert batch_of(ours) == theirs
        assert ours["elastic"] is not False or not config["elasticity"].get("enabled", False)
    else:
        assert run.returncode == 2
        assert ours["error"]["type"].startswith("Elasticity"), ours

    # The Python API: the same answer.
    try:
        plan = deepspeed_config_plan(config, world_size * model_parallel)
    except ductile.ElasticityError as e:
        assert their_error is not None, f"DeepSpeed answers {theirs}, ductile raised {e!r}"
        assert type(e).__name__ == ours["error"]["type"]
    else:
        assert their_error is None, f"DeepSpeed raised {their_error!r}, ductile gave {plan}"
        assert batch_of(plan) == theirs

    # config check and load_config know no world size: a config DeepSpeed
    # refuses only at this one is valid (DeepSpeed takes it at another).
    valid_file = their_error is None
    if other_world_size is not None:
        assert their_error is not None
        accepted, error = deepspeed_answer(deepspeed_config, config, other_world_size)
        assert error is None, error
        valid_file = True
    check = cli(["config", "check", path], scheduler)
    assert (check.returncode == 0) == valid_file, (their_error, check.stdout, check.stderr)
    # load_config checks the block beside the batch keys only (the policy's
    # checks and the scheduler's copy wait for ductile.elasticity): it
    # refuses what DeepSpeed refuses for its batch keys at every world size.
    batch_rule = their_error is not None and other_world_size is None and any(
        m in str(their_error) for m in DEEPSPEED_BATCH_RULES)
    try:
        ductile.load_config(config)
    except ductile.ElasticityConfigError as e:
        assert batch_rule, f"load_config raised {e!r}; DeepSpeed: {their_error!r}"
    else:
        assert not batch_rule, f"load_config accepted what DeepSpeed refuses: {their_error!r}"


def test_the_scheduler_copy_is_compared_as_ductile_documents(deepspeed_config, scheduler_env,
                                                             tmp_path):
    # DeepSpeed compares max_train_batch_size, micro_batch_sizes and version
    # only; ductile every key that changes the plan (the schema's, minus
    # those marked param_local), so a scheduler sized for other GPU counts is
    # caught: a documented deviation (plugins/elasticity/README.md).
    config = {"elasticity": V01}
    other = dict(V01, max_gpus=32)
    scheduler_env(other)
    theirs, error = deepspeed_answer(deepspeed_config, config, 4)
    assert error is None and theirs == (1680, 6, 70)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    run = cli(["elastic", "--config", path, "--world-size", 4, "--json"], other)
    assert json.loads(run.stdout)["error"]["type"] == "ElasticityConfigError"
    assert "'max_gpus=32' seen by the resource scheduler does not match 'max_gpus=64'" in \
        run.stdout
    # A key that does not change the plan (param_local) is not compared.
    scheduler_env(dict(V01, min_time=30))
    assert batch_of(deepspeed_config_plan(config, 4)) == theirs


def test_messages_name_the_file_key_value_and_what_is_valid(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2,
                                "elasticity": V01}))
    run = cli(["config", "check", path], None)
    assert run.returncode == 2
    assert (f"{path}: train_batch_size = 8, gradient_accumulation_steps = 2 are set beside an "
            "enabled elasticity block") in run.stderr
    assert "set elasticity.ignore_non_elastic_batch_info = true" in run.stderr
    with pytest.raises(ductile.ElasticityConfigError, match="train_batch_size = 8, "):
        ductile.load_config(json.loads(path.read_text()))
    with pytest.raises(ductile.ElasticityConfigError, match="train_batch_size = 8, "):
        ductile.elasticity.load(path)

    path.write_text(json.dumps({"train_batch_size": 32, "elasticity": DISABLED}))
    run = cli(["elastic", "--config", path, "--world-size", 5, "--json"], None)
    error = json.loads(run.stdout)["error"]
    assert error["type"] == "ElasticityIncompatibleWorldSize"
    assert error["message"] == (
        f"{path}: the non-elastic batch (train_batch_size = 32) does not fit world size 5: "
        "DeepSpeed needs train_batch_size = train_micro_batch_size_per_gpu x "
        "gradient_accumulation_steps x world size, here 32 != 6 x 1 x 5; valid: world sizes "
        "that divide 32")

    path.write_text(json.dumps({"train_batch_size": "32", "elasticity": DISABLED}))
    run = cli(["config", "check", path], None)
    assert run.returncode == 2
    assert (f'{path}: train_batch_size = "32"; valid: an integer from 1 to 2147483647'
            in run.stderr)
    run = cli(["elastic", "--config", path, "--world-size", 4], None)
    assert run.returncode == 2
    assert (f'{path}: train_batch_size = "32" is invalid for a non-elastic job (the elasticity '
            "block is disabled): give an integer >= 1") in run.stderr


def test_a_disabled_block_is_a_non_elastic_job_everywhere(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
              "elasticity": DISABLED}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    # Exit 0 with the batch DeepSpeed trains with; none without a world size
    # here, since it grows with the world size.
    run = cli(["elastic", "--config", path, "--json"], None)
    out = json.loads(run.stdout)
    assert run.returncode == 0
    assert out["elastic"] is False and out["final_batch_size"] is None
    assert out["batch_keys"] == {"train_batch_size": None, "train_micro_batch_size_per_gpu": 4,
                                 "gradient_accumulation_steps": 3}
    human = cli(["elastic", "--config", path, "--world-size", 2], None)
    assert human.returncode == 0
    assert "Elasticity is disabled in" in human.stdout and "a non-elastic job" in human.stdout
    assert "final_batch_size .... 24" in human.stdout
    check = cli(["config", "check", path], None)
    assert check.returncode == 0
    assert "elasticity disabled: a non-elastic job" in check.stdout
    assert "[elasticity]" not in check.stdout
    assert ductile.load_config(config).format == "deepspeed"
    with pytest.raises(ductile.ElasticityConfigError, match="deepspeed_config_plan"):
        ductile.elasticity.load(config)
    run = cli(["elastic", "--config", path, "--micro-batch", "--json"], None)
    assert run.returncode == 2 and "--micro-batch needs --world-size" in run.stdout
