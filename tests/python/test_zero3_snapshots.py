"""zero3's in-memory snapshots (the workers' side of ``ductile agent``'s
restore from memory): written every snapshot_interval steps into
DUCTILE_SNAPSHOT_DIR, double-buffered, identical manifests on every node,
loadable at any world size from the nodes' files put together, a snapshot
killed half-way leaving the previous one whole; the restore at start from
DUCTILE_SNAPSHOT_RESTORE; the config keys, TOML and DeepSpeed."""

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import torch

import ductile
import ductile.deepspeed
import ductile.torch.zero3 as zero3
from ductile.torch.zero3 import _checkpoint_files, _snapshot_mapping, _snapshots

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_checkpoint_support import same, snapshot, train  # noqa: E402
from zero3_launch import CONFIG, command, environment, prepare  # noqa: E402
from zero3_model import Windows, loss_of, make_model  # noqa: E402


def adam(shards):
    return torch.optim.Adam(shards, lr=1e-2)


def engine_of(config=CONFIG, seed=0):
    return zero3.initialize(make_model(seed=seed), adam, config)


def with_keys(**keys):
    return CONFIG + "".join(f"{k} = {v}\n" for k, v in keys.items())


def tags(root):
    return sorted(e for e in os.listdir(root) if e.startswith("step"))


def latest(root):
    return (root / "latest").read_text().split("\n")[0]


@pytest.fixture
def snapshots(tmp_path, monkeypatch):
    """DUCTILE_SNAPSHOT_DIR for a one-rank "node"; no restore folder."""
    root = tmp_path / "own"
    monkeypatch.setenv("DUCTILE_SNAPSHOT_DIR", str(root))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("DUCTILE_SNAPSHOT_RESTORE", raising=False)
    return root


