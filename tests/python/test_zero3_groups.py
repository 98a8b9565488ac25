"""ZeRO-3 by parameter group (zero3.initialize's ``groups``): the tied test
LM's transformer blocks and its root are the units, each gathered in one
collective and reduce-scattered in one, against plain torch on one rank;
ductile's Python work per step does not grow with the parameters of a
group and is at most one call a group and pass; no host read of a device value on the step path; blocks under
torch.compile; a checkpoint saved by group resumes with other groups and
ranks. The runs are separate processes (zero3_worker.py)."""

import os
import re
import sys

import pytest

import torch

import ductile
import ductile.torch.zero3 as zero3

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_launch import BLOCKS_CONFIG as BLOCKS  # noqa: E402
from zero3_launch import CONFIG, launch, launch_batch  # noqa: E402
from zero3_model import Windows, loss_of, make_model  # noqa: E402

STEPS = 8
DEEPER = 8  # blocks auto_deep adds
BLOCK_PARAMS = ["ln1.weight", "ln1.bias", "qkv.weight", "proj.weight", "proj.bias", "ln2.weight",
                "ln2.bias", "up.weight", "up.bias", "down.weight", "down.bias"]


def relative(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def assert_losses_match(losses, reference, steps, tolerance=1e-5):
    for s in steps:
        a, b = losses[str(s)], reference[str(s)]
        assert relative(a, b) <= tolerance, f"step {s}: loss {a} vs {b}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3_groups")
    r = {}
    r["plain"] = launch(tmp, "plain", {"mode": "plain", "steps": STEPS}, config=BLOCKS)
    # auto_bias: the same blocks with one more parameter each (a bias on
    # qkv); auto_deep: 8 blocks more. One torchrun job runs the three.
    r.update(launch_batch(tmp, [
        ("auto", {"mode": "zero3", "steps": STEPS, "save_at": [4], "profile_calls": True}, BLOCKS),
        ("auto_bias", {"mode": "zero3", "steps": 2, "model": {"qkv_bias": True},
                       "profile_calls": True}, BLOCKS),
        ("auto_deep", {"mode": "zero3", "steps": 2, "model": {"layers": 4 + DEEPER},
                       "profile_calls": True}, BLOCKS)], ranks=2))
    r["auto_mpirun"] = launch(tmp, "auto_mpirun", {"mode": "zero3", "steps": STEPS}, ranks=2,
                              launcher="mpirun", config=BLOCKS)
    # The step-4 checkpoint of the block groups, resumed on 3 ranks by module.
    r["modules_resumed"] = launch(tmp, "modules_resumed", {
        "mode": "zero3", "start": 4, "steps": STEPS, "groups": "module",
        "load": str(tmp / "auto" / "step4")}, ranks=3, launcher="torchrun", config=BLOCKS)
    return r


def test_the_units_are_the_blocks_and_the_root(runs):
    units = runs["auto"][0]["units"]
    expected = {f"blocks.{i}": [f"blocks.{i}.{p}" for p in BLOCK_PARAMS] for i in range(4)}
    expected["<root>"] = ["embed.weight", "pos.weight", "ln_f.weight", "ln_f.bias"]
    assert units == expected  # the head is tied to the embedding: the root gathers it once
    assert runs["auto"][0]["trace"] == (["<root>"] + [f"blocks.{i}" for i in range(4)] +
                                        ["<root>"] + [f"blocks.{i}" for i in (3, 2, 1, 0)])


@pytest.mark.parametrize("name", ["auto", "auto_mpirun"])
def test_block_groups_train_as_plain_torch(runs, name):
    plain, plain_params, _ = runs["plain"]
    result, params, _ = runs[name]
    assert_losses_match(result["losses"], plain["losses"], range(STEPS))
    for key, ref in plain_params.items():
        diff = (params[key] - ref).abs().max().item()
        assert diff <= 1e-5 * ref.abs().max().item(), f"{key}: max difference {diff}"
    assert runs[name][0]["released_in_backward"] == [f"blocks.{i}" for i in range(4)]


def test_one_collective_a_group_each_way(runs):
    """Once the trace runs: the groups of each coalesced gather the
    coordinator issues (one, or several prefetched together) go in one
    all-gather, and the groups' gradients in reduce-scatters that small
    groups share; every group and parameter is reduced once a step (the
    tied weight too)."""
    result = runs["auto"][0]
    groups = len(result["units"])
    params = sum(len(v) for v in result["units"].values())
    for counts in result["per_step"][1:]:
        assert counts["reduced_groups"] == groups, counts
        # The test model's groups are small: they share reduce-scatters.
        assert 1 <= counts["reduce_scatters"] < groups, counts
        assert counts["reduced_params"] == params, counts
        assert counts["prefetched_params"] > counts["demand_gathered_params"], counts
    calls = result["calls"]
    # Forward and backward gather every group once at least (the root,
    # needed again at once, is kept); one more all-gather a step is the
    # ranks' agreement on the pass (a token).
    assert groups < calls["gathered_groups"] <= 2 * groups, calls
    assert calls["gathers"] <= calls["gathered_groups"], calls
    assert calls["collectives"]["all_gather"] == calls["gathers"] + 1, calls
    assert calls["collectives"]["reduce_scatter"] == calls["reduce_scatters"] < groups, calls
    assert calls["reduced_groups"] == groups, calls


