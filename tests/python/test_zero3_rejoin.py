"""zero3's in-place recovery (the engine's side of ``ductile agent``'s
round notices): the notice's contract and its errors, ``engine.rejoin`` in
this process at a step boundary, and three ranks of which one is SIGKILLed
while the two others go on in the same processes at world size 2, with the
losses of workers restarted from the same snapshot."""

import json
import os
import shutil
import signal
import sys
import threading
import time
from datetime import timedelta

import pytest

import torch
import torch.distributed as dist

import ductile
import ductile.torch.zero3 as zero3
from ductile.torch.zero3 import _rejoin, _round_notice, _snapshots, _world

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_checkpoint_support import same, snapshot, train  # noqa: E402
from zero3_launch import CONFIG  # noqa: E402
from zero3_rejoin_support import (Releases, assemble, committed, finish, kill, losses,  # noqa: E402
                                  notice, serve_store, start, wait_for, write_notice)
from zero3_model import Windows, WithLoss, make_model  # noqa: E402

GOOD = {"round": 3, "rank": 1, "world_size": 2, "local_rank": 0, "local_world_size": 1,
        "master_addr": "node-a", "master_port": 29500, "restore": "/dev/shm/restore/step4"}


def parse(fields):
    return _round_notice.parse(json.dumps(fields).encode(), "notice.json")


def test_a_notice_is_read_with_its_defaults_and_environment():
    got = parse(dict(GOOD, plan={"micro_batch": 2, "gradient_accumulation_steps": 3}))
    assert (got.round, got.rank, got.world_size, got.store_prefix) == (3, 1, 2, None)
    env = got.environment()
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["DUCTILE_ROUND"] == "3"
    assert env["MASTER_ADDR"] == "node-a" and env["MASTER_PORT"] == "29500"
    assert env["DUCTILE_MICRO_BATCH"] == "2" and "DUCTILE_GLOBAL_BATCH" not in env
    assert parse(dict(GOOD, store_prefix="r3/")).store_prefix == "r3/"


@pytest.mark.parametrize("change, message", [
    ({"rank": 2}, r"rank = 2; valid: an integer in \[0, 1\]"),
    ({"rank": True}, "rank = True; valid: an integer"),
    ({"world_size": 0}, "world_size = 0; valid: an integer >= 1"),
    ({"round": "3"}, "round = '3'; valid: an integer >= 1"),
    ({"local_world_size": 3}, r"local_world_size = 3; valid: an integer in \[1, 2\]"),
    ({"local_rank": 1}, r"local_rank = 1; valid: an integer in \[0, 0\]"),
    ({"master_port": 70000}, r"master_port = 70000; valid: an integer in \[1, 65535\]"),
    ({"master_addr": ""}, "master_addr = ''; valid: a non-empty string"),
    ({"restore": "restore/step4"}, "restore = 'restore/step4'; valid: an absolute path"),
    ({"store_prefix": 5}, "store_prefix = 5; valid: a non-empty string"),
    ({"plan": {"micro": 2}}, "plan.micro is not a key of plan; valid: global_batch, "
                             "micro_batch, gradient_accumulation_steps"),
    ({"plan": {"micro_batch": 0}}, "plan.micro_batch = 0; valid: an integer >= 1"),
    ({"plan": [2]}, r"plan = \[2\]; valid: an object of"),
    ({"node": "a"}, "node is not a key of a round notice; valid: round, rank,"),
])
def test_every_bad_field_is_named_with_what_is_valid(change, message):
    with pytest.raises(ductile.InvalidArgumentError, match=f"^notice.json: {message}"):
        parse(dict(GOOD, **change))


def test_missing_keys_bad_json_and_oversized_notices_are_refused():
    fields = dict(GOOD)
    del fields["restore"]
    with pytest.raises(ductile.InvalidArgumentError, match="the round notice has no restore; "
                                                           "required: round, rank"):
        parse(fields)
    with pytest.raises(ductile.InvalidArgumentError, match="not UTF-8 JSON"):
        _round_notice.parse(b"{round: 3", "notice.json")
    with pytest.raises(ductile.InvalidArgumentError, match="is a list; valid: a JSON object"):
        _round_notice.parse(b"[3]", "notice.json")
    big = json.dumps(dict(GOOD, master_addr="a" * 200, store_prefix="p")) + " " * (64 << 10)
    with pytest.raises(ductile.InvalidArgumentError, match=r"more than 65536 bytes; valid: a "
                                                           r"JSON object of at most 65536 bytes"):
        _round_notice.parse(big.encode(), "notice.json")


