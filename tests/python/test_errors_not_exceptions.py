"""Bad input raises a ductile.Error naming the argument or the file, never
an exception of the runtime, and a failed or killed save leaves nothing
behind. The probe's cases: load_config with a lone surrogate or a dict
holding a set (raw TypeError); `latest` a directory, not UTF-8, or a manifest
nested 10^5 deep (IsADirectoryError, UnicodeDecodeError, RecursionError);
a save tag with NUL or a surrogate (ValueError, UnicodeEncodeError, and a
half-written folder left); a killed save's <tag>.tmp kept after a load;
read_metric(None) and write_metric into a missing folder (raw exceptions);
write_metric of negative values (a file read_metric refuses)."""

import errno
import hashlib
import os
import signal
import sys

import numpy as np
import pytest

import ductile
from ductile import metrics
from ductile.torch.zero3 import _checkpoint_files as _checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_checkpoint_support import engine_of, same, snapshot, train  # noqa: E402


def test_load_config_refuses_what_it_cannot_read():
    with pytest.raises(ductile.ConfigError, match=r"lone surrogate at index 3 \('\\ud800'\)"):
        ductile.load_config("job\ud800.toml")
    with pytest.raises(ductile.ConfigError, match="lone surrogate"):
        ductile.load_config('[elasticity]\npolicy = "\ud800"\n')
    with pytest.raises(ductile.ConfigError,
                       match="<dict>: the DeepSpeed config cannot be written as JSON: Object of "
                             "type set is not JSON serializable"):
        ductile.load_config({"elasticity": {"micro_batch_sizes": {2, 4}}})
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"\[elasticity\] 'micro_batch_sizes': a value of type set"):
        ductile.load_config({"elasticity": {"micro_batch_sizes": {2, 4}}}, format="toml")
    with pytest.raises(ductile.InvalidArgumentError, match="plugin_path = 3 is not a list"):
        ductile.load_config({"elasticity": {}}, plugin_path=3)
    # A file name of bytes that are not UTF-8 is a path like any other.
    with pytest.raises(ductile.ConfigError, match=r"job\\xff.toml"):
        ductile.load_config("job\udcff.toml")


@pytest.fixture
def saved(tmp_path):
    engine = engine_of()
    train(engine, 2)
    root = tmp_path / "ckpt"
    engine.save(root, client_state={"step": 2})
    return engine, root


def sign(root):
    manifest = root / "step2" / "manifest.json"
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
    (root / "step2" / "manifest.json.sha256").write_text(f"{digest}  manifest.json\n")
    (root / "latest").write_text(f"step2\nsha256 {digest}\n")


def test_a_load_of_unreadable_files_raises_io_errors(saved):
    engine, root = saved
    before = snapshot(engine)
    pointer = (root / "latest").read_bytes()
    (root / "latest").write_bytes(b"\xffstep2\n")
    with pytest.raises(ductile.IoError, match=r"latest: the checkpoint pointer is not UTF-8 text "
                                              r"\(byte 0 is 0xff\)"):
        engine.load(root)
    (root / "latest").write_bytes(pointer)
    manifest = root / "step2" / "manifest.json"
    manifest.write_text("[" * 100000 + "]" * 100000)
    sign(root)
    with pytest.raises(ductile.IoError, match="manifest.json: the checkpoint manifest nests too "
                                              "deeply to be read"):
        engine.load(root)
    manifest.write_text('{"format": "x", "format": "y"}')
    sign(root)
    with pytest.raises(ductile.IoError, match="not valid JSON: duplicate key 'format'"):
        engine.load(root)
    with pytest.raises(ductile.InvalidArgumentError, match=r"zero3 load: directory = 'a\\x00b' is "
                                                           "not a valid path"):
        engine.load("a\0b")
    assert same(snapshot(engine), before)


@pytest.mark.parametrize("tag,shown", [("a\0b", r"'a\\x00b'"), ("\udcff", r"'\\udcff'"),
                                       ("rtl\u202etxt", r"'rtl\\u202etxt'")])
def test_a_save_tag_no_folder_can_have_is_refused_and_leaves_nothing(saved, tag, shown):
    engine, root = saved
    before = sorted(os.listdir(root))
    with pytest.raises(ductile.InvalidArgumentError,
                       match=f"zero3 checkpoint: tag {shown} is not a valid folder name \\(valid: "
                             "without NUL, control, format \\(bidi\\) characters or lone "
                             "surrogates\\)"):
        engine.save(root, tag=tag)
    assert sorted(os.listdir(root)) == before


@pytest.mark.parametrize("failing", ["create:manifest.json", "create:latest.tmp",
                                     "write:rank0-of-1.bin"])
def test_a_failed_save_removes_what_it_wrote(saved, failing):
    engine, root = saved
    train(engine, 1)
    before = sorted(os.listdir(root))
    operation, name = failing.split(":")

    def hook(op, path):
        if op == operation and os.path.basename(path) == name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    _checkpoint._fault_hook = hook
    try:
        with pytest.raises(ductile.IoError, match="No space left on device"):
            engine.save(root, client_state={"step": 3})
    finally:
        _checkpoint._fault_hook = None
    assert sorted(os.listdir(root)) == before  # no step3, step3.tmp nor latest.tmp
    checker = engine_of(seed=1)
    assert checker.load(root) == {"step": 2}


def test_a_killed_saves_leftovers_are_removed_by_the_next_load(saved):
    engine, root = saved
    train(engine, 1)
    pid = os.fork()
    if pid == 0:  # the child: stops dead before renaming its staging folder
        def hook(op, path):
            if op == "rename":
                os.kill(os.getpid(), signal.SIGKILL)
        _checkpoint._fault_hook = hook
        try:
            engine.save(root, client_state={"step": 3})
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    assert sorted(os.listdir(root)) == ["latest", "step2", "step3.tmp"]
    (root / "latest.tmp").write_text("step3\n")  # as a kill right after writing it leaves it

    # While a save holds the root's lock, a load leaves the folders alone.
    lock = _checkpoint.lock_root(str(root))
    try:
        assert engine_of(seed=1).load(root) == {"step": 2}
        assert "step3.tmp" in os.listdir(root)
        with pytest.raises(ductile.IoError, match="another save is writing there"):
            engine.save(root)
    finally:
        _checkpoint.unlock_root(lock)
    assert engine_of(seed=1).load(root) == {"step": 2}
    assert sorted(os.listdir(root)) == ["latest", "step2"]


def test_metric_files_errors_name_the_argument_or_file(tmp_path):
    with pytest.raises(ductile.InvalidArgumentError,
                       match="read_metric: prefix = None is not a path"):
        metrics.read_metric(None)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ductile.IoError,
                       match=f"{blocker}/seqlen: cannot create the folder of the metric files"):
        metrics.write_metric(blocker / "seqlen" / "seqlen_sample_to_metric", [1, 2])
    prefix = tmp_path / "m" / "seqlen_sample_to_metric"
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"write_metric: value -3 of sample 1 is invalid; every value must be "
                             r">= 1 \(read_metric reads lengths\)"):
        metrics.write_metric(prefix, np.array([4, -3, 5]))
    with pytest.raises(ductile.InvalidArgumentError, match="write_metric: no values"):
        metrics.write_metric(prefix, [])
    assert not (tmp_path / "m").exists()
    metrics.write_metric(prefix, [4, 3, 5])
    assert metrics.read_metric(prefix).tolist() == [4, 3, 5]
