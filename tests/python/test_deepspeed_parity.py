"""Live parity with DeepSpeed (the release pinned in requirements.txt), in the
same process: hypothesis draws elasticity configurations with world sizes,
and packing inputs, and ductile's answer must equal DeepSpeed's, or follow
the documented deviations where DeepSpeed crashes or answers a batch of 0
(plugins/elasticity/README.md; DeepSpeed's packer never emits its final group
of samples, ours does: tests/data/reference/README.md).

The stored reference vectors (tests/data/reference, from DeepSpeed at
edaa722) stay the offline regression set (test_elasticity.py,
test_batching.py); here they are also checked against the live DeepSpeed.

Seeded: DUCTILE_HYPOTHESIS_SEED (an integer, or "random"; default 20261123)
picks the examples; a failure names the seed that reproduces it.
"""

import logging
import os
import random
import warnings

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import ductile
from conftest import data, read_jsonl
from ductile import batching
from ductile.elasticity import (ElasticityConfigError, ElasticityError,
                                ElasticityIncompatibleWorldSize, compute_elastic_config)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import deepspeed
    from deepspeed.elasticity import compute_elastic_config as deepspeed_compute_elastic_config
    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import \
        batch_by_seqlens as deepspeed_batch_by_seqlens

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)

EXAMPLES = 2000
_seed_text = os.environ.get("DUCTILE_HYPOTHESIS_SEED", "20261123")
SEED = random.SystemRandom().randrange(2**32) if _seed_text == "random" else int(_seed_text)

# Where DeepSpeed crashes with a plain Python error, ductile raises its own
# (the same mapping as tests/plugins/elasticity/parity_test.cpp).
DEEPSPEED_CRASHES = {
    "ValueError": ElasticityConfigError,
    "TypeError": ElasticityError,
    "ZeroDivisionError": ElasticityError,
    "AssertionError": ElasticityError,
}
DEEPSPEED_ERRORS = {
    "ElasticityConfigError": ElasticityConfigError,
    "ElasticityError": ElasticityError,
    "ElasticityIncompatibleWorldSize": ElasticityIncompatibleWorldSize,
}


def seeded(test):
    """EXAMPLES examples from SEED (counted: hypothesis may not stop short);
    a failure gets the seed as a note."""
    run = seed(SEED)(settings(max_examples=EXAMPLES, deadline=None, database=None,
                              suppress_health_check=[HealthCheck.too_slow])(test))
    inner, calls = run.hypothesis.inner_test, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)
    run.hypothesis.inner_test = counted

    def wrapper(*args, **kwargs):
        calls[0] = 0
        try:
            run(*args, **kwargs)
        except BaseException as e:
            e.add_note(f"hypothesis seed {SEED}: rerun with DUCTILE_HYPOTHESIS_SEED={SEED}")
            raise
        assert calls[0] >= EXAMPLES, f"hypothesis ran {calls[0]} examples, not {EXAMPLES}"
        print(f"{test.__name__}: {calls[0]} examples, seed {SEED}")
    wrapper.__name__ = test.__name__
    wrapper.__doc__ = test.__doc__
    return wrapper


def deepspeed_outcome(call, *args, **kwargs):
    """(result, None) or (None, the exception class's name)."""
    try:
        return call(*args, **kwargs), None
    except Exception as e:  # DeepSpeed's crashes are part of what is compared
        return None, type(e).__name__


@pytest.fixture(autouse=True)
def no_world_size_in_the_environment(monkeypatch):
    # v0.2 reads WORLD_SIZE when no world size is given, in both.
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_the_stored_vectors_agree_with_the_pinned_deepspeed():
    """The stored vectors came from DeepSpeed at edaa722; the pinned release
    gives the same answers, but for one form: where edaa722 raised TypeError
    (no candidate batch has a valid GPU count) and no world size is given,
    0.19.7 returns the batch with None for the list of valid GPU counts."""
    assert deepspeed.__version__ == "0.19.7"
    none_lists = 0
    for name in ("elastic_vectors.jsonl", "elastic_deepspeed_unit_cases.jsonl"):
        for i, v in enumerate(read_jsonl(data("reference", name))):
            result, error = deepspeed_outcome(
                deepspeed_compute_elastic_config, v["ds_config"], "0.9.0",
                world_size=v["world_size"])
            expect = v["expect"]
            where = f"{name}:{i + 1}"
            if expect.get("error") == "TypeError" and error is None:
                assert result[1] is None and v["world_size"] == 0, where
                none_lists += 1
            elif "error" in expect:
                assert error == expect["error"], where
            else:
                assert error is None, f"{where}: {error}"
                assert result[0] == expect["final_batch_size"], where
                assert result[1] == expect["valid_gpus"], where
                if v["world_size"]:
                    assert result[2] == expect["micro_batch_size"], where
    assert none_lists == 4
    for i, v in enumerate(read_jsonl(data("reference", "pack_vectors.jsonl"))):
        result, error = deepspeed_outcome(deepspeed_batch_by_seqlens, v["seqlens"], **v["args"])
        if "error" in v["expect"]:
            assert error == v["expect"]["error"], f"pack_vectors.jsonl:{i + 1}"
        else:
            ids, sizes, longest = result
            assert ([[b, list(m)] for b, m in ids], sizes, longest) == (
                v["expect"]["microbatch_ids"], v["expect"]["batch_sizes"],
                v["expect"]["batch_max_seqlens"]), f"pack_vectors.jsonl:{i + 1}"


