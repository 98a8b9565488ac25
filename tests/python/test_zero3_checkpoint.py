"""zero3 checkpoints that commit atomically: a save killed (SIGKILL) at any
of its writes, fsyncs, renames and removals leaves the previous checkpoint
or the new one, whole; files of two saves never mix silently; a failed load
changes nothing; on 2 ranks one rank's load error reaches the other at
once."""

import hashlib
import json
import os
import shutil
import signal
import sys

import pytest

import torch

import ductile
import ductile.torch.zero3 as zero3
from ductile.torch.zero3 import _checkpoint_files as _checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_checkpoint_support import engine_of, same, snapshot, train  # noqa: E402
from zero3_launch import CONFIG, launch  # noqa: E402
from zero3_model import make_model  # noqa: E402


def sign(manifest_path, latest=None):
    """Writes the checksum of an edited manifest where a save puts it (its
    sidecar and `latest`), so a test reaches the checks behind it."""
    digest = hashlib.sha256(manifest_path.read_bytes()).hexdigest()
    (manifest_path.parent / "manifest.json.sha256").write_text(f"{digest}  manifest.json\n")
    if latest is not None:
        name = latest.read_text().split("\n")[0]
        latest.write_text(f"{name}\nsha256 {digest}\n")


def test_a_save_commits_through_latest_and_loads_back(tmp_path):
    engine = engine_of()
    train(engine, 2)
    root = tmp_path / "ckpt"
    engine.save(root, client_state={"note": "x"})
    assert sorted(os.listdir(root)) == ["latest", "step2"]
    digest = hashlib.sha256((root / "step2" / "manifest.json").read_bytes()).hexdigest()
    assert (root / "latest").read_text() == f"step2\nsha256 {digest}\n"
    assert (root / "step2" / "manifest.json.sha256").read_text() == f"{digest}  manifest.json\n"
    assert sorted(os.listdir(root / "step2")) == ["manifest.json", "manifest.json.sha256",
                                                  "rank0-of-1.bin"]
    manifest = json.loads((root / "step2" / "manifest.json").read_text())
    assert manifest["step"] == 2 and len(manifest["save_id"]) == 32
    assert [s["file"] for s in manifest["shards"]] == ["rank0-of-1.bin"]
    saved = snapshot(engine)

    other = engine_of(seed=1)
    assert not same(snapshot(other), saved)
    assert other.load(root) == {"note": "x"}
    assert other.global_step == 2
    assert same(snapshot(other), saved)
    assert other.load(root / "step2") == {"note": "x"}  # a tag folder directly

    # A second save of the same tag replaces the first; other tags stay.
    train(engine, 1)
    engine.save(root, tag="step2")
    engine.save(root)
    assert sorted(os.listdir(root)) == ["latest", "step2.1", "step3"]
    assert (root / "latest").read_text().startswith("step3\nsha256 ")
    with pytest.raises(ductile.InvalidArgumentError, match="tag 'a/b' is not a valid folder"):
        engine.save(root, tag="a/b")


def test_a_save_killed_at_any_operation_leaves_the_old_or_the_new_checkpoint(tmp_path):
    """The child process saves step 3 over a root whose latest is step 2,
    under the same tag (so the commit also removes the superseded folder),
    and sends itself SIGKILL before its k-th file-system operation, for
    every k; then the root loads, into another engine, exactly step 2's or
    step 3's parameters, optimizer state and client state; and a new save
    over the debris commits."""
    engine = engine_of()
    train(engine, 2)
    pristine = tmp_path / "pristine"
    engine.save(pristine, client_state={"step": 2}, tag="model")
    old = snapshot(engine)
    train(engine, 1)
    new = snapshot(engine)

    operations = []
    probe = tmp_path / "probe"
    shutil.copytree(pristine, probe)
    _checkpoint._fault_hook = lambda op, path: operations.append(op)
    try:
        engine.save(probe, client_state={"step": 3}, tag="model")
    finally:
        _checkpoint._fault_hook = None
    kinds = set(operations)
    assert {"mkdir", "create", "write", "fsync", "rename", "remove"} <= kinds, kinds
    assert operations.count("rename") == 2  # the folder, then latest: the commit

    checker = engine_of(seed=1)
    outcomes = {"old": 0, "new": 0}
    for k in range(1, len(operations) + 1):
        work = tmp_path / f"kill{k}"
        shutil.copytree(pristine, work)
        pid = os.fork()
        if pid == 0:  # the child: save until the k-th operation, then die
            count = [0]

            def hook(op, path):
                count[0] += 1
                if count[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)
            _checkpoint._fault_hook = hook
            try:
                engine.save(work, client_state={"step": 3}, tag="model")
            finally:
                os._exit(3)  # not reached: killed inside the save
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (k, status)
        client = checker.load(work)
        got = snapshot(checker)
        if client == {"step": 2}:
            assert checker.global_step == 2 and same(got, old), f"kill at {k}: a mix"
            outcomes["old"] += 1
        else:
            assert client == {"step": 3}, (k, client)
            assert checker.global_step == 3 and same(got, new), f"kill at {k}: a mix"
            outcomes["new"] += 1
        engine.save(work, client_state={"step": 3}, tag="model")  # over the debris
        assert checker.load(work) == {"step": 3}
        left = sorted(os.listdir(work))  # the committed folder only: debris removed
        assert left == ["latest", (work / "latest").read_text().split("\n")[0]], left
        shutil.rmtree(work)
    # Up to the rename of latest the old checkpoint; after it the new one.
    commit = len(operations) - operations[::-1].index("rename")
    assert outcomes == {"old": commit, "new": len(operations) - commit}, outcomes