def test_ductiles_python_calls_do_not_grow_with_a_groups_parameters(runs):
    """One more parameter in every block adds no Python call of ductile's:
    materialising, releasing and reducing a group are one call each, not one
    a parameter."""
    auto, bias = runs["auto"][0], runs["auto_bias"][0]
    assert sum(len(v) for v in bias["units"].values()) == \
        sum(len(v) for v in auto["units"].values()) + 4
    assert bias["calls"]["ductile"] == auto["calls"]["ductile"], (bias["calls"], auto["calls"])


def test_ductiles_python_calls_are_at_most_one_a_group_and_pass(runs):
    """The hooks, fetches, releases and materialisations are C++ (torch
    calls them directly): a group adds at most one Python call of ductile's
    a pass (its reduce in backward, none in forward). 8 blocks more add
    at most 2 x 8 calls a step; what is left is the step's own, whatever
    the number of groups."""
    auto, deep = runs["auto"][0], runs["auto_deep"][0]
    assert len(deep["units"]) == len(auto["units"]) + DEEPER
    added = deep["calls"]["ductile"] - auto["calls"]["ductile"]
    mine, theirs = auto["calls"]["ductile_by_function"], deep["calls"]["ductile_by_function"]
    grown = {k: v - mine.get(k, 0) for k, v in theirs.items() if v != mine.get(k, 0)}
    assert 0 <= added <= 2 * DEEPER, f"calls a step the 8 blocks add, by function: {grown}"
    assert auto["calls"]["ductile"] <= 2 * len(auto["units"]) + 40, auto["calls"]


def test_the_host_reads_no_device_value_on_the_step_path(runs):
    """Forward, backward, clipping and the optimizer step read nothing back
    (no .item(), no synchronize): on a GPU the host runs ahead. On the cpu a
    collective's wait is the only wait, once per collective (once per
    message of a direct exchange)."""
    calls = runs["auto"][0]["calls"]
    blocking = calls["blocking"]
    reads = {k: v for k, v in blocking.items()
             if any(m in k for m in ("'item'", "'tolist'", "synchronize", "__bool__",
                                     "__float__"))}
    assert not reads, blocking
    waits = sum(v for k, v in blocking.items() if re.search(r"\bwait\b", k))
    collectives = sum(calls["collectives"].values())
    # On gloo a collective is a direct exchange (_world.py): a
    # send and a receive a peer, each waited for.
    world = runs["auto"][0]["world"]
    assert 0 < waits <= 2 * (world - 1) * collectives, (blocking, calls["collectives"])


def test_a_checkpoint_of_block_groups_resumes_by_module_on_three_ranks(runs):
    auto = runs["auto"][0]
    resumed = runs["modules_resumed"][0]
    assert resumed["world"] == 3 and resumed["client_state"] == {"step": 4}
    assert len(resumed["units"]) > len(auto["units"])
    assert_losses_match(resumed["losses"], auto["losses"], range(4, STEPS))


def test_blocks_under_torch_compile_train_as_eager(tmp_path):
    """torch.compile on each block, the zero3 hooks outside the compiled
    regions (as torchtitan does with FSDP2): losses equal eager plain torch."""
    spec = {"steps": 4, "model": {"layers": 2}}
    plain = launch(tmp_path, "plain", dict(spec, mode="plain"), config=BLOCKS)[0]
    compiled = launch(tmp_path, "compiled", dict(spec, mode="zero3", compile=True), ranks=2,
                      launcher="torchrun", config=BLOCKS, timeout=600)[0]
    assert compiled["units"].keys() == {"blocks.0", "blocks.1", "<root>"}
    assert_losses_match(compiled["losses"], plain["losses"], range(4))


# --- in this process: one rank, no launcher ----------------------------------


def test_groups_policies_choose_the_units():
    def units(model, groups):
        engine = zero3.initialize(model, None, CONFIG, groups=groups)
        try:
            return engine.units()
        finally:
            engine.close()

    by_module = units(make_model(layers=1), "module")
    assert by_module["blocks.0.qkv"] == ["blocks.0.qkv.weight"]
    assert "head" not in by_module or by_module["head"] == []  # tied: the embedding owns it
    assert units(make_model(layers=2), lambda m: type(m).__name__ == "Block").keys() == \
        {"blocks.0", "blocks.1", "<root>"}
    from zero3_model import Block
    assert units(make_model(layers=2), (Block,)).keys() == {"blocks.0", "blocks.1", "<root>"}
    # No block structure: every module with parameters.
    seq = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert units(seq, "auto").keys() == {"0", "2"}


def test_a_hugging_face_model_groups_by_its_no_split_modules():
    from hf_models import tiny_model
    engine = zero3.initialize(tiny_model("gpt2", "eager"), None, CONFIG)
    assert engine.units().keys() == {"transformer.h.0", "transformer.h.1", "<root>"}
    engine.close()


def test_a_bad_groups_policy_names_what_is_valid():
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"groups = 'blocks'; valid: \"auto\", \"module\""):
        zero3.initialize(make_model(layers=1), None, CONFIG, groups="blocks")
    with pytest.raises(ductile.InvalidArgumentError, match=r"groups = \(<class 'int'>,\)"):
        zero3.initialize(make_model(layers=1), None, CONFIG, groups=(int,))


def test_a_unit_with_two_dtypes_gathers_two_groups():
    model = make_model(layers=1)
    model.blocks[0].scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    engine = zero3.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), CONFIG)
    assert engine.stats()["groups"] == 3  # the block's fp32 and fp64, the root's
    x, y = Windows(batch=2).step(0)
    engine.backward(loss_of(engine(x), y))
    engine.step()
    assert torch.equal(engine.full_parameters()["blocks.0.scale"],
                       torch.ones(3, dtype=torch.float64))
    engine.close()