@st.composite
def elastic_cases(draw):
    """An elasticity block (v0.1 or v0.2, every key DeepSpeed reads, most
    optional), a world size (0: none) and return_microbatch."""
    version = draw(st.sampled_from([0.1, 0.2]))
    cap = draw(st.integers(1, 5000))
    micro = draw(st.lists(st.integers(1, 64), min_size=1, max_size=4))
    block = {"enabled": True, "max_train_batch_size": cap, "micro_batch_sizes": micro,
             "version": version}
    if draw(st.booleans()):
        block["min_gpus"] = draw(st.integers(1, 64))
    if draw(st.booleans()):
        block["max_gpus"] = draw(st.integers(block.get("min_gpus", 1), 2000))
    if draw(st.booleans()):
        block["prefer_larger_batch"] = draw(st.booleans())
    if draw(st.booleans()):
        block["min_time"] = draw(st.integers(0, 100))
    if version == 0.2 and draw(st.booleans()):
        block["num_gpus_per_node"] = draw(st.integers(1, 8))
    if draw(st.integers(0, 7)) == 0:
        block["model_parallel_size"] = draw(st.integers(1, 4))
    world_size = draw(st.one_of(st.just(0), st.integers(1, 256)))
    return {"elasticity": block}, world_size, draw(st.booleans())