def test_every_step_by_default_keeping_the_two_newest(snapshots):
    engine = engine_of(with_keys(snapshot_replicas=2))
    seen = []
    for _ in range(3):
        train(engine, 1)
        seen.append((latest(snapshots), tags(snapshots)))
    assert seen == [("step1", ["step1"]), ("step2", ["step1", "step2"]),
                    ("step3", ["step2", "step3"])]
    assert (snapshots / "replicas").read_text() == "2\n"
    assert sorted(os.listdir(snapshots / "step3")) == [
        "manifest.json", "manifest.json.sha256", "rank0-of-1.bin"]
    manifest = json.loads((snapshots / "step3" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["client_state"] is None
    digest = hashlib.sha256((snapshots / "step3" / "manifest.json").read_bytes()).hexdigest()
    assert (snapshots / "latest").read_text() == f"step3\nsha256 {digest}\n"

    checker = engine_of(seed=1)
    assert checker.load(snapshots) is None
    assert checker.global_step == 3 and same(snapshot(checker), snapshot(engine))


def test_a_step_waits_until_the_last_snapshot_is_replicated(snapshots, monkeypatch, caplog):
    """The agent writes own/replicated (the newest step every replica
    holds, or off); step() waits for the last snapshot's before the
    optimizer changes the state, "off" waits for nothing, and an agent that
    never copies holds a step REPLICATION_WAIT seconds at most."""
    engine = engine_of()
    train(engine, 1)  # step 1's snapshot; no file yet: nothing to wait for

    def replicated(text):
        staged = snapshots / "replicated.tmp"
        staged.write_text(text)
        os.replace(staged, snapshots / "replicated")

    replicated("0\n")
    seen = []
    timer = threading.Timer(0.5, lambda: (seen.append(engine.global_step), replicated("1\n")))
    started = time.monotonic()
    timer.start()
    train(engine, 1)
    waited = time.monotonic() - started
    timer.join()
    assert seen == [1]  # step 2's optimizer step came after the copy of step 1
    assert waited >= 0.5 and engine.global_step == 2

    monkeypatch.setattr(_snapshots, "REPLICATION_WAIT", 30.0)
    replicated("off\n")
    started = time.monotonic()
    train(engine, 1)
    assert time.monotonic() - started < 20  # did not wait for the 30 s

    monkeypatch.setattr(_snapshots, "REPLICATION_WAIT", 0.3)
    replicated("2\n")  # step 3's snapshot is never copied
    with caplog.at_level("WARNING", logger="ductile.zero3"):
        train(engine, 1)
    assert engine.global_step == 4
    assert "zero3 snapshot of step 3: its copies to 1 other node(s) did not complete" in caplog.text


def held_bytes(root):
    """What the files under `root` take (blocks, each inode once): the rank
    files' bytes, and every other file's."""
    shards, other, seen = 0, 0, set()
    for folder, _, files in os.walk(root):
        for name in files:
            info = os.lstat(os.path.join(folder, name))
            if (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            if name.startswith("rank"):
                shards += info.st_blocks * 512
            else:
                other += info.st_blocks * 512
    return shards, other


def test_the_node_holds_two_snapshots_at_every_operation_of_a_third(snapshots):
    """Double-buffered in memory: while step N's snapshot is written and
    committed, the rank file of step N - 2 is written over, never beside
    the others; at every file-system operation of three snapshots the
    rank files take at most 2 x the node's state (its rank file)."""
    engine = engine_of()
    train(engine, 2)
    state = os.lstat(snapshots / "step2" / "rank0-of-1.bin").st_blocks * 512
    manifest = sum(os.lstat(snapshots / "step2" / name).st_blocks * 512
                   for name in ("manifest.json", "manifest.json.sha256"))
    seen = []
    _checkpoint_files._fault_hook = lambda op, path: seen.append((op, *held_bytes(snapshots)))
    try:
        train(engine, 3)
    finally:
        _checkpoint_files._fault_hook = None
    assert tags(snapshots) == ["step4", "step5"]
    assert {op for op, _, _ in seen} >= {"write", "rename", "remove"}, seen
    assert max(shards for _, shards, _ in seen) <= 2 * state, (state, seen)
    # The small files: the manifests and sidecars of three folders (the
    # superseded one's go once the new one is committed), latest, its staged
    # copy and replicas, a page each.
    assert max(other for _, _, other in seen) <= 3 * manifest + 3 * 4096, seen


def test_interval_2_writes_at_even_steps_only(snapshots):
    engine = engine_of(with_keys(snapshot_interval=2))
    seen = []
    for _ in range(5):
        train(engine, 1)
        seen.append(tags(snapshots) if snapshots.exists() else [])
    assert seen == [[], ["step2"], ["step2"], ["step2", "step4"], ["step2", "step4"]]


@pytest.mark.parametrize("replicas", [1, 0])
def test_the_training_threads_blocked_time_is_counted_per_snapshot(snapshots, caplog, replicas):
    """engine.stats() sums the time each snapshot held the training thread:
    its write and commit in step(), and, with replicas, the wait for them
    before the next update (counted then); a debug line says it for each."""
    caplog.set_level(logging.DEBUG, logger="ductile.zero3")
    engine = engine_of(with_keys(snapshot_interval=2, snapshot_replicas=replicas))
    stats = engine.stats()
    assert (stats["snapshots_timed"], stats["snapshot_blocked_ns"]) == (0, 0)
    timed = []
    for _ in range(5):
        train(engine, 1)
        timed.append(engine.stats()["snapshots_timed"])
    # With replicas, step 2's snapshot is counted once step 3 waited for them.
    assert timed == ([0, 0, 1, 1, 2] if replicas else [0, 1, 1, 2, 2])
    assert engine.stats()["snapshot_blocked_ns"] > 0
    lines = [r.getMessage() for r in caplog.records if "was blocked" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["zero3 snapshot of step 2",
                                                      "zero3 snapshot of step 4"], lines
    assert all(line.endswith(" ms") for line in lines)


def _values_of(path):
    """A shard file's values (after its header, whose save id is new each time)."""
    with open(path, "rb") as f:
        offset = _checkpoint_files.read_header(f, path)[1]
        f.seek(offset)
        return f.read()


def test_overlap_writes_the_same_snapshots_on_a_thread_committed_before_the_next_update(
        snapshots, tmp_path, monkeypatch):
    """With snapshot_overlap, step N's shard file is written by a thread
    while step N + 1's forward and backward run, and committed before its
    optimizer update (on the cpu the copies compute the checksum, so the
    record is ready once the update may go on): the same bytes and commits
    as within step(), one step later."""
    engine = engine_of()
    assert engine.snapshot_overlap is False
    with pytest.raises(ductile.InvalidArgumentError, match="snapshot_overlap = 1 is not a bool"):
        engine.snapshot_overlap = 1
    engine.snapshot_overlap = True
    windows = Windows(batch=2)
    # gates[n] opens once step n + 1's forward and backward ran: step n's
    # snapshot can be written only then, so the training thread does not
    # wait for it before the update.
    gates = [threading.Event() for _ in range(4)]
    writers = set()

    def hold(operation, path):
        if threading.current_thread() is not threading.main_thread():
            writers.add(threading.current_thread().name)
            if operation == "write":
                folder = os.path.basename(os.path.dirname(path))  # step<n>.tmp
                assert gates[int(folder[4:].split(".")[0])].wait(60)

    monkeypatch.setattr(_checkpoint_files, "_fault_hook", hold)
    seen, states = [], []
    for step in range(3):
        x, y = windows.step(step)
        engine.backward(loss_of(engine(x), y))
        gates[step].set()
        engine.step()
        states.append(snapshot(engine))
        seen.append((latest(snapshots) if (snapshots / "latest").exists() else None,
                     tags(snapshots)))
    # Step N's snapshot commits in step N + 1, before its update; step N + 1's
    # is staged.
    assert seen == [(None, ["step1.tmp"]), ("step1", ["step1", "step2.tmp"]),
                    ("step2", ["step1", "step2", "step3.tmp"])]
    assert writers == {"ductile-zero3-snapshot"}
    gates[3].set()
    engine.wait_for_save()  # commits the last one
    assert latest(snapshots) == "step3" and tags(snapshots) == ["step2", "step3"]
    checker = engine_of(seed=1)
    checker.load(snapshots)
    assert checker.global_step == 3 and same(snapshot(checker), states[2])

    # The same bytes as a snapshot written within step().
    monkeypatch.setattr(_checkpoint_files, "_fault_hook", None)
    monkeypatch.setenv("DUCTILE_SNAPSHOT_DIR", str(tmp_path / "within"))
    within = engine_of()
    train(within, 3)
    for name in ("step2", "step3"):
        assert _values_of(snapshots / name / "rank0-of-1.bin") == \
            _values_of(tmp_path / "within" / name / "rank0-of-1.bin")
        ours, theirs = (json.loads((root / name / "manifest.json").read_text())
                        for root in (snapshots, tmp_path / "within"))
        for manifest in (ours, theirs):
            del manifest["save_id"]
            del manifest["shards"][0]["crc32c"]  # over the header too
        assert ours == theirs


def _written_by_write_file(engine, folder, out):
    """The shard file of the snapshot in `folder` as write_file writes it
    (the path of saves): its header's fields, the engine's values, in the
    manifest's order; returns the file's bytes and write_file's record."""
    path = folder / "rank0-of-1.bin"
    with open(path, "rb") as f:
        fields = _checkpoint_files.read_header(f, path)[0]
    parameters = json.loads((folder / "manifest.json").read_text())["parameters"]
    chunks = _checkpoint_files.shard_chunks(
        engine, engine.optimizer, parameters,
        _checkpoint_files.header(fields["save_id"], fields["step"], 0, 1))
    record = _checkpoint_files.write_file(str(out), chunks, sha256=True, durable=False)
    return out.read_bytes(), record


def test_the_mapped_file_holds_the_bytes_write_file_writes_and_stays_mapped(snapshots, tmp_path):
    """A snapshot's shard file, its values copied from the tensors into its
    mapping and checksummed over it, is byte for byte the file write_file
    writes from the same header, with the same CRC-32C, in step() and on
    the thread (snapshot_overlap); each of the rank's two files is mapped
    once and kept, and mapped anew only when its size changes (the header
    gains a digit at step 10); close() lets the mappings go."""
    _snapshot_mapping.MAPPINGS.close()
    engine = engine_of()
    kept = []
    for step in range(1, 13):
        if step == 7:
            engine.snapshot_overlap = True
        train(engine, 1)
        if engine.snapshot_overlap:
            engine.wait_for_save()  # commits the thread's snapshot
        folder = snapshots / f"step{step}"
        data, record = _written_by_write_file(engine, folder, tmp_path / f"expected{step}")
        assert (folder / "rank0-of-1.bin").read_bytes() == data, step
        shard = json.loads((folder / "manifest.json").read_text())["shards"][0]
        assert [shard["bytes"], shard["crc32c"]] == record[:2], step
        kept.append(dict(_snapshot_mapping.MAPPINGS._kept))  # held: compared by identity
    # Steps 3 to 9 write over the files of steps 1 and 2, through the same
    # two mappings; the header grows at step 10 (each file once).
    assert [len(k) for k in kept] == [1] + [2] * 11, kept
    assert kept[2].keys() == kept[8].keys() == kept[11].keys()
    assert all(kept[2][key] is kept[8][key] for key in kept[2]), kept
    assert all(kept[8][key] is not kept[11][key] and kept[11][key].size == kept[8][key].size + 1
               for key in kept[2]), kept
    engine.close()
    assert _snapshot_mapping.MAPPINGS._kept == {}


def test_a_signed_snapshot_file_records_the_sha256_of_its_bytes(snapshots, monkeypatch):
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY", "k" * 32)
    engine = engine_of()
    train(engine, 2)
    data = (snapshots / "step2" / "rank0-of-1.bin").read_bytes()
    shard = json.loads((snapshots / "step2" / "manifest.json").read_text())["shards"][0]
    assert shard["sha256"] == hashlib.sha256(data).hexdigest()
    checker = engine_of(seed=1)
    checker.load(snapshots)
    assert checker.global_step == 2 and same(snapshot(checker), snapshot(engine))


def test_a_snapshot_due_while_the_last_is_written_is_skipped_and_the_interval_logged(
        snapshots, monkeypatch, caplog):
    """With snapshot_overlap, a snapshot due while the thread of the last
    one still runs is not taken (nor queued): counted in engine.stats(),
    and once the last one commits a warning says the interval held. (Signed:
    the thread hashes the file after its copies, and waits there for the
    test.)"""
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY", "k" * 32)
    engine = engine_of()
    engine.snapshot_overlap = True
    checking, release = threading.Event(), threading.Event()
    original = _snapshot_mapping.checksum

    def slow(*args):  # the thread's hash waits for the test
        checking.set()
        assert release.wait(60)
        return original(*args)

    monkeypatch.setattr(_snapshot_mapping, "checksum", slow)
    train(engine, 1)  # step 1's thread copies, then waits in its hash
    assert checking.wait(60)
    train(engine, 2)  # steps 2 and 3: step 1 is still being written
    assert engine.stats()["snapshots_skipped"] == 2
    assert tags(snapshots) == ["step1.tmp"]
    assert not any("holding" in r.getMessage() for r in caplog.records)
    release.set()
    engine._snapshots.writing.thread.join()
    train(engine, 1)  # step 4's update commits step 1; step 4's is taken
    assert latest(snapshots) == "step1" and tags(snapshots) == ["step1", "step4.tmp"]
    lines = [r.getMessage() for r in caplog.records if "holding" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        "zero3 snapshots: snapshot_interval 1 is faster than the writes ("), lines
    assert lines[0].endswith(" ms); holding every 3rd step"), lines
    engine.close()
    assert latest(snapshots) == "step4" and engine.stats()["snapshots_skipped"] == 2
    checker = engine_of(seed=1)
    checker.load(snapshots)
    assert checker.global_step == 4


def test_an_overlapped_write_that_fails_is_logged_and_the_previous_snapshot_kept(
        snapshots, monkeypatch, caplog):
    engine = engine_of()
    engine.snapshot_overlap = True
    train(engine, 2)  # step 1 committed; step 2's thread writing
    engine._snapshots.writing.thread.join()  # done, not committed

    def full(operation, path):
        if threading.current_thread() is not threading.main_thread() and operation == "write":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(_checkpoint_files, "_fault_hook", full)
    train(engine, 1)  # commits step 2; step 3's thread fails
    assert latest(snapshots) == "step2"
    # Step 3's write has failed before step 4's starts, which the disk
    # takes again.
    engine._snapshots.writing.thread.join()
    monkeypatch.setattr(_checkpoint_files, "_fault_hook", None)
    train(engine, 1)  # step 3 fails on every rank: logged, training goes on
    assert latest(snapshots) == "step2" and engine.global_step == 4
    assert any("zero3 snapshot of step 3" in r.getMessage() and "No space left" in
               r.getMessage() for r in caplog.records), caplog.records
    assert "step3.tmp" not in os.listdir(snapshots)  # removed; step4.tmp is being written
    engine.close()  # commits step 4's
    assert latest(snapshots) == "step4"


def test_interval_0_or_no_snapshot_dir_writes_nothing(snapshots, tmp_path, monkeypatch):
    engine = engine_of(with_keys(snapshot_interval=0))
    train(engine, 2)
    assert not snapshots.exists()
    monkeypatch.delenv("DUCTILE_SNAPSHOT_DIR")
    monkeypatch.chdir(tmp_path)
    engine = engine_of()
    train(engine, 2)
    assert sorted(os.listdir(tmp_path)) == []


def test_a_snapshot_killed_at_any_operation_leaves_the_previous_one(snapshots, tmp_path):
    """A child process writes step 3's snapshot over a folder holding steps
    1 and 2 and is killed (SIGKILL) before its k-th file-system operation,
    for every k: the folder then loads as step 2 or step 3, whole; the next
    snapshot over the debris keeps only the two newest."""
    engine = engine_of()
    train(engine, 2)
    pristine = tmp_path / "pristine"
    shutil.copytree(snapshots, pristine)
    old = snapshot(engine)
    operations = []
    _checkpoint_files._fault_hook = lambda op, path: operations.append(op)
    try:
        train(engine, 1)
    finally:
        _checkpoint_files._fault_hook = None
    new = snapshot(engine)
    # Renames: step 1's rank file into the staging folder (written over in
    # place), the folder, latest.
    assert "fsync" not in operations and operations.count("rename") == 3, operations
    assert operations.count("create") == 3, operations  # manifest, its .sha256, latest.tmp
    checker = engine_of(seed=1)
    outcomes = {2: 0, 3: 0}
    for k in range(1, len(operations) + 1):
        shutil.rmtree(snapshots)
        shutil.copytree(pristine, snapshots)
        engine.global_step = 2  # step 3's snapshot again
        engine._snapshots._last = None
        pid = os.fork()
        if pid == 0:
            count = [0]

            def hook(op, path, count=count, k=k):
                count[0] += 1
                if count[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)
            _checkpoint_files._fault_hook = hook
            try:
                engine.global_step = 3
                engine._snapshots.after_step()
            finally:
                os._exit(3)  # not reached: killed inside the snapshot
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (k, status)
        checker.load(snapshots)
        step = checker.global_step
        assert same(snapshot(checker), old if step == 2 else new), f"kill at {k}: a mix"
        outcomes[step] += 1
    # Up to the rename of latest step 2; after it step 3.
    commit = len(operations) - operations[::-1].index("rename")
    assert outcomes == {2: commit, 3: len(operations) - commit}, outcomes
    engine.global_step = 3
    engine._snapshots._last = None
    train(engine, 1)  # step 4 over the debris of the last kill
    assert tags(snapshots) == ["step3", "step4"] and latest(snapshots) == "step4"
    assert sorted(os.listdir(snapshots)) == ["latest", "replicas", "step3", "step4"]


def test_restore_at_initialize_from_the_restore_folder(snapshots, monkeypatch):
    engine = engine_of()
    train(engine, 3)
    assert engine.restored_from_memory is None
    folder = snapshots.parent / "restore" / "step3"
    shutil.copytree(snapshots / "step3", folder)
    monkeypatch.setenv("DUCTILE_SNAPSHOT_RESTORE", str(folder))
    monkeypatch.setenv("DUCTILE_SNAPSHOT_DIR", str(snapshots.parent / "own2"))
    restored = engine_of(seed=1)
    assert restored.global_step == 3 and restored.restored_from_memory == 3
    assert same(snapshot(restored), snapshot(engine))
    train(restored, 1)  # and the training goes on from there, snapshots too
    train(engine, 1)
    assert same(snapshot(restored), snapshot(engine))
    assert tags(snapshots.parent / "own2") == ["step4"]

    shard = folder / "rank0-of-1.bin"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ductile.IoError, match=rf"DUCTILE_SNAPSHOT_RESTORE={folder}: the "
                       r"snapshot to resume from does not load: .*rank0-of-1.bin: CRC-32"):
        engine_of(seed=1)


def test_the_client_state_travels_with_the_snapshot(snapshots, monkeypatch, caplog):
    """engine.snapshot_client_state(step) is written into each snapshot's
    manifest and is engine.restored_client_state after the restore; an
    engine without an optimizer, or made under not_the_training() (a
    reference model's), neither restores nor writes snapshots; a client
    state that is not JSON fails its snapshot alone."""
    engine = engine_of()
    engine.snapshot_client_state = lambda step: {"position": 10 * step}
    train(engine, 2)
    manifest = json.loads((snapshots / "step2" / "manifest.json").read_text())
    assert manifest["client_state"] == {"position": 20}
    folder = snapshots.parent / "restore" / "step2"
    shutil.copytree(snapshots / "step2", folder)
    monkeypatch.setenv("DUCTILE_SNAPSHOT_RESTORE", str(folder))
    monkeypatch.setenv("DUCTILE_SNAPSHOT_DIR", str(snapshots.parent / "own2"))
    restored = engine_of(seed=1)
    assert restored.restored_from_memory == 2
    assert restored.restored_client_state == {"position": 20}

    reference = zero3.initialize(make_model(seed=1), None, CONFIG)
    assert reference.restored_from_memory is None and reference.global_step == 0
    with _snapshots.not_the_training():
        beside = engine_of(seed=1)
    assert beside.restored_from_memory is None and beside.global_step == 0
    assert not same(snapshot(beside), snapshot(engine))
    train(beside, 1)
    assert not os.path.exists(snapshots.parent / "own2" / "step1")

    # A value that is not JSON fails the snapshot, which is logged; the
    # training goes on with the last one.
    engine.snapshot_client_state = lambda step: {"not JSON": object()}
    with caplog.at_level(logging.WARNING, logger="ductile.zero3"):
        train(engine, 1)
    assert engine.global_step == 3 and latest(snapshots) == "step2"
    assert "client_state cannot be written as JSON" in caplog.text


def test_a_restore_folder_still_to_come_is_waited_for(snapshots, monkeypatch):
    """Workers the agent started before the restore was whole
    (DUCTILE_SNAPSHOT_RESTORE_WAIT): initialize waits for the folder, which
    the agent links in place; one that does not come in time is an IoError
    naming both variables."""
    engine = engine_of()
    train(engine, 3)
    restore = snapshots.parent / "restore"
    restore.mkdir()
    pending = restore / "round2"
    monkeypatch.setenv("DUCTILE_SNAPSHOT_RESTORE", str(pending))
    monkeypatch.setenv("DUCTILE_SNAPSHOT_DIR", str(snapshots.parent / "own2"))
    monkeypatch.setenv("DUCTILE_SNAPSHOT_RESTORE_WAIT", "0.2")
    with pytest.raises(ductile.IoError, match=rf"DUCTILE_SNAPSHOT_RESTORE={pending}: the "
                       r"snapshot to resume from did not come within 0.2 s "
                       r"\(DUCTILE_SNAPSHOT_RESTORE_WAIT\)"):
        engine_of(seed=1)

    def agent():  # the copy done, the folder linked in place
        time.sleep(0.3)
        shutil.copytree(snapshots / "step3", restore / "step3")
        os.symlink("step3", restore / "round2.tmp")
        os.rename(restore / "round2.tmp", pending)

    monkeypatch.setenv("DUCTILE_SNAPSHOT_RESTORE_WAIT", "60")
    linking = threading.Thread(target=agent)
    linking.start()
    restored = engine_of(seed=1)
    linking.join()
    assert restored.global_step == 3 and restored.restored_from_memory == 3
    assert same(snapshot(restored), snapshot(engine))


def test_after_a_restore_the_agent_is_asked_to_free_it_before_the_next_snapshot(
        snapshots, monkeypatch, caplog):
    """Once a snapshot newer than the restored one is committed (and held
    by its replicas), the node's leader writes own/release, the restored
    step, and waits until the agent took it before the next snapshot is
    written; with no agent to take it, a warning after RELEASE_WAIT."""
    engine = engine_of()
    train(engine, 3)
    folder = snapshots.parent / "restore" / "step3"
    shutil.copytree(snapshots / "step3", folder)
    monkeypatch.setenv("DUCTILE_SNAPSHOT_RESTORE", str(folder))
    own = snapshots.parent / "own2"
    monkeypatch.setenv("DUCTILE_SNAPSHOT_DIR", str(own))
    restored = engine_of(seed=1)
    request = own / "release"
    taken = []

    def agent():  # takes the request as the agent's pass does
        deadline = time.monotonic() + 60
        while not request.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if request.exists():
            time.sleep(0.2)  # the step waits meanwhile
            taken.append((request.read_text(), tags(own)))
            request.unlink()

    thread = threading.Thread(target=agent)
    thread.start()
    train(restored, 1)  # step 4: its snapshot is the first newer one
    assert not taken and not request.exists()
    train(restored, 1)  # step 5 asks first, and waits
    thread.join()
    assert taken == [("3\n", ["step4"])]
    assert tags(own) == ["step4", "step5"] and not request.exists()
    train(restored, 1)  # asked once
    assert not request.exists()

    monkeypatch.setattr(_snapshots, "RELEASE_WAIT", 0.3)
    unattended = engine_of(seed=2)
    train(unattended, 2)
    assert f"the agent did not take {request} within 0 s" in caplog.text
    assert not request.exists()


def test_deepspeed_snapshot_object_and_its_scheduler_restored(snapshots, monkeypatch):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                            "warmup_max_lr": 1e-2}},
              "snapshot": {"interval": 2, "replicas": 3}}
    engine = zero3.initialize(make_model(seed=0), None, config)
    train(engine, 4)
    assert tags(snapshots) == ["step2", "step4"]
    assert (snapshots / "replicas").read_text() == "3\n"
    monkeypatch.setenv("DUCTILE_SNAPSHOT_RESTORE", str(snapshots / "step4"))
    restored = zero3.initialize(make_model(seed=1), None, config)
    assert restored.restored_from_memory == 4
    assert restored.lr_scheduler.state_dict() == engine.lr_scheduler.state_dict()
    assert [g["lr"] for g in restored.optimizer.param_groups] == \
        [g["lr"] for g in engine.optimizer.param_groups]
    assert same(snapshot(restored), snapshot(engine))
    # The DeepSpeed drop-in counts on from the restored step.
    dropin, *_ = ductile.deepspeed.initialize(model=make_model(seed=1), config=config)
    assert dropin.zero3.restored_from_memory == 4 and dropin.global_steps == 4
    assert dropin.global_samples == 4 * 2
    assert dropin.lr_scheduler.state_dict() == engine.lr_scheduler.state_dict()
    assert [g["lr"] for g in dropin.optimizer.param_groups] == \
        [g["lr"] for g in engine.optimizer.param_groups]
    assert same(snapshot(dropin.zero3), snapshot(engine))

    with pytest.raises(ductile.ConfigError, match=r"snapshot\.every is not a key of snapshot; "
                       r"valid: interval, replicas"):
        zero3.initialize(make_model(), None, dict(config, snapshot={"every": 2}))


