"""ductile.elasticity against DeepSpeed's own answers (tests/data/reference,
DeepSpeed at edaa722) and against `ductile elastic --json`, on every vector;
the exception classes; out-of-tree policies by name; the scheduler contract."""

import json

import pytest

import ductile
from ductile.elasticity import (ElasticityConfigError, ElasticityError,
                                ElasticityIncompatibleWorldSize, compute_elastic_config,
                                elasticity_enabled, ensure_immutable_elastic_config)
from conftest import OUT_OF_TREE, data, read_jsonl, run_cli

# Where DeepSpeed crashes with a plain Python error, ductile raises its own
# (plugins/elasticity/README.md).
EXPECTED_CLASS = {
    "ElasticityConfigError": ElasticityConfigError,
    "ElasticityError": ElasticityError,
    "ElasticityIncompatibleWorldSize": ElasticityIncompatibleWorldSize,
    "ValueError": ElasticityConfigError,
    "TypeError": ElasticityError,
    "ZeroDivisionError": ElasticityError,
    "AssertionError": ElasticityError,
}

VECTORS = [(name, i, v) for name in ("elastic_vectors.jsonl", "elastic_deepspeed_unit_cases.jsonl")
           for i, v in enumerate(read_jsonl(data("reference", name)))]


def ours(ds_config, world_size):
    try:
        return compute_elastic_config(ds_config, "0.9.0", world_size), None
    except ElasticityError as e:
        return None, e


def cli(tmp_path, ds_config, world_size):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config))
    args = ["elastic", "--config", path, "--json"]
    if world_size:
        args += ["--world-size", world_size]
    code, out, err = run_cli(*args)
    assert code in (0, 2), err
    return out, str(path)


def test_every_reference_vector_matches_deepspeed_and_the_cli(tmp_path):
    counts = {"results": 0, "errors": 0, "deviations": 0}
    mismatches = []
    for name, i, v in VECTORS:
        where = f"{name}:{i + 1}"
        ds_config, world_size, expect = v["ds_config"], v["world_size"], v["expect"]
        result, error = ours(ds_config, world_size)
        cli_out, cli_path = cli(tmp_path, ds_config, world_size)
        # The CLI: same answer, or same error class and message (its source
        # name is the file; ours is "ds_config").
        if error is not None:
            want = cli_out.get("error", {})
            if type(error).__name__ != want.get("type"):
                mismatches.append(f"{where}: CLI says {want}, Python raised {error!r}")
            elif str(error) != want["message"].replace(cli_path, "ds_config"):
                mismatches.append(f"{where}: message {str(error)!r} != CLI {want['message']!r}")
        elif "error" in cli_out or result[0] != cli_out["final_batch_size"] or \
                list(result[1]) != cli_out["valid_gpus"] or \
                (world_size and result[2] != cli_out["micro_batch_size"]):
            mismatches.append(f"{where}: Python {result} != CLI {cli_out}")
        # DeepSpeed.
        if "error" in expect:
            counts["errors"] += 1
            cls = EXPECTED_CLASS[expect["error"]]
            if type(error) is not cls:
                mismatches.append(f"{where}: DeepSpeed raises {expect['error']} (ours: "
                                  f"{cls.__name__}), we gave {result or repr(error)}")
            continue
        if expect["final_batch_size"] == 0:
            # Documented deviation: DeepSpeed's v0.2 answers a batch of 0;
            # the CLI comparison above covers these.
            counts["deviations"] += 1
            continue
        counts["results"] += 1
        if error is not None:
            mismatches.append(f"{where}: DeepSpeed answers {expect}, we raised {error!r}")
            continue
        if result[0] != expect["final_batch_size"] or list(result[1]) != expect["valid_gpus"]:
            mismatches.append(f"{where}: DeepSpeed {expect} != ours {result}")
        if world_size:
            assert len(result) == 3
            if result[2] != expect["micro_batch_size"]:
                mismatches.append(f"{where}: micro batch {result[2]} != {expect}")
        else:
            assert len(result) == 2
    assert not mismatches, "\n".join(mismatches[:20])
    assert counts["results"] > 100 and counts["errors"] > 100
    assert counts["results"] + counts["errors"] + counts["deviations"] == len(VECTORS) == 318


BASIC = {"elasticity": {"enabled": True, "max_train_batch_size": 10000,
                        "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32, "max_gpus": 1500,
                        "min_time": 20, "version": 0.1}}


def test_return_shapes_follow_deepspeed():
    final, valid = compute_elastic_config(BASIC, "0.3.8")
    assert (final, valid[:3]) == (9792, [32, 34, 36])
    assert compute_elastic_config(BASIC, "0.9.0", world_size=64) == (9792, valid, 17)
    # v0.1 with return_microbatch and no world size: WORLD_SIZE, as DeepSpeed
    # 0.19.7 reads it (older releases divided by 0).
    with pytest.raises(ElasticityConfigError, match="needs WORLD_SIZE"):
        compute_elastic_config(BASIC, "0.9.0", return_microbatch=True)
    v2 = {"elasticity": dict(BASIC["elasticity"], version=0.2, num_gpus_per_node=4)}
    final, valid, micro = compute_elastic_config(v2, "0.9.0", world_size=64, return_microbatch=True)
    assert final % (micro * 64) == 0


