"""A zero3 checkpoint's manifest is signed by its content: the save writes
its SHA-256 into `latest` and into manifest.json.sha256 beside it before the
commit, and a load checks it before parsing. The probe's edits (client
state "step" 6 -> 9, an optimizer scalar 6.0 -> 7.0) loaded silently and
training diverged; now any edit is refused naming the file. Checkpoints of
format version 2 (no checksum) still load."""

import hashlib
import json
import os
import sys

import pytest

import ductile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_checkpoint_support import (copy_of, engine_of, same, saved_checkpoint,  # noqa: E402
                                      snapshot)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_checkpoint(tmp_path_factory.mktemp("pristine"), 6, {"step": 6})


@pytest.fixture
def root(saved, tmp_path):
    return copy_of(saved[0], tmp_path)


def manifest_of(root):
    return root / "step6" / "manifest.json"


def rewrite(path, edit):
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=1))


def refused(load_from, pattern):
    engine = engine_of(seed=1)
    before = snapshot(engine)
    with pytest.raises(ductile.IoError, match=pattern) as error:
        engine.load(load_from)
    assert same(snapshot(engine), before) and engine.global_step == 0
    return str(error.value)


def test_the_save_signs_its_manifest(root, saved):
    manifest = manifest_of(root)
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert (root / "latest").read_text() == f"step6\nsha256 {digest}\n"
    assert (manifest.parent / "manifest.json.sha256").read_text() == f"{digest}  manifest.json\n"
    assert json.loads(manifest.read_text())["version"] == 3
    engine = engine_of(seed=1)
    assert engine.load(root) == {"step": 6} and same(snapshot(engine), saved[1])


def test_the_probes_edits_are_refused_naming_the_file(root):
    manifest = manifest_of(root)
    pristine = manifest.read_bytes()
    for edit in (lambda m: m["client_state"].update(step=9),
                 lambda m: m["optimizer"]["state"]["0"]["step"].update(tensor=7.0)):
        rewrite(manifest, edit)
        refused(root, f"{manifest}: its SHA-256 is [0-9a-f]{{64}}, but {root / 'latest'} records "
                      "[0-9a-f]{64}: the manifest was changed after the save; it is not loaded")
        manifest.write_bytes(pristine)
    # One byte that changes nothing JSON reads (a space) is an edit as well.
    manifest.write_bytes(pristine.replace(b'"step": 6', b'"step":  6', 1))
    refused(root, "its SHA-256 is .* the manifest was changed after the save")


def test_the_tag_folder_alone_is_checked_against_its_sidecar(root):
    manifest = manifest_of(root)
    sidecar = manifest.parent / "manifest.json.sha256"
    rewrite(manifest, lambda m: m["client_state"].update(step=9))
    refused(manifest.parent, f"but {sidecar} records")
    os.unlink(sidecar)
    refused(manifest.parent, "a version 3 manifest is loaded only with its checksum, and neither "
                             f"{sidecar} nor a checksum line in latest exists")
    sidecar.write_text("not a checksum\n")
    refused(manifest.parent, f"{sidecar}: not a manifest checksum")


def test_a_version_2_checkpoint_still_loads(root, saved):
    """As main before the checksum wrote it: manifest version 2, no
    sidecar, `latest` holding the folder's name alone."""
    manifest = manifest_of(root)
    rewrite(manifest, lambda m: m.update(version=2))
    os.unlink(manifest.parent / "manifest.json.sha256")
    (root / "latest").write_text("step6\n")
    engine = engine_of(seed=1)
    assert engine.load(root) == {"step": 6}
    assert same(snapshot(engine), saved[1]) and engine.global_step == 6
    assert engine_of(seed=1).load(manifest.parent) == {"step": 6}
    # A format this ductile does not know is named.
    rewrite(manifest, lambda m: m.update(version=4))
    refused(root, "checkpoint version 4; this ductile reads versions 2, 3")


def test_a_damaged_pointer_is_refused(root):
    latest = root / "latest"
    name, checksum = latest.read_text().split("\n")[:2]
    latest.write_text(f"{name}\n{checksum}\nmore\n")
    refused(root, "latest: not a checkpoint pointer")
    latest.write_text(f"{name}\nsha256 {'0' * 64}\n")
    refused(root, f"but {latest} records 0{{64}}")
