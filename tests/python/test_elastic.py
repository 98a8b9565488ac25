"""ductile.torch.elastic: the worker's side of the agent's checkpoint
request before a planned re-form (files named by DUCTILE_CHECKPOINT_REQUEST
and DUCTILE_CHECKPOINT_SAVED), and the agreement of ranks on the step."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ductile
from ductile.torch import elastic


@pytest.fixture
def agent_files(tmp_path, monkeypatch):
    request, saved = tmp_path / "checkpoint_request", tmp_path / "0" / "checkpoint_saved"
    saved.parent.mkdir()
    monkeypatch.setenv("DUCTILE_CHECKPOINT_REQUEST", str(request))
    monkeypatch.setenv("DUCTILE_CHECKPOINT_SAVED", str(saved))
    return request, saved


def test_outside_the_agent_nothing_is_asked(monkeypatch):
    monkeypatch.delenv("DUCTILE_CHECKPOINT_REQUEST", raising=False)
    monkeypatch.delenv("DUCTILE_CHECKPOINT_SAVED", raising=False)
    assert not elastic.checkpoint_requested()
    assert not elastic.should_checkpoint()
    assert elastic.checkpoint_reason() is None
    elastic.checkpoint_saved()  # nothing to tell


def test_the_request_file_asks_and_the_saved_file_answers(agent_files):
    request, saved = agent_files
    assert not elastic.checkpoint_requested()
    assert not elastic.should_checkpoint()
    request.write_text(json.dumps({"round": 3, "reason": "scale-up: 3 node(s) admitted of 3 present"}))
    assert elastic.checkpoint_requested()
    assert elastic.should_checkpoint()
    assert elastic.checkpoint_reason() == "scale-up: 3 node(s) admitted of 3 present"
    assert not saved.exists()
    elastic.checkpoint_saved()
    assert saved.exists()
    assert not saved.with_name(saved.name + ".part").exists()


def test_ranks_agree_through_the_engine_or_a_callable(agent_files):
    class Engine:  # a zero3 engine's all_reduce, over two ranks of which the other saw it
        def all_reduce(self, tensor, op):
            assert op == "max"
            return torch.maximum(tensor, torch.tensor([1.0]))

    assert elastic.should_checkpoint(Engine())
    assert elastic.should_checkpoint(lambda t: torch.tensor([1.0]))
    assert not elastic.should_checkpoint(lambda t: t)
    with pytest.raises(ductile.InvalidArgumentError, match="should_checkpoint"):
        elastic.should_checkpoint(sync=3)
    with pytest.raises(ductile.Error):
        elastic.should_checkpoint(sync="max")


def _rank(rank, world, store_file, request, answers):
    os.environ["DUCTILE_CHECKPOINT_REQUEST"] = request
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world)
    try:
        if rank == 1:  # only this rank has seen the request yet
            with open(request, "w") as f:
                f.write("{}")
        dist.barrier()
        seen_here = elastic.checkpoint_requested() if rank == 1 else False
        answers[rank] = (seen_here, elastic.should_checkpoint())
    finally:
        dist.destroy_process_group()


def test_torch_distributed_ranks_agree(tmp_path):
    # Rank 0 looks before the file is there for it (it asks torch.distributed).
    request = str(tmp_path / "request")
    with mp.Manager() as manager:
        answers = manager.dict()
        mp.spawn(_rank, args=(2, str(tmp_path / "store"), request, answers), nprocs=2)
        assert answers[0] == (False, True)
        assert answers[1] == (True, True)
