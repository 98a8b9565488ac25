"""A zero3 checkpoint's manifest is checked by its content: the save writes
its SHA-256 into `latest` and into manifest.json.sha256 beside it before the
commit, and a load checks it before parsing. The probe's edits (client
state "step" 6 -> 9, an optimizer scalar 6.0 -> 7.0) loaded silently and
training diverged; now any edit is refused naming the file. Checkpoints of
format version 2 (no checksum) still load, as do those of version 3, whose
shard files are checked by zlib's CRC-32 instead of CRC-32C.

That SHA-256 is no key: whoever can edit the manifest can recompute it, and
such a forgery loads (shown below, as the documented limit). With a key
(DUCTILE_CHECKPOINT_KEY or DUCTILE_CHECKPOINT_KEY_FILE) the save writes
manifest.json.hmac, the HMAC-SHA256 of the manifest under the key, and every
shard file's SHA-256 into the manifest; a load with the key refuses a
manifest whose HMAC does not verify, a checkpoint without one, and a shard
file whose SHA-256 differs."""

import hashlib
import hmac
import json
import os
import sys
import zlib

import pytest

import ductile
from ductile import _ductile

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
    written = json.loads(manifest.read_text())
    assert written["version"] == 4
    shard = (manifest.parent / "rank0-of-1.bin").read_bytes()
    assert written["shards"] == [{"file": "rank0-of-1.bin", "bytes": len(shard),
                                  "crc32c": _ductile.shard_io.crc32c(shard)}]
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
    refused(manifest.parent, "a version 4 manifest is loaded only with its checksum, and neither "
                             f"{sidecar} nor a checksum line in latest exists")
    sidecar.write_text("not a checksum\n")
    refused(manifest.parent, f"{sidecar}: not a manifest checksum")


def rewritten_as(root, version):
    """The checkpoint's manifest rewritten as format `version` (2 or 3) has
    it: each shard record holds zlib's CRC-32 of the file under "crc32", no
    "crc32c"."""
    manifest = manifest_of(root)

    def edit(m):
        m["version"] = version
        for record in m["shards"]:
            record.pop("crc32c")
            record["crc32"] = zlib.crc32((manifest.parent / record["file"]).read_bytes())
    rewrite(manifest, edit)
    return manifest


def test_a_version_2_checkpoint_still_loads(root, saved):
    """As the format was before the manifest's checksum: manifest version
    2 (shards under zlib's CRC-32), no sidecar, `latest` holding the
    folder's name alone."""
    manifest = rewritten_as(root, 2)
    os.unlink(manifest.parent / "manifest.json.sha256")
    (root / "latest").write_text("step6\n")
    engine = engine_of(seed=1)
    assert engine.load(root) == {"step": 6}
    assert same(snapshot(engine), saved[1]) and engine.global_step == 6
    assert engine_of(seed=1).load(manifest.parent) == {"step": 6}
    # A format this ductile does not know is named.
    rewrite(manifest, lambda m: m.update(version=5))
    refused(root, "checkpoint version 5; this ductile reads versions 2, 3, 4")


def resign(manifest, root):
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
    (manifest.parent / "manifest.json.sha256").write_text(f"{digest}  manifest.json\n")
    (root / "latest").write_text(f"step6\nsha256 {digest}\n")


def test_a_version_3_checkpoint_loads_checked_by_crc32(root, saved):
    """Version 3 records zlib's CRC-32 of each shard file; it loads, checked
    by that, and a damaged shard is named by CRC-32 (not CRC-32C)."""
    manifest = rewritten_as(root, 3)
    resign(manifest, root)
    engine = engine_of(seed=1)
    assert engine.load(root) == {"step": 6}
    assert same(snapshot(engine), saved[1]) and engine.global_step == 6
    pristine = manifest.read_bytes()
    rewrite(manifest, lambda m: m["shards"][0].update(crc32=m["shards"][0]["crc32"] ^ 1))
    resign(manifest, root)
    message = refused(root, "the shard file is corrupt")
    assert "rank0-of-1.bin: CRC-32 0x" in message, message
    # A version 3 manifest carries "crc32": one with "crc32c" alone is damaged.
    manifest.write_bytes(pristine)
    rewrite(manifest, lambda m: m["shards"][0].update(crc32c=m["shards"][0].pop("crc32")))
    resign(manifest, root)
    refused(root, r"'shards' must list rank0..rank0's file, size and CRC-32 \('crc32'\)")


def test_a_version_4_manifest_needs_crc32c(root):
    """Version 4 checks shard files by CRC-32C alone: a record of zlib's
    CRC-32 in its place is refused, naming the key."""
    manifest = rewritten_as(root, 3)
    rewrite(manifest, lambda m: m.update(version=4))
    resign(manifest, root)
    refused(root, r"manifest.json: 'shards' must list rank0..rank0's file, size and CRC-32C "
                  r"\('crc32c'\)")