def test_a_save_in_the_background_is_written_from_the_snapshot(snapshots, tmp_path):
    """save(background=True) after a step whose snapshot committed: the
    files come from the snapshot on a thread, the next step waits for the
    commit; the checkpoint holds the state of the save's step."""
    engine = engine_of()
    train(engine, 2)
    at_save = snapshot(engine)
    ckpt = tmp_path / "ckpt"
    engine.save(ckpt, client_state={"k": 1}, background=True)
    train(engine, 1)  # joins the save before its optimizer update
    assert engine.global_step == 3 and latest(ckpt) == "step2"
    assert sorted(os.listdir(ckpt)) == ["latest", "step2"]
    assert sorted(os.listdir(ckpt / "step2")) == [
        "manifest.json", "manifest.json.sha256", "rank0-of-1.bin"]
    checker = engine_of(seed=1)
    assert checker.load(ckpt) == {"k": 1}
    assert checker.global_step == 2 and same(snapshot(checker), at_save)
    # The same bytes as a save in the foreground, but for the save's id.
    engine2 = engine_of()
    train(engine2, 2)
    engine2.save(tmp_path / "fg")
    ours = (ckpt / "step2" / "rank0-of-1.bin").read_bytes()
    theirs = (tmp_path / "fg" / "step2" / "rank0-of-1.bin").read_bytes()
    assert len(ours) == len(theirs) and ours[-1000:] == theirs[-1000:]