def test_the_watch_reads_a_changed_file_only_and_ignores_older_rounds(tmp_path, monkeypatch):
    path = str(tmp_path / "notice.json")
    watch = _round_notice.NoticeWatch(path, 3)
    assert watch.newer() is None  # no file yet
    write_notice(path, GOOD)  # round 3: not newer
    assert watch.newer() is None
    reads = []
    real = _round_notice.read
    monkeypatch.setattr(_round_notice, "read", lambda p: reads.append(p) or real(p))
    assert watch.newer() is None and reads == []  # unchanged: one stat, no read
    write_notice(path, dict(GOOD, round=4))
    assert watch.newer().round == 4 and len(reads) == 1
    with open(path, "w") as f:
        f.write('{"round": 5}')
    with pytest.raises(ductile.InvalidArgumentError, match=r"notice.json \(DUCTILE_ROUND_NOTICE"
                                                           r"\): the round notice has no rank"):
        watch.newer()


# --- one rank, in this process -----------------------------------------------------


@pytest.fixture
def world_of_one(tmp_path, monkeypatch):
    """A gloo world of 1 over a TCPStore served here; snapshots in
    tmp/own, round 1, a notice path, the agent's release requests taken."""
    store, port = serve_store()
    dist.init_process_group("gloo", store=dist.PrefixStore("round1/", store), rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    own = tmp_path / "own"
    for name, value in {"DUCTILE_SNAPSHOT_DIR": str(own), "LOCAL_RANK": "0", "RANK": "0",
                        "WORLD_SIZE": "1", "DUCTILE_ROUND": "1",
                        "DUCTILE_ROUND_NOTICE": str(tmp_path / "notice.json")}.items():
        monkeypatch.setenv(name, value)
    for name in ("DUCTILE_SNAPSHOT_RESTORE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "DUCTILE_ROUND_END"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_snapshots, "RELEASE_WAIT", 0.05)
    monkeypatch.setattr(_world, "superseded", None)  # the recovery's, reset afterwards
    try:
        yield port, own
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        del store


def adam(shards):
    return torch.optim.Adam(shards, lr=1e-2)


def test_a_newer_notice_at_a_step_boundary_rejoins_in_place(world_of_one, tmp_path):
    """The notice seen at the next step's forward: the engine leaves its
    process group, joins the notice's, loads the restore folder; the
    engine, module, optimizer and scheduler stay the same objects, with the
    snapshot's state; training goes on as from a restart at that step."""
    port, own = world_of_one
    engine = zero3.initialize(make_model(seed=0), adam, CONFIG)
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    engine.lr_scheduler = scheduler
    module, optimizer, recovery = engine.module, engine.optimizer, engine._recovery
    train(engine, 3)
    restore = tmp_path / "restore" / "step3"
    shutil.copytree(own / "step3", restore)
    at_3 = snapshot(engine)
    lr_at_3 = [g["lr"] for g in optimizer.param_groups]
    write_notice(str(tmp_path / "notice.json"), notice(2, 0, 1, port, restore))

    train(engine, 1)  # rejoins before step 4's forward, from step 3's snapshot
    assert recovery.recoveries == ["boundary"] and engine.restored_from_memory == 3
    assert os.environ["DUCTILE_ROUND"] == "2" and os.environ["MASTER_PORT"] == str(port)
    assert engine.global_step == 4
    assert engine.module is module and engine.optimizer is optimizer
    assert engine.lr_scheduler is scheduler and scheduler.optimizer is optimizer
    assert [p for g in optimizer.param_groups for p in g["params"]] == \
        engine.shard_parameters()
    assert [g["lr"] for g in optimizer.param_groups] == [lr_at_3[0] * 0.5]  # one step on
    reference = zero3.initialize(make_model(seed=1), adam, CONFIG)
    reference.load(restore)
    assert same(snapshot(reference), at_3)
    train(reference, 1)  # with step 3's learning rate, as the engine's step 4 had
    assert same(snapshot(reference), snapshot(engine))
    train(engine, 1)  # and on, snapshots too
    assert engine.global_step == 5 and committed(own) == "step5"


def _train_with_loss(engine, steps):
    windows = Windows(batch=2)
    for _ in range(steps):
        engine.backward(engine(*windows.step(engine.global_step)))
        engine.step()


def test_a_pause_the_agent_asks_for_is_taken_at_the_next_update(world_of_one, tmp_path):
    """A node joins: the agent asks the running worker to pause
    (notice.json.hold). At the next optimizer update the ranks agree on it,
    the worker says at which step's snapshot it paused (notice.json.held),
    waits for the notice, rejoins from that snapshot and completes the
    step: the state is that of an engine loaded from it and stepped once."""
    port, own = world_of_one
    path = tmp_path / "notice.json"
    engine = zero3.initialize(WithLoss(seed=0), adam, CONFIG)
    assert (tmp_path / "notice.json.ready").read_text() == f"{os.getpid()}\nhold\n"
    _train_with_loss(engine, 3)
    (tmp_path / "notice.json.hold").write_text("2\n")
    restore = tmp_path / "restore" / "step3"

    def agent():  # the agent's side: the notice once the worker paused
        held = tmp_path / "notice.json.held"
        deadline = time.monotonic() + 120
        while not held.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        shutil.copytree(own / f"step{int(held.read_text())}", restore)
        write_notice(str(path), notice(2, 0, 1, port, restore))

    answering = threading.Thread(target=agent)
    answering.start()
    _train_with_loss(engine, 1)  # pauses before step 4's update; rejoins; completes it
    answering.join()
    assert (tmp_path / "notice.json.held").read_text() == "3\n"
    # It waited in round 1, then joined round 2: the agent's signs of life.
    assert (tmp_path / "notice.json.waiting").read_text() == "1\n"
    assert (tmp_path / "notice.json.joined").read_text() == "2\n"
    assert engine._recovery.recoveries == ["step"] and engine.restored_from_memory == 3
    assert engine.global_step == 4 and os.environ["DUCTILE_ROUND"] == "2"
    reference = zero3.initialize(WithLoss(seed=1), adam, CONFIG)
    reference.load(restore)
    _train_with_loss(reference, 1)
    assert same(snapshot(reference), snapshot(engine))


def test_a_step_that_cannot_run_again_does_not_pause(world_of_one, tmp_path):
    """A loss computed outside the forward: the step could not run again
    after a rejoin, so the worker does not pause; it says so (-1 in
    notice.json.held: the agent restarts it) and trains on."""
    engine = zero3.initialize(make_model(seed=0), adam, CONFIG)
    train(engine, 2)
    (tmp_path / "notice.json.hold").write_text("2\n")
    train(engine, 2)
    assert (tmp_path / "notice.json.held").read_text() == "-1\n"
    assert engine.global_step == 4 and engine._recovery.recoveries == []
    # Nor does it go on in place at a lost node: its first backward took
    # back what the engine said when it was built.
    assert not (tmp_path / "notice.json.ready").exists()


class _WithLossKey(torch.nn.Module):
    """A Hugging Face model's output, as the Trainer reads it: the loss under "loss"."""

    def __init__(self):
        super().__init__()
        self.inner = WithLoss(seed=0)

    def forward(self, x, y):
        return {"loss": self.inner(x, y)}


def test_a_loss_changed_in_place_after_the_forward_cannot_run_again(world_of_one, tmp_path,
                                                                     caplog):
    """The HF Trainer multiplies the output's loss in place (by the world
    size) before backward: running the forward again would not give it, so
    the engine takes back its `.ready` and says why; the output's loss as
    it came keeps it."""
    ready = tmp_path / "notice.json.ready"
    windows = Windows(batch=2)
    engine = zero3.initialize(_WithLossKey(), adam, CONFIG)
    loss = engine(*windows.step(0))["loss"]
    engine.backward(loss)
    engine.step()
    assert ready.exists() and engine._recovery.micro == []
    with caplog.at_level("WARNING", logger="ductile.zero3"):
        loss = engine(*windows.step(1))["loss"]
        loss *= 1.0
        engine.backward(loss)
    assert not ready.exists()
    assert "its step cannot run again, and at a lost node the agent restarts" in caplog.text


def test_the_deepspeed_drop_in_takes_notices_when_its_micro_batch_is_fixed(world_of_one,
                                                                          tmp_path, caplog):
    """ductile.deepspeed's engine keeps its micro-batches as zero3's does
    (its forward goes through the engine, its backward's division by the
    accumulation steps is kept), so it says it can rejoin; a config
    without train_micro_batch_size_per_gpu, whose micro-batch follows the
    world size, cannot."""
    import ductile.deepspeed as deepspeed
    ready = tmp_path / "notice.json.ready"
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3}, "snapshot": {"interval": 1, "replicas": 1}}
    model = WithLoss(seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    assert ready.read_text() == f"{os.getpid()}\nhold\n"
    windows = Windows(batch=2)
    loss = engine(*windows.step(0))
    scaled = engine.backward(loss)
    assert torch.equal(scaled, loss / 2)
    micro = engine.zero3._recovery.micro
    assert len(micro) == 1 and micro[0].done and micro[0].divisor == 2
    assert micro[0].loss_path == ()
    ready.unlink()
    del config["train_micro_batch_size_per_gpu"]
    config["train_batch_size"] = 4
    with caplog.at_level("WARNING", logger="ductile.zero3"):
        model = WithLoss(seed=0)
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert not ready.exists()
    assert "gives no train_micro_batch_size_per_gpu, so the micro-batch would change with " \
        "the world size" in caplog.text


def test_rejoin_refuses_a_round_not_newer_and_a_world_it_cannot_rebuild(world_of_one, tmp_path,
                                                                        monkeypatch):
    port, _ = world_of_one
    engine = zero3.initialize(make_model(seed=0), adam, CONFIG)
    with pytest.raises(ductile.InvalidArgumentError, match=r"engine.rejoin: round 1 is not newer "
                       r"than this worker's round 1 \(DUCTILE_ROUND\)"):
        engine.rejoin(json.dumps(notice(1, 0, 1, port, tmp_path)))
    with pytest.raises(ductile.InvalidArgumentError, match=r"engine.rejoin: notice is a dict"):
        engine.rejoin(notice(2, 0, 1, port, tmp_path))
    with pytest.raises(ductile.InvalidArgumentError, match=r"^engine.rejoin: rank = 1"):
        engine.rejoin(json.dumps(notice(2, 1, 1, port, tmp_path)))
    dist.destroy_process_group()
    alone = zero3.initialize(make_model(seed=0), adam, CONFIG)  # the accelerator's own world
    with pytest.raises(ductile.IncompatibleError, match=r"cannot rejoin a round in place: its "
                       r"world is accelerator; valid: torch.distributed's default group"):
        alone.rejoin(json.dumps(notice(2, 0, 1, port, tmp_path)))


def test_an_engine_that_can_rejoin_says_so_and_one_that_cannot_does_not(world_of_one, tmp_path,
                                                                       caplog):
    """The agent writes notices only to a worker whose engine wrote
    `<notice>.ready`; an engine that cannot rejoin writes none and says why
    (the agent restarts that worker instead)."""
    ready = tmp_path / "notice.json.ready"
    zero3.initialize(make_model(seed=0), adam, CONFIG)
    assert ready.read_text() == f"{os.getpid()}\nhold\n"  # its snapshots are copied: it pauses
    zero3.initialize(make_model(seed=0), adam, CONFIG + "snapshot_replicas = 0\n")
    assert ready.read_text() == f"{os.getpid()}\n"  # no copies: no pause rides on them
    ready.unlink()
    dist.destroy_process_group()
    with caplog.at_level("WARNING", logger="ductile.zero3"):
        alone = zero3.initialize(make_model(seed=0), adam, CONFIG)  # the accelerator's world
    assert alone._recovery is None and not ready.exists()
    assert "cannot rejoin a round in place: its world is accelerator" in caplog.text
    assert "at a lost node the agent restarts this worker" in caplog.text


def test_a_failed_collective_waits_for_the_notice_a_bounded_time(world_of_one, monkeypatch):
    """No newer notice within DUCTILE_ROUND_END_WAIT: a CommunicationError
    naming the notice's path and the wait; an error that is not a lost
    peer's is raised as it is."""
    engine = zero3.initialize(make_model(seed=0), adam, CONFIG)
    monkeypatch.setenv("DUCTILE_ROUND_END_WAIT", "1")
    lost = ductile.CommunicationError("all_gather: Connection closed by peer")
    with pytest.raises(ductile.CommunicationError, match=r"a collective of round 1 failed \("
                       r"CommunicationError: all_gather: Connection closed by peer\) and no "
                       r"notice of a newer round came to .*notice.json \(DUCTILE_ROUND_NOTICE\) "
                       r"within 1 s \(DUCTILE_ROUND_END_WAIT\)"):
        engine._recovery._recover(lost, [], "forward")
    other = ValueError("a shape")
    with pytest.raises(ValueError, match="a shape"):
        engine._recovery._recover(other, [], "forward")
    assert engine._recovery.recoveries == []


def test_a_micro_batch_whose_loss_came_from_outside_is_not_run_again(world_of_one):
    """The loss computed outside the forward: a lost peer's error in its
    backward or in the step is raised as it is (the agent restarts the
    workers)."""
    engine = zero3.initialize(make_model(seed=0), adam, CONFIG)
    x = torch.randint(0, 256, (2, 8))
    logits = engine(x)
    loss = logits.float().mean()
    assert _rejoin._loss_path(logits, loss) is None
    assert _rejoin._loss_path(logits, logits) == ()
    lost = ductile.CommunicationError("reduce_scatter: Connection closed by peer")
    entry = _rejoin.MicroBatch((x,), {}, done=True)
    with pytest.raises(ductile.CommunicationError, match="reduce_scatter"):
        engine._recovery._recover(lost, [entry], "backward")
    engine.backward(loss)
    with pytest.raises(ductile.CommunicationError, match="all_reduce"):  # step() cannot either
        engine._recovery._recover(ductile.CommunicationError("all_reduce"), [], "step")
    engine.step()
    assert engine._recovery.recoveries == [] and engine._recovery.micro == []


# --- three ranks: one lost, two go on in the same processes ------------------------------

STEPS = 6
PAUSE = 3


@pytest.fixture
def started():
    """The ranks a test starts (a list to extend): killed if still running
    when it ends."""
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            kill(p)


def test_survivors_rejoin_in_place_with_the_losses_of_a_restart(tmp_path, started):
    """Rank 2 of 3 stops after step 3 (the survivors' next forward fails),
    after step 4's forward (their backward fails) or after its backward
    (their step's all-reduce: one survivor's fails, the other's waits on
    it, and is left once the notice came) and is SIGKILLed; or rank 2
    stops after step 3 and is SIGSTOPped ("silent": its connections stay
    open, and the survivors' next forward waits on it in the gathers the
    engine plans, in C++, until a survivor shuts the round's connections
    on the notice). The test, as the agents, assembles step 3's snapshot
    from the three nodes' folders and writes the survivors' notices. They go on in the same
    processes at world size 2 to step 6, with exactly the losses of two
    fresh workers restored from the same folder (DUCTILE_SNAPSHOT_RESTORE)."""
    runs, stores = {}, []
    for case in ("boundary", "backward", "step", "silent"):
        store, port = serve_store()  # a job's: each run its own
        stores.append(store)
        out = tmp_path / case
        where = "boundary" if case == "silent" else case
        procs = start(out, {"steps": STEPS, "pause": {"rank": 2, "step": PAUSE,
                                                       "where": where}}, 3, port)
        started.extend(procs)
        pids = [p.pid for p in procs]
        with Releases([out / f"node{r}" for r in range(3)]):
            wait_for(out / "paused-rank2", procs)
            if case == "silent":
                procs[2].send_signal(signal.SIGSTOP)
            else:
                kill(procs[2])
            assert [committed(out / f"node{r}") for r in range(3)] == [f"step{PAUSE}"] * 3
            folder = assemble(out, 3, f"step{PAUSE}")
            for r in range(2):
                write_notice(str(out / f"notice-rank{r}.json"), notice(2, r, 2, port, folder))
            codes = finish(procs[:2], timeout=120)
        kill(procs[2])
        assert codes == [0, 0], [(out / f"stderr-rank{r}.txt").read_text()[-3000:]
                                 for r in range(2)]
        if case == "silent":
            # Rank 2 never closes its end: a survivor's thread shut its own.
            # The other may have done so too, or have failed first on the
            # connection that the first one shut, which ends its wait as well.
            shut = [r for r in range(2) if "connection(s) to that round's workers were shut"
                    in (out / f"stderr-rank{r}.txt").read_text()]
            assert shut, [(out / f"stderr-rank{r}.txt").read_text()[-3000:] for r in range(2)]
        runs[case] = [losses(out, r) for r in range(2)]
        for r in range(2):
            records = runs[case][r]
            assert sorted(records) == list(range(1, STEPS + 1))
            assert {records[s]["pid"] for s in records} == {pids[r]}  # the same process
            assert [records[s]["world_size"] for s in sorted(records)] == \
                [3] * PAUSE + [2] * (STEPS - PAUSE)
            assert records[STEPS]["recoveries"] == \
                ["forward" if where == "boundary" else where]
        folder_of_boundary = tmp_path / "boundary" / "restore" / f"step{PAUSE}"

    restarted = tmp_path / "restart"
    store, port = serve_store()
    stores.append(store)
    procs = start(restarted, {"steps": STEPS}, 2, port, round_=2, notices=False,
                  restore=folder_of_boundary)
    started.extend(procs)
    with Releases([restarted / f"node{r}" for r in range(2)]):
        assert finish(procs) == [0, 0], (restarted / "stderr-rank0.txt").read_text()[-3000:]
    for r in range(2):
        reference = losses(restarted, r)
        assert sorted(reference) == list(range(PAUSE + 1, STEPS + 1))
        for where, seen in runs.items():
            assert [seen[r][s]["loss"] for s in sorted(reference)] == \
                [reference[s]["loss"] for s in sorted(reference)], (where, r)
    del stores