def test_a_damaged_pointer_is_refused(root):
    latest = root / "latest"
    name, checksum = latest.read_text().split("\n")[:2]
    latest.write_text(f"{name}\n{checksum}\nmore\n")
    refused(root, "latest: not a checkpoint pointer")
    latest.write_text(f"{name}\nsha256 {'0' * 64}\n")
    refused(root, f"but {latest} records 0{{64}}")


KEY = "a3f1c9e0b7d24e6f8a1b2c3d4e5f6071"
KEY_VARIABLES = ("DUCTILE_CHECKPOINT_KEY", "DUCTILE_CHECKPOINT_KEY_FILE")


@pytest.fixture(autouse=True)
def no_key(monkeypatch):
    """Every test starts without a key, whatever the environment holds."""
    for name in KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def signed_saved(tmp_path_factory):
    os.environ["DUCTILE_CHECKPOINT_KEY"] = KEY
    try:
        return saved_checkpoint(tmp_path_factory.mktemp("signed"), 6, {"step": 6})
    finally:
        del os.environ["DUCTILE_CHECKPOINT_KEY"]


@pytest.fixture
def signed_root(signed_saved, tmp_path):
    return copy_of(signed_saved[0], tmp_path)


def forge(root, edit):
    """What someone who can write the checkpoint but has no key can do: edit
    the manifest and record its new SHA-256 wherever the load checks one."""
    manifest = manifest_of(root)
    rewrite(manifest, edit)
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
    (manifest.parent / "manifest.json.sha256").write_text(f"{digest}  manifest.json\n")
    (root / "latest").write_text(f"step6\nsha256 {digest}\n")


def injected(m):
    m["client_state"] = {"step": 999, "injected": True}


def test_without_a_key_a_forged_manifest_loads_the_checksum_is_no_signature(root):
    """The documented limit: without a key the SHA-256 finds damage, not a
    forger, who recomputes it: the injected client state is returned."""
    forge(root, injected)
    engine = engine_of(seed=1)
    assert engine.load(root) == {"step": 999, "injected": True}


def test_a_keyed_save_signs_and_a_keyed_load_refuses_the_forgery(signed_root, signed_saved,
                                                                 monkeypatch):
    manifest = manifest_of(signed_root)
    hmac_file = manifest.parent / "manifest.json.hmac"
    mac = hmac.new(KEY.encode(), manifest.read_bytes(), hashlib.sha256).hexdigest()
    assert hmac_file.read_text() == f"hmac-sha256 {mac}  manifest.json\n"
    for record in json.loads(manifest.read_text())["shards"]:
        shard = (manifest.parent / record["file"]).read_bytes()
        assert record["sha256"] == hashlib.sha256(shard).hexdigest()
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY", KEY)
    engine = engine_of(seed=1)
    assert engine.load(signed_root) == {"step": 6} and same(snapshot(engine), signed_saved[1])

    forge(signed_root, injected)
    message = refused(signed_root, "HMAC-SHA256")
    assert message == (f"{manifest}: its HMAC-SHA256 under the key of DUCTILE_CHECKPOINT_KEY is "
                       f"not the one {hmac_file} records: the manifest was changed after the "
                       "save, or signed with another key; it is not loaded")
    # Another key is refused the same way.
    forge(signed_root, lambda m: None)
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY", KEY[::-1])
    refused(signed_root, "under the key of DUCTILE_CHECKPOINT_KEY is not the one")


def test_a_keyed_checkpoint_loads_without_the_key_still_checked_for_damage(signed_root,
                                                                           signed_saved):
    engine = engine_of(seed=1)
    assert engine.load(signed_root) == {"step": 6} and same(snapshot(engine), signed_saved[1])
    manifest = manifest_of(signed_root)
    rewrite(manifest, injected)
    refused(signed_root, "its SHA-256 is .* the manifest was changed after the save")


def test_a_keyed_load_refuses_a_checkpoint_without_an_hmac(root, monkeypatch):
    """A checkpoint saved without a key (or before keys existed) is refused
    under one: it would otherwise be a way around the HMAC."""
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY", KEY)
    hmac_file = manifest_of(root).parent / "manifest.json.hmac"
    message = refused(root, "no HMAC of the manifest")
    assert message.startswith(f"{hmac_file}: no HMAC of the manifest, and "
                              "DUCTILE_CHECKPOINT_KEY gives a key")