def test_a_damaged_snapshot_fails_the_background_save_on_wait(snapshots, tmp_path):
    """The copy checks the snapshot's file (header, size): a damaged one
    fails the save when it is waited for, and nothing is committed."""
    engine = engine_of()
    train(engine, 2)
    shard = snapshots / "step2" / "rank0-of-1.bin"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 8)
    ckpt = tmp_path / "ckpt"
    engine.save(ckpt, background=True)
    with pytest.raises(ductile.IoError, match=r"rank0-of-1.bin: \d+ bytes of values, the state "
                                              r"takes \d+: the snapshot is damaged"):
        engine.wait_for_save()
    assert os.listdir(ckpt) == []
    engine.wait_for_save()  # nothing pending any more
    train(engine, 1)


def test_without_a_snapshot_of_the_step_the_save_is_written_at_once(snapshots, tmp_path,
                                                                    monkeypatch, caplog):
    engine = engine_of(with_keys(snapshot_interval=2))
    train(engine, 3)  # step 3 has no snapshot
    with caplog.at_level("WARNING", logger="ductile.zero3"):
        engine.save(tmp_path / "ckpt", background=True)
    assert latest(tmp_path / "ckpt") == "step3"
    assert "no snapshot of step 3 in memory on every rank" in caplog.text
    monkeypatch.delenv("DUCTILE_SNAPSHOT_DIR")
    engine = engine_of()
    train(engine, 1)
    engine.save(tmp_path / "plain", background=True)
    assert latest(tmp_path / "plain") == "step1"