def check_fallback(block, world_size, ours, error):
    """v0.2 with a world size outside the valid list: the fallback batch of
    the micro batches that fit once (micro x world size <= cap), valid only
    for that world size, or ElasticityIncompatibleWorldSize when none fits."""
    cap, micro = block["max_train_batch_size"], block["micro_batch_sizes"]
    if not any(m * world_size <= cap for m in micro):
        assert error is ElasticityIncompatibleWorldSize, (ours, error)
        return
    assert error is None, error
    final, valid, chosen = ours
    assert 0 < final <= cap and valid == [world_size]
    assert any(final % (m * world_size) == 0 for m in micro)
    assert chosen == max(m for m in micro if (final // world_size) % m == 0)


def check_model_parallel(block, world_size, ours, error):
    """v0.2 with model_parallel_size > 1: DeepSpeed divides by it twice and
    rejects (nearly) every world size. ductile takes the world size as GPUs,
    runs world size / mp data-parallel ranks, and answers GPU counts."""
    mp, cap = block["model_parallel_size"], block["max_train_batch_size"]
    if error is not None:
        assert error in (ElasticityIncompatibleWorldSize, ElasticityConfigError), error
        return
    final, valid, chosen = ours
    assert world_size in valid and world_size % mp == 0
    assert 0 < final <= cap and final % (chosen * (world_size // mp)) == 0


def deepspeed_float_rounds(block, world_size):
    """DeepSpeed's v0.2 fallback takes (world / gpn) * dp_per_node in
    floating point: (251 / 7) * 7 is 250.99999999999997, so it rejects world
    size 251 where the exact data-parallel size is 251."""
    gpn = block.get("num_gpus_per_node", 1)
    per_node = gpn // block.get("model_parallel_size", 1)
    return per_node > 0 and int((world_size / gpn) * per_node) != world_size * per_node // gpn


@seeded
@given(elastic_cases())
def test_compute_elastic_config_equals_deepspeed(case):
    ds_config, world_size, return_microbatch = case
    block = ds_config["elasticity"]
    expect, ds_error = deepspeed_outcome(deepspeed_compute_elastic_config, ds_config, "0.9.0",
                                         world_size=world_size,
                                         return_microbatch=return_microbatch)
    try:
        ours, error = compute_elastic_config(ds_config, "0.9.0", world_size=world_size,
                                             return_microbatch=return_microbatch), None
    except ElasticityError as e:
        ours, error = None, type(e)
    v02_model_parallel = block["version"] == 0.2 and block.get("model_parallel_size", 1) > 1
    if ds_error == "ElasticityIncompatibleWorldSize" and v02_model_parallel:
        check_model_parallel(block, world_size, ours, error)
    elif ds_error == "ElasticityIncompatibleWorldSize" and block["version"] == 0.2 and \
            deepspeed_float_rounds(block, world_size):
        check_fallback(block, world_size, ours, error)
    elif ds_error == "ElasticityConfigError" and world_size == 0 and block["version"] == 0.2 \
            and block.get("num_gpus_per_node", 1) % block.get("model_parallel_size", 1):
        # The configuration is checked before the world size: DeepSpeed
        # reports the missing WORLD_SIZE first, ductile the node size that is
        # not a multiple of the model-parallel size (DeepSpeed's ElasticityError).
        assert error is ElasticityError, error
    elif ds_error is not None:
        want = DEEPSPEED_ERRORS.get(ds_error) or DEEPSPEED_CRASHES.get(ds_error)
        assert want is not None, f"DeepSpeed raised {ds_error}, a case no deviation covers"
        assert error is want, f"DeepSpeed raised {ds_error}; ductile gave {ours or error}"
    elif expect[1] is None:
        # No candidate batch has a valid GPU count: DeepSpeed's list is None.
        assert error is ElasticityError, f"DeepSpeed answered {expect}; ductile {ours or error}"
    elif v02_model_parallel:
        check_model_parallel(block, world_size, ours, error)
    elif block["version"] == 0.2 and expect[0] == 0:
        check_fallback(block, world_size, ours, error)
    else:
        assert error is None, f"DeepSpeed answered {expect}; ductile raised {error.__name__}"
        assert type(ours) is tuple and len(ours) == len(expect)
        assert (ours[0], list(ours[1]), *ours[2:]) == (expect[0], list(expect[1]), *expect[2:])


@st.composite
def pack_cases(draw):
    """DeepSpeed's batch_by_seqlens arguments over up to 40 samples (its scan
    is cubic in the sample count)."""
    seqlens = draw(st.lists(st.integers(1, 4096), max_size=40))
    args = {
        "max_tokens": draw(st.integers(1, 8192)),
        "min_batch_size": draw(st.integers(1, 3)),
        "max_batch_size": draw(st.one_of(st.none(), st.integers(1, 8))),
        "sequence_picking_order": draw(st.sampled_from(["dataloader", "seqlen", "random"])),
        "effective_batch_size": draw(st.integers(1, 6)),
        "required_microbatches_of_same_size": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**63 - 1)),
    }
    return seqlens, args


@seeded
@given(pack_cases())
def test_pack_equals_deepspeed_batch_by_seqlens(case):
    seqlens, args = case
    expect, ds_error = deepspeed_outcome(deepspeed_batch_by_seqlens, seqlens, **args)
    ebs = args["effective_batch_size"]
    if args["max_batch_size"] is not None and args["min_batch_size"] > args["max_batch_size"]:
        # DeepSpeed takes a minimum above the maximum and packs nothing
        # (AssertionError, not one micro-batch per data loader); ductile
        # refuses the settings, naming both.
        assert ds_error == "AssertionError", (expect, ds_error)
        with pytest.raises(ductile.ConfigError, match="min_batch_size = .* max_batch_size"):
            batching.pack(seqlens, max_tokens=args["max_tokens"],
                          min_batch_size=args["min_batch_size"],
                          max_batch_size=args["max_batch_size"], effective_batch_size=ebs)
        return
    try:
        plan = batching.pack(
            seqlens, max_tokens=args["max_tokens"], min_batch_size=args["min_batch_size"],
            max_batch_size=args["max_batch_size"] or 0, effective_batch_size=ebs,
            order=args["sequence_picking_order"], seed=args["seed"],
            same_size_microbatches=args["required_microbatches_of_same_size"])
        ours = plan.to_json()
    except ductile.NotEnoughSamplesError:
        ours = None
    if ds_error is not None:
        # Not one micro-batch per data loader. Ours also packs the final
        # group DeepSpeed never emits, which can make up exactly one step.
        assert ds_error == "AssertionError", ds_error
        assert ours is None or len(ours["microbatch_ids"]) == ebs
        return
    ids, sizes, longest = expect
    assert ours is not None, f"DeepSpeed packed {len(ids)} micro-batches, ductile none"
    n = len(ids)
    assert ours["microbatch_ids"][:n] == [[b, list(m)] for b, m in ids]
    assert ours["batch_sizes"][:len(sizes)] == sizes
    assert ours["batch_max_seqlens"][:len(longest)] == longest
    # Beyond DeepSpeed's micro-batches: at most the step its final group completes.
    assert len(ours["microbatch_ids"]) - n in (0, ebs)
    packed = [i for _, m in ours["microbatch_ids"] for i in m]
    assert len(packed) == len(set(packed))
