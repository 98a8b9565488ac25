"""TorchWorld's gathers and reduce-scatters on gloo by direct exchange
(python/ductile/torch/zero3/_world.py, and the C++ host world's
planned gathers, which every zero3 training test on torchrun runs): on 2
and 3 ranks under torchrun, equal to torch's own collectives on the same
inputs, several in flight at once, in place, of every size down to none,
and in a process group of two of the ranks (group ranks address the
messages); a group's large member alone, in a model that trains as plain
torch; an engine holds no reference to the default group."""

import json
import os
import subprocess

import pytest

from zero3_launch import BLOCKS_CONFIG, command, environment, launch

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("ranks", [2, 3])
def test_exchanges_equal_torchs_collectives(tmp_path, ranks):
    out = str(tmp_path / "report")
    proc = subprocess.run(
        command(ranks, "torchrun", os.path.join(HERE, "zero3_exchange_worker.py"), out),
        capture_output=True, text=True, env=environment(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(ranks):
        with open(f"{out}.rank{rank}") as f:
            report = json.load(f)
        assert report["size"] == ranks and report["direct"], report
        assert report["collectives_direct"] is False, report
        # The default group is looked up at each exchange, never held.
        assert report["group_references_an_engine_holds"] == 0, report
        assert report["checks"] and all(report["checks"].values()), report["checks"]
        # gloo tells an exchange is complete only once it is waited for.
        assert report["query_before_wait"] == [False] * 4, report
        assert report["query_after_wait"], report
        # 5 + 1 + 3 gathers and 2 sum reduce-scatters went by exchange;
        # max and the world without one, by torch's collectives.
        assert report["exchanges"] == {"all_gather": 9, "reduce_scatter": 2}, report
        assert report["collective_exchanges"] == {"all_gather": 0, "reduce_scatter": 0}, report


def test_a_groups_large_member_is_exchanged_alone_and_trains_as_plain_torch(tmp_path):
    """The root group of the tied LM with a 4096-token vocabulary: its
    embedding (1 MiB gathered) is exchanged alone straight into its place,
    the group's small members together through a scratch buffer; the
    losses are plain torch's on one rank."""
    config = BLOCKS_CONFIG.replace("max_live_parameters = 150000", "max_live_parameters = 600000")
    assert config != BLOCKS_CONFIG
    spec = {"steps": 4, "model": {"vocab": 4096}}
    plain = launch(tmp_path, "plain", dict(spec, mode="plain"), config=config)[0]
    zero = launch(tmp_path, "zero3", dict(spec, mode="zero3", profile_calls=True), ranks=2,
                  launcher="torchrun", config=config)[0]
    for step, loss in plain["losses"].items():
        reference = zero["losses"][step]
        assert abs(loss - reference) <= 1e-5 * abs(reference), (step, loss, reference)
    calls = zero["calls"]
    # A gather a step more than the groups gathered (and the ranks' token):
    # the root's embedding went alone.
    assert calls["collectives"]["all_gather"] > calls["gathers"] + 1, calls
