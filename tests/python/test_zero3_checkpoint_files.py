"""Every file a zero3 checkpoint load opens is checked before a byte of it
is read: a regular file, within what it can hold, not reached through a
link out of the checkpoint. A FIFO as `latest`, as the manifest or as one
rank's shard blocked the load for ever (the rank in open(), the other in
the next collective until its timeout); now every rank raises at once, the
failing rank's error reaching the other through the agreement step."""

import hashlib
import json
import os
import shutil
import sys

import pytest

import ductile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_checkpoint_support import (copy_of, engine_of, same, saved_checkpoint,  # noqa: E402
                                      snapshot)
from zero3_launch import launch  # noqa: E402


def replace_with_fifo(path):
    os.unlink(path)
    os.mkfifo(path)


def test_a_fifo_latest_manifest_or_shard_is_refused_at_once_on_two_ranks(tmp_path):
    """The probe's three cases, loaded one after another by the same 2-rank
    job (mpirun): each load raises an IoError on both ranks naming the FIFO,
    and leaves the model and optimizer as they were."""
    launch(tmp_path, "save", {"mode": "zero3", "steps": 2, "save_at": [2]}, ranks=2)
    saved = tmp_path / "save" / "step2"
    roots = {}
    for case, relative in (("latest", "latest"), ("manifest", "step2/manifest.json"),
                           ("shard", "step2/rank1-of-2.bin")):
        root = tmp_path / f"fifo_{case}"
        shutil.copytree(saved, root)
        replace_with_fifo(root / relative)
        roots[case] = root
    spec = {"mode": "load_error", "loads": [str(roots[c]) for c in ("latest", "manifest", "shard")]}
    result, _, _ = launch(tmp_path, "load", spec, ranks=2, all_ranks=True)
    by_case = {case: [result[r][i] for r in range(2)]
               for i, case in enumerate(("latest", "manifest", "shard"))}

    # Both ranks open latest and the manifest: each refuses the FIFO itself.
    for case, expected in (("latest", "latest: the checkpoint pointer is a FIFO, not a regular "
                                      "file"),
                           ("manifest", "manifest.json: the checkpoint manifest is a FIFO, not "
                                        "a regular file")):
        for r, outcome in enumerate(by_case[case]):
            assert outcome["class"] == "IoError", (case, r, outcome)
            assert expected in outcome["message"], (case, r, outcome)
            assert outcome["unchanged"], (case, r)
    # Only rank 1 reads its shard: rank 0 hears of it from the agreement.
    rank0, rank1 = by_case["shard"]
    assert rank1["class"] == "IoError", rank1
    assert "rank1-of-2.bin: the shard file of rank 1 is a FIFO, not a regular file" in \
        rank1["message"], rank1
    assert rank0["class"] == "IoError", rank0
    assert "rank 1 of 2 failed" in rank0["message"] and "rank1-of-2.bin" in rank0["message"]
    assert rank0["unchanged"] and rank1["unchanged"]
    for case, outcomes in by_case.items():
        print(f"FIFO {case}: refused on rank 0 after {outcomes[0]['seconds']:.2f} s, rank 1 "
              f"after {outcomes[1]['seconds']:.2f} s")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A one-rank checkpoint (step 2) and the snapshot it holds."""
    return saved_checkpoint(tmp_path_factory.mktemp("pristine"), 2, {"step": 2})


@pytest.fixture
def copy(checkpoint, tmp_path):
    return copy_of(checkpoint[0], tmp_path)


def refused(root, pattern):
    engine = engine_of(seed=1)
    before = snapshot(engine)
    with pytest.raises(ductile.IoError, match=pattern):
        engine.load(root)
    assert same(snapshot(engine), before)


def test_links_out_of_the_checkpoint_are_refused(copy, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    for relative in ("latest", "step2/manifest.json", "step2/rank0-of-1.bin"):
        target = outside / os.path.basename(relative)
        shutil.copy(copy / relative, target)
        os.unlink(copy / relative)
        os.symlink(target, copy / relative)
        what = {"latest": "checkpoint pointer", "step2/manifest.json": "checkpoint manifest",
                "step2/rank0-of-1.bin": "shard file of rank 0"}[relative]
        refused(copy, f"{os.path.basename(relative)}: the {what} is a link to {target}, out of "
                      f"the checkpoint")
        os.unlink(copy / relative)
        shutil.copy(target, copy / relative)
    # A tag folder that is a link to a folder elsewhere: its files lie out of it.
    shutil.move(copy / "step2", outside / "step2")
    os.symlink(outside / "step2", copy / "step2")
    refused(copy, "manifest.json: the checkpoint manifest is a link to .*, out of the checkpoint")


def test_a_link_inside_the_checkpoint_loads(copy, checkpoint):
    (copy / "kept").mkdir()
    shutil.move(copy / "step2" / "rank0-of-1.bin", copy / "kept" / "rank0-of-1.bin")
    os.symlink(os.path.join("..", "kept", "rank0-of-1.bin"), copy / "step2" / "rank0-of-1.bin")
    engine = engine_of(seed=1)
    assert engine.load(copy) == {"step": 2}
    assert same(snapshot(engine), checkpoint[1])


def test_directories_and_oversized_files_are_refused_unread(copy):
    pointer = (copy / "latest").read_bytes()
    os.unlink(copy / "latest")
    (copy / "latest").mkdir()
    refused(copy, "latest: the checkpoint pointer is a directory, not a regular file")
    os.rmdir(copy / "latest")
    (copy / "latest").write_bytes(pointer + b"\n" * 5000)
    refused(copy, r"latest: the checkpoint pointer has 50\d\d bytes, more than the 4096 it can "
                  "have")
    (copy / "latest").write_bytes(pointer)
    shard = copy / "step2" / "rank0-of-1.bin"
    size = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\0" * 10)
    refused(copy, f"rank0-of-1.bin: the shard file of rank 0 has {size + 10} bytes, more than "
                  f"the {size} it can have")


def test_the_fifo_cases_on_one_rank(copy):
    for relative, what in (("step2/rank0-of-1.bin", "shard file of rank 0"),
                           ("step2/manifest.json", "checkpoint manifest"),
                           ("latest", "checkpoint pointer")):
        replace_with_fifo(copy / relative)
        refused(copy, f"{os.path.basename(relative)}: the {what} is a FIFO, not a regular file")


def test_a_manifest_that_disagrees_with_a_shards_size_names_both_sizes(copy):
    """A parameter's shard_numel edited to 2**40 (and the checksums recorded
    again): the file's size matches the manifest's record but not the
    layout its parameters give; both numbers are named, not the same one
    twice."""
    manifest = copy / "step2" / "manifest.json"
    entries = json.loads(manifest.read_text())
    size = entries["shards"][0]["bytes"]
    entries["parameters"][0]["shard_numel"] = 2 ** 40
    text = json.dumps(entries, indent=1).encode()
    manifest.write_bytes(text)
    digest = hashlib.sha256(text).hexdigest()
    (copy / "step2" / "manifest.json.sha256").write_text(f"{digest}  manifest.json\n")
    (copy / "latest").write_text(f"step2\nsha256 {digest}\n")
    engine = engine_of(seed=1)
    with pytest.raises(ductile.Error) as error:
        engine.load(copy)
    message = str(error.value)
    assert f"rank0-of-1.bin: {size} bytes, but the parameters {manifest} lists take " in message
    taken = int(message.split(" lists take ")[1].split(" ")[0])
    assert taken > 2 ** 40 and taken != size


def test_a_save_never_writes_through_a_planted_link(copy, tmp_path, monkeypatch):
    """The save creates each file with O_EXCL | O_NOFOLLOW: a link planted
    where a file is about to be written is not followed onto its target."""
    from ductile.torch.zero3 import _checkpoint_files
    victim = tmp_path / "victim"
    victim.write_text("precious")
    engine = engine_of(seed=1)

    def plant(operation, path):
        if operation == "create" and path.endswith("rank0-of-1.bin"):
            os.symlink(victim, path)

    monkeypatch.setattr(_checkpoint_files, "_fault_hook", plant)
    with pytest.raises(ductile.IoError, match="rank0-of-1.bin: cannot write the shard file: "
                                              "File exists"):
        engine.save(tmp_path / "out")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "out" / "latest").exists()