def test_a_micro_batch_without_a_world_size_reads_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "64")
    assert compute_elastic_config(BASIC, "0.9.0", return_microbatch=True) == \
        compute_elastic_config(BASIC, "0.9.0", world_size=64)
    monkeypatch.setenv("WORLD_SIZE", "33")
    with pytest.raises(ElasticityIncompatibleWorldSize):
        compute_elastic_config(BASIC, "0.9.0", return_microbatch=True)
    monkeypatch.setenv("WORLD_SIZE", "lots")
    with pytest.raises(ElasticityConfigError, match="it is 'lots'"):
        compute_elastic_config(BASIC, "0.9.0", return_microbatch=True)


def test_v02_reads_world_size_from_the_environment(monkeypatch):
    v2 = {"elasticity": dict(BASIC["elasticity"], version=0.2)}
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ElasticityConfigError, match="world size"):
        compute_elastic_config(v2, "0.9.0")
    monkeypatch.setenv("WORLD_SIZE", "64")
    final, valid, micro = compute_elastic_config(v2, "0.9.0", return_microbatch=True)
    assert (final, valid, micro) == compute_elastic_config(v2, "0.9.0", world_size=64)


def test_deepspeed_argument_errors():
    with pytest.raises(ValueError, match="Expected ds_config to be a dictionary"):
        compute_elastic_config("not a dict", "0.9.0")
    with pytest.raises(ElasticityConfigError, match="'elasticity' is missing"):
        compute_elastic_config({"train_batch_size": 8}, "0.9.0")
    with pytest.raises(ElasticityConfigError, match="disabled"):
        compute_elastic_config({"elasticity": dict(BASIC["elasticity"], enabled=False)}, "0.9.0")
    with pytest.raises(ElasticityError, match="minimum version 0.3.8"):
        compute_elastic_config(BASIC, "0.3.7")
    with pytest.raises(ElasticityError, match="not a version"):
        compute_elastic_config(BASIC, "latest")
    bad = {"elasticity": dict(BASIC["elasticity"], micro_batch_sizes="8")}
    with pytest.raises(ElasticityConfigError, match="micro_batch_sizes") as info:
        compute_elastic_config(bad, "0.9.0")
    # DeepSpeed's class hierarchy, and ductile's built-in bases.
    assert isinstance(info.value, ElasticityError) and isinstance(info.value, ValueError)
    assert issubclass(ElasticityIncompatibleWorldSize, ElasticityError)
    assert ductile.ElasticityConfigError is ElasticityConfigError


def test_elasticity_enabled():
    assert elasticity_enabled(BASIC) is True
    assert elasticity_enabled({"train_batch_size": 4}) is False
    assert elasticity_enabled({"elasticity": {"max_train_batch_size": 4}}) is False


def test_any_policy_by_name_including_out_of_tree(tmp_path):
    optimal = {"elasticity": dict(BASIC["elasticity"], policy="optimal")}
    optimal["elasticity"].pop("version")
    final, valid = compute_elastic_config(optimal, "0.9.0")
    assert len(valid) >= len(compute_elastic_config(BASIC, "0.9.0")[1])
    pow2 = {"elasticity": {"enabled": True, "policy": "pow2", "max_train_batch_size": 1000,
                           "min_gpus": 2, "max_gpus": 64}}
    with pytest.raises(ductile.NotFoundError, match="pow2"):
        compute_elastic_config(pow2, "0.9.0")
    final, valid, micro = compute_elastic_config(pow2, "0.9.0", world_size=16,
                                                 plugin_path=[OUT_OF_TREE])
    path = tmp_path / "pow2.json"
    path.write_text(json.dumps(pow2))
    code, out, err = run_cli("--plugin-path", OUT_OF_TREE, "elastic", "--config", path,
                             "--world-size", 16, "--json")
    assert code == 0, err
    assert (final, valid, micro) == (out["final_batch_size"], out["valid_gpus"],
                                     out["micro_batch_size"])
    assert all(g & (g - 1) == 0 for g in valid)
    # And from TOML, through [plugins] path.
    toml = tmp_path / "pow2.toml"
    toml.write_text(f'[plugins]\npath = ["{OUT_OF_TREE}"]\n[elasticity]\npolicy = "pow2"\n'
                    "max_train_batch_size = 1000\nmicro_batch_size = 4\nmin_gpus = 2\n"
                    "max_gpus = 64\n")
    with pytest.raises(ductile.ConfigError, match="allow_config_plugins=True"):
        ductile.elasticity.load(toml)  # the file's own plugin folder: not without consent
    policy = ductile.elasticity.load(toml, allow_config_plugins=True)
    r = policy.compute(world_size=16)
    code, out, err = run_cli("elastic", "--config", toml, "--world-size", 16, "--json")
    assert code == 0, err
    assert (r.final_batch_size, r.valid_gpus, r.micro_batch_size) == (
        out["final_batch_size"], out["valid_gpus"], out["micro_batch_size"])