def test_files_of_two_saves_never_mix_silently(tmp_path):
    engine = engine_of()
    train(engine, 1)
    engine.save(tmp_path / "a")
    train(engine, 1)
    engine.save(tmp_path / "b")
    stale = tmp_path / "b" / "step2" / "rank0-of-1.bin"
    shutil.copy(tmp_path / "a" / "step1" / "rank0-of-1.bin", stale)
    with pytest.raises(ductile.IoError, match=r"rank0-of-1.bin: this shard file belongs to save "
                       r"[0-9a-f]{32} \(step 1.*step2/manifest.json to save [0-9a-f]{32} "
                       r"\(step 2.*mixes files of two saves"):
        engine.load(tmp_path / "b")


def test_a_failed_load_changes_nothing(tmp_path):
    engine = engine_of()
    train(engine, 2)
    root = tmp_path / "ckpt"
    engine.save(root)
    train(engine, 1)
    before = snapshot(engine)
    shard = root / "step2" / "rank0-of-1.bin"
    data = bytearray(shard.read_bytes())

    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ductile.IoError, match=r"rank0-of-1.bin: CRC-32C 0x[0-9a-f]{8} differs "
                                              r"from the manifest's 0x[0-9a-f]{8}: the shard "
                                              r"file is corrupt"):
        engine.load(root)
    assert same(snapshot(engine), before) and engine.global_step == 3
    shard.write_bytes(bytes(data[:-8]))
    with pytest.raises(ductile.IoError, match=r"rank0-of-1.bin: \d+ bytes, expected"):
        engine.load(root)
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))

    manifest_path = root / "step2" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    broken = dict(manifest)
    broken["optimizer"] = dict(manifest["optimizer"], param_groups=[
        dict(manifest["optimizer"]["param_groups"][0], params=[0])])
    manifest_path.write_text(json.dumps(broken))
    sign(manifest_path, root / "latest")
    with pytest.raises(ductile.IncompatibleError, match="parameter groups differ"):
        engine.load(root)
    assert same(snapshot(engine), before) and engine.global_step == 3

    sgd = zero3.initialize(make_model(layers=1), lambda ps: torch.optim.SGD(ps, lr=0.1), CONFIG)
    manifest_path.write_text(json.dumps(manifest))
    sign(manifest_path, root / "latest")
    with pytest.raises(ductile.IncompatibleError, match="optimizer is Adam"):
        sgd.load(root)
    with pytest.raises(ductile.IncompatibleError, match=r"manifest.json: the checkpoint has"):
        engine_of(layers=2).load(root)
    (root / "latest").write_text("step7\n")
    with pytest.raises(ductile.IoError, match=r"latest: names 'step7', which does not exist"):
        engine.load(root)
    manifest_path.write_text("{not json")
    (root / "latest").write_text("step2\n")
    sign(manifest_path)
    with pytest.raises(ductile.IoError, match=r"manifest.json: .*not valid JSON"):
        engine.load(root)
    with pytest.raises(ductile.IoError, match="no checkpoint: neither 'latest' nor"):
        engine.load(tmp_path / "nowhere")
    assert same(snapshot(engine), before)


# --- 2 ranks -------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_one_ranks_load_error_reaches_the_other_at_once(tmp_path, launcher):
    """Rank 1's shard file is corrupt: rank 1 fails its check, and rank 0,
    whose own file is fine, raises too, naming rank 1 and the file, without
    waiting for a collective timeout (the config's is 120 s)."""
    spec = {"mode": "zero3", "steps": 2, "save_at": [2]}
    result, _, _ = launch(tmp_path, "save", spec, ranks=2, launcher=launcher)
    root = tmp_path / "save" / "step2"
    shard = root / "step2" / "rank1-of-2.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    spec = {"mode": "load_error", "load": str(root)}
    result, _, _ = launch(tmp_path, "load", spec, ranks=2, launcher=launcher, all_ranks=True)
    errors = {r["rank"]: r for r in result}
    assert errors[1]["class"] == "IoError"
    assert "rank1-of-2.bin: CRC-32C " in errors[1]["message"]
    assert errors[0]["class"] == "IoError"
    assert "rank 1 of 2 failed" in errors[0]["message"]
    assert "rank1-of-2.bin: CRC-32C " in errors[0]["message"]
    assert all(r["unchanged"] for r in result)
    print(f"{launcher}: the error reached rank 0 {errors[0]['seconds']:.2f} s after its load began")


@pytest.mark.parametrize("kill,expected", [
    ("1:write:3", 2),    # rank 1 in the middle of its shard
    ("0:create:1", 2),   # rank 0 before creating its shard
    ("0:rename:2", 2),   # rank 0 right before the rename of latest (the commit)
    ("0:fsync:7", 3),    # rank 0 right after it, before the folder's fsync
])
def test_a_two_rank_save_killed_leaves_a_whole_checkpoint(tmp_path, kill, expected):
    """2 ranks (mpirun) save step 2, then step 3 into one root; one rank is
    killed at an operation of the second save. The root then loads on 1
    rank as step 2 or step 3, whole: the parameters rank 0 wrote out after
    that step, bit for bit."""
    spec = {"mode": "zero3", "steps": 3, "save_at": [2, 3], "save_root": True,
            "dump_at": [2, 3], "kill_on_save": 2, "kill": kill}
    launch(tmp_path, "killed", spec, ranks=2, launcher="mpirun", expect_failure=True)
    out = tmp_path / "killed"
    checker = zero3.initialize(make_model(seed=0), lambda ps: torch.optim.Adam(ps, lr=3e-3),
                               CONFIG)
    client = checker.load(out / "root")
    assert client == {"step": expected}
    params = checker.full_parameters()
    reference = torch.load(out / f"params-step{expected}.pt")
    for name, value in reference.items():
        assert torch.equal(params[name], value), name