def test_a_process_that_exits_after_a_background_save_commits_it(snapshots, tmp_path):
    script = tmp_path / "exits.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {HERE!r})\n"
        "import torch\n"
        "import ductile.torch.zero3 as zero3\n"
        "from zero3_checkpoint_support import train\n"
        "from zero3_launch import CONFIG\n"
        "from zero3_model import make_model\n"
        "engine = zero3.initialize(make_model(seed=0), "
        "lambda s: torch.optim.Adam(s, lr=1e-2), CONFIG)\n"
        "train(engine, 2)\n"
        f"engine.save({str(tmp_path / 'ckpt')!r}, background=True)\n")
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    assert latest(tmp_path / "ckpt") == "step2"
    engine = engine_of(seed=1)
    engine.load(tmp_path / "ckpt")
    assert engine.global_step == 2


def test_a_bad_local_rank_is_named(snapshots, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(ductile.InvalidArgumentError, match="LOCAL_RANK = 'first'; valid: this "
                       "process' rank on its node"):
        engine_of()


def test_the_toml_keys_are_checked(snapshots):
    with pytest.raises(ductile.ConfigError, match=r"snapshot_interval.*-1"):
        engine_of(with_keys(snapshot_interval=-1))
    with pytest.raises(ductile.ConfigError, match="snapshot_replicas"):
        engine_of(with_keys(snapshot_replicas='"two"'))


# --- 2 ranks, one "node" each ------------------------------------------------------


def test_two_nodes_write_identical_manifests_that_load_at_any_world_size(tmp_path):
    """2 ranks under torchrun, each the leader of its own node's folder
    (zero3_snapshot_worker.py): after 3 steps each folder holds steps 2
    and 3, with byte-identical manifests and its own rank's file; the two
    folders' files put together load at world size 2 (in the job) and 1
    (here) to the trained state. Then rank 1 dies in the middle of step 4's
    shard file: both folders still name step 3, which loads."""
    spec_path = prepare(tmp_path, "job", {}, CONFIG)
    out = tmp_path / "job"
    done = subprocess_run(command(2, "torchrun", os.path.join(HERE, "zero3_snapshot_worker.py"),
                                  str(spec_path)))
    assert done.returncode != 0  # rank 1's exit in the middle of step 4 ends the job
    for r in range(2):
        result = json.loads((out / f"result-rank{r}.json").read_text())
        assert result == {"equal": True, "global_step": 3}, (r, done.stderr[-3000:])
    after = out / "after3"
    manifests = []
    for r in range(2):
        node = after / f"node{r}"
        assert sorted(os.listdir(node)) == ["latest", "replicas", "step2", "step3"]
        for tag in ("step2", "step3"):
            assert sorted(os.listdir(node / tag)) == [
                "manifest.json", "manifest.json.sha256", f"rank{r}-of-2.bin"]
        manifests.append([(node / tag / name).read_bytes() for tag in ("step2", "step3")
                          for name in ("manifest.json", "manifest.json.sha256")])
        assert (node / "latest").read_text() == (after / "node0" / "latest").read_text()
    assert manifests[0] == manifests[1]
    assert json.loads(manifests[0][2])["world_size"] == 2

    # The nodes' live folders after the kill: step 3 is still the one
    # committed; node 1 keeps the debris of its half-written shard file,
    # step 2's moved into the staging folder to be written over in place.
    partial = out / "node1" / "step4.tmp" / "rank1-of-2.bin"
    assert partial.is_file() and not (out / "node1" / "step2" / "rank1-of-2.bin").exists()
    merged = tmp_path / "merged"
    merged.mkdir()
    for r in range(2):
        node = out / f"node{r}"
        assert latest(node) == "step3", r
        assert not (node / "step4").exists()
        for name in os.listdir(node / "step3"):
            shutil.copy(node / "step3" / name, merged)
    assert_loads_to(merged, out)


def test_two_ranks_of_one_node_share_its_folder(tmp_path):
    """2 ranks under torchrun on one node (LOCAL_RANK 0 and 1, one
    DUCTILE_SNAPSHOT_DIR): rank 0 leads, both write their file into the
    same snapshot, which loads at world size 1 to the trained state; so
    does the disk checkpoint saved from it in the background."""
    spec_path = prepare(tmp_path, "job", {"one_node": True}, CONFIG)
    out = tmp_path / "job"
    done = subprocess_run(command(2, "torchrun", os.path.join(HERE, "zero3_snapshot_worker.py"),
                                  str(spec_path)))
    assert done.returncode == 0, done.stderr[-3000:]
    node = out / "node-after3"
    assert sorted(os.listdir(node)) == ["latest", "replicas", "step2", "step3"]
    assert sorted(os.listdir(node / "step3")) == [
        "manifest.json", "manifest.json.sha256", "rank0-of-2.bin", "rank1-of-2.bin"]
    assert_loads_to(node, out)
    # The disk checkpoint written from step 3's snapshot while step 4
    # trained: the same state, a save's own id in every file's header.
    ckpt = out / "ckpt"
    assert latest(ckpt) == "step3"
    assert sorted(os.listdir(ckpt / "step3")) == [
        "manifest.json", "manifest.json.sha256", "rank0-of-2.bin", "rank1-of-2.bin"]
    manifest = json.loads((ckpt / "step3" / "manifest.json").read_text())
    assert manifest["client_state"] == {"at": 3}
    assert manifest["save_id"] != json.loads(
        (node / "step3" / "manifest.json").read_text())["save_id"]
    assert_loads_to(ckpt, out)
    failures = [json.loads((out / f"failed-rank{r}.json").read_text()) for r in range(2)]
    assert failures[1].startswith("IoError: ") and "the snapshot is damaged" in failures[1]
    assert failures[0].startswith("IoError: zero3 save: rank 1 of 2 failed: "), failures
    assert os.listdir(out / "ckpt-failed") == []


def assert_loads_to(folder, out):
    """`folder` loads at world size 1 to the parameters and optimizer state
    of the 2-rank job that wrote out/state-rank<r>.pt, at step 3."""
    shards = [torch.load(out / f"state-rank{r}.pt") for r in range(2)]
    one = engine_of(seed=1)
    one.load(folder)
    assert one.global_step == 3
    compared = 0
    for info in one._params:
        state = one.optimizer.state[info.shard]
        for key, value in [(info.name, info.shard)] + [
                (f"{info.name}.{k}", v) for k, v in state.items() if torch.is_tensor(v)
                and v.numel() == info.shard_numel]:
            whole = torch.cat([s[key] for s in shards])[:info.numel]
            assert torch.equal(value[:info.numel], whole), key
            compared += 1
    assert compared == 3 * len(one._params)  # the values, Adam's exp_avg and exp_avg_sq


def subprocess_run(argv):
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=240,
                          env=environment())