def test_a_shard_changed_under_a_valid_hmac_is_refused_by_its_sha256(signed_root, monkeypatch):
    """CRC-32C is no defence against a forger: a shard file changed and its
    CRC-32C and size recorded again, under a manifest whose HMAC verifies (as
    if the CRC had been forged to match), is refused by the SHA-256 the
    signed manifest records."""
    folder = manifest_of(signed_root).parent
    shard = folder / "rank0-of-1.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    manifest = manifest_of(signed_root)
    rewrite(manifest, lambda m: m["shards"][0].update(crc32c=_ductile.shard_io.crc32c(data)))
    text = manifest.read_bytes()
    mac = hmac.new(KEY.encode(), text, hashlib.sha256).hexdigest()
    (folder / "manifest.json.hmac").write_text(f"hmac-sha256 {mac}  manifest.json\n")
    digest = hashlib.sha256(text).hexdigest()
    (folder / "manifest.json.sha256").write_text(f"{digest}  manifest.json\n")
    (signed_root / "latest").write_text(f"step6\nsha256 {digest}\n")
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY", KEY)
    refused(signed_root, f"{shard}: its SHA-256 is [0-9a-f]{{64}}, but the signed {manifest} "
                         "records [0-9a-f]{64}: the shard file was changed after the save")


def test_the_key_file_is_read_by_the_bounded_reader(root, tmp_path, monkeypatch):
    engine = engine_of(seed=1)
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY_FILE", str(fifo))
    # A blocking open of the FIFO would wait for a writer forever.
    with pytest.raises(ductile.IoError, match=f"{fifo}: is a FIFO, not a regular file; give a "
                                              "regular checkpoint key file .named by "
                                              "DUCTILE_CHECKPOINT_KEY_FILE."):
        engine.load(root)
    big = tmp_path / "key.big"
    big.write_bytes(b"k" * 5000)
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY_FILE", str(big))
    with pytest.raises(ductile.IoError, match="is 5000 bytes, over the 4096 bytes cap"):
        engine.load(root)
    short = tmp_path / "key.short"
    short.write_text("secret\n")
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY_FILE", str(short))
    with pytest.raises(ductile.InvalidArgumentError,
                       match=f"the key of {short} .named by DUCTILE_CHECKPOINT_KEY_FILE. has 6 "
                             "bytes; valid: at least 16"):
        engine.save(tmp_path / "out")
    assert not (tmp_path / "out" / "latest").exists()
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY", KEY)
    with pytest.raises(ductile.InvalidArgumentError, match="both DUCTILE_CHECKPOINT_KEY_FILE "
                                                           "and DUCTILE_CHECKPOINT_KEY are set"):
        engine.load(root)
    monkeypatch.delenv("DUCTILE_CHECKPOINT_KEY")
    # A key file signs as the variable does: its blanks at the ends dropped.
    good = tmp_path / "key.good"
    good.write_text(KEY + "\n")
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY_FILE", str(good))
    engine.save(tmp_path / "keyed")
    monkeypatch.delenv("DUCTILE_CHECKPOINT_KEY_FILE")
    monkeypatch.setenv("DUCTILE_CHECKPOINT_KEY", KEY)
    assert engine_of(seed=1).load(tmp_path / "keyed") is None


def test_two_ranks_sign_their_shards_and_every_rank_refuses_a_forgery(tmp_path):
    """2 ranks (mpirun; a third costs another process on the 2-core CI
    machine and adds no code path). With the key, the save records each
    rank's shard SHA-256 under rank 0's HMAC; a forged manifest (new SHA-256
    recorded, no key) is refused by every rank loading with the key, the
    model and optimizer left as they were."""
    from zero3_launch import launch
    keyed = {"DUCTILE_CHECKPOINT_KEY": KEY}
    launch(tmp_path, "save", {"mode": "zero3", "steps": 2, "save_at": [2]}, ranks=2, env=keyed)
    root = tmp_path / "save" / "step2"
    folder = root / "step2"
    text = (folder / "manifest.json").read_bytes()
    mac = hmac.new(KEY.encode(), text, hashlib.sha256).hexdigest()
    assert (folder / "manifest.json.hmac").read_text() == f"hmac-sha256 {mac}  manifest.json\n"
    shards = json.loads(text)["shards"]
    assert [s["file"] for s in shards] == [f"rank{r}-of-2.bin" for r in range(2)]
    for record in shards:
        assert record["sha256"] == hashlib.sha256((folder / record["file"]).read_bytes()) \
            .hexdigest()

    manifest = folder / "manifest.json"
    rewrite(manifest, injected)
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
    (folder / "manifest.json.sha256").write_text(f"{digest}  manifest.json\n")
    (root / "latest").write_text(f"step2\nsha256 {digest}\n")
    result, _, _ = launch(tmp_path, "load", {"mode": "load_error", "load": str(root)}, ranks=2,
                          all_ranks=True, env=keyed)
    assert len(result) == 2
    for outcome in result:
        assert outcome["class"] == "IoError", outcome
        assert "its HMAC-SHA256 under the key of DUCTILE_CHECKPOINT_KEY is not the one" in \
            outcome["message"], outcome
        assert outcome["unchanged"], outcome