def test_out_of_tree_policy_bound_is_checked_by_the_schema(tmp_path):
    # The sample declares max_train_batch_size >= 1 with its flag set: 0 is
    # refused at the key by the schema, before the policy's own checks run
    # (without the flag its hook would blame micro_batch_size instead).
    toml = tmp_path / "pow2.toml"
    toml.write_text('[elasticity]\npolicy = "pow2"\nmax_train_batch_size = 0\n')
    with pytest.raises(ductile.ConfigError) as info:
        ductile.elasticity.load(toml, plugin_path=[OUT_OF_TREE])
    assert "max_train_batch_size = 0 is out of range: must be >= 1" in str(info.value)
    code, out, err = run_cli("--plugin-path", OUT_OF_TREE, "config", "check", toml,
                             check_json=False)
    assert code == 2, out
    assert (f"{toml}:3:24: [elasticity] max_train_batch_size = 0 is out of range: must be >= 1"
            in err), err
    toml.write_text('[elasticity]\npolicy = "pow2"\nmax_train_batch_size = 1\n')
    code, out, err = run_cli("--plugin-path", OUT_OF_TREE, "config", "check", toml,
                             check_json=False)
    assert code == 0, err


def test_toml_config_errors_carry_the_cli_message(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('[elasticity]\npolicy = "v0.1"\nmax_train_batch_size = "big"\n'
                    "micro_batch_sizes = [2, 4]\nmin_gpu = 1\n")
    with pytest.raises(ductile.ConfigError) as info:
        ductile.elasticity.load(toml)
    code, out, err = run_cli("elastic", "--config", toml, "--json")
    assert code == 2
    assert str(info.value) == out["error"]["message"]
    assert len(info.value.diagnostics) == 2 and "min_gpu" in str(info.value)


def test_scheduler_contract(monkeypatch):
    block = BASIC["elasticity"]
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(block))
    ensure_immutable_elastic_config(block)
    other = dict(block, max_train_batch_size=2000)
    with pytest.raises(ElasticityConfigError, match="max_train_batch_size=10000.*2000"):
        ensure_immutable_elastic_config(other)
    policy = ductile.elasticity.load(BASIC)
    assert policy.check_scheduler() is True
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(other))
    with pytest.raises(ElasticityConfigError):
        policy.check_scheduler()
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", "")
    assert policy.check_scheduler() is False


def test_native_result_has_every_field():
    r = ductile.elasticity.load(BASIC).compute(world_size=64)
    assert r.micro_batch_size * r.gradient_accumulation_steps * r.data_parallel_size == \
        r.final_batch_size
    assert r.valid_dp_sizes == r.valid_gpus and r.fallback is False


@pytest.mark.parametrize("world_size, message", [
    ("8", "world_size = '8' is not an integer \\(str\\); give an int"),
    (True, "world_size = True is not an integer \\(bool\\)"),
    (8.0, "world_size = 8.0 is not an integer \\(float\\)"),
])
def test_world_size_is_an_integer(world_size, message):
    config = {"elasticity": {"enabled": True, "max_train_batch_size": 2000,
                             "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 64}}
    with pytest.raises(ductile.InvalidArgumentError, match=message):
        compute_elastic_config(config, "0.9.0", world_size)


def test_a_key_given_twice_in_a_deepspeed_json_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"elasticity": {"enabled": true, "max_train_batch_size": 2000, '
                    '"micro_batch_sizes": [2, 4], "max_gpus": 64, "min_gpus": 1, '
                    '"max_gpus": 8}}')
    code, _, err = run_cli("elastic", "--config", str(path), check_json=False)
    assert code == 2
    assert (f'{path}: key "max_gpus" appears twice in one object; each key may be given once'
            in err)


@pytest.mark.parametrize("policy", ["v0.1", "v0.2", "optimal"])
def test_max_train_batch_size_range_is_one_check_with_the_cli_message(tmp_path, policy):
    # Checked once, by the policy when it is created; compute() plans from
    # the checked values and raises nothing new about them.
    block = {"enabled": True, "policy": policy, "micro_batch_sizes": [2, 4]}
    for cap, says in ((0, "is invalid: must be >= 1"),
                      (2 ** 62 + 1, "is too large: must be <= 2^62 (4611686018427387904)")):
        ds_config = {"elasticity": dict(block, max_train_batch_size=cap)}
        with pytest.raises(ElasticityConfigError) as info:
            compute_elastic_config(ds_config, "0.9.0", world_size=8)
        assert str(info.value) == f"elasticity ({policy}): max_train_batch_size = {cap} {says}"
        out, _ = cli(tmp_path, ds_config, 8)
        assert out["error"] == {"type": "ElasticityConfigError", "message": str(info.value)}
    plan = ductile.elasticity.load({"elasticity": dict(block, max_train_batch_size=100)}).compute(
        world_size=8 if policy == "v0.2" else 0)
    assert 0 < plan.final_batch_size <= 100
