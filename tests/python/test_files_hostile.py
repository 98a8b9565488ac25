"""A configuration path that is not a plain, small file: a FIFO, /dev/zero
(or a .json link to it), a file over the 16 MiB cap. ductile.load_config and
zero3.initialize read every configuration path through the C++ reader the
CLI uses (core::read_user_file): the FIFO hung the process, /dev/zero grew it
to 24 GB before the OOM killer, the 300 MB file was accepted. Now each is
refused at once with the CLI's message, and the process stays small.

The risky calls run in a child process with a timeout, so that a regression
fails this test rather than hanging or exhausting the machine."""

import json
import os
import subprocess
import sys

import pytest

import ductile

CAP = 16 << 20

# Loads each path given and prints one JSON line per path: the error's class
# and message, or "accepted"; then the process's peak RSS.
CHILD = r"""
import json, resource, sys
import ductile
import ductile.torch.zero3 as zero3
import torch

for how, path in json.loads(sys.argv[1]):
    try:
        if how == "initialize":
            zero3.initialize(torch.nn.Linear(2, 2), None, path)
        else:
            ductile.load_config(path, format=None if how == "detect" else how)
        outcome = {"class": "accepted", "message": ""}
    except ductile.Error as e:
        outcome = {"class": type(e).__name__, "message": str(e)}
    print(json.dumps([how, path, outcome]), flush=True)
print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    fifo = folder / "fifo.json"
    os.mkfifo(fifo)
    plain_fifo = folder / "fifo_config"
    os.mkfifo(plain_fifo)
    zero = folder / "zero.json"
    os.symlink("/dev/zero", zero)
    big = folder / "big.json"
    with open(big, "wb") as f:
        f.write(b"{")
        f.truncate(CAP + 1)  # sparse: no disk spent on it
    cases = [("detect", str(fifo)), ("deepspeed", str(fifo)), ("detect", str(plain_fifo)),
             ("detect", str(zero)), ("detect", "/dev/zero"), ("deepspeed", "/dev/zero"),
             ("detect", str(big)), ("initialize", str(fifo)), ("initialize", str(zero)),
             ("initialize", str(big))]
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    outcomes = {(how, path): outcome for how, path, outcome in lines[:-1]}
    return folder, outcomes, lines[-1]["maxrss_kib"]


def test_a_fifo_config_is_refused_at_once(hostile):
    folder, outcomes, _ = hostile
    fifo = folder / "fifo.json"
    expected = f"{fifo}: is a FIFO, not a regular file; give a regular configuration file"
    for how in ("detect", "deepspeed", "initialize"):
        assert outcomes[(how, str(fifo))] == {"class": "IoError", "message": expected}, how
    # Without the .json name the content cannot be peeked at: read as TOML,
    # the same reader's problem arrives as the file's diagnostic.
    plain = outcomes[("detect", str(folder / "fifo_config"))]
    assert plain["class"] == "ConfigError"
    assert "is a FIFO, not a regular file; give a regular configuration file" in \
        plain["message"]


def test_dev_zero_is_refused_unread_and_memory_stays_bounded(hostile):
    folder, outcomes, maxrss_kib = hostile
    zero = folder / "zero.json"
    expected = f"{zero}: is a character device, not a regular file; give a regular " \
        "configuration file"
    for how in ("detect", "initialize"):
        assert outcomes[(how, str(zero))] == {"class": "IoError", "message": expected}, how
    assert outcomes[("deepspeed", "/dev/zero")] == {
        "class": "IoError",
        "message": "/dev/zero: is a character device, not a regular file; give a regular "
                   "configuration file"}
    assert "is a character device" in outcomes[("detect", "/dev/zero")]["message"]
    # torch's import takes some hundreds of MiB; reading /dev/zero took 24 GB.
    assert maxrss_kib < 2 << 20, maxrss_kib


def test_a_config_over_the_cap_is_refused_unread(hostile):
    folder, outcomes, _ = hostile
    big = folder / "big.json"
    expected = f"{big}: is {CAP + 1} bytes, over the 16 MiB cap of a configuration file"
    for how in ("detect", "initialize"):
        assert outcomes[(how, str(big))] == {"class": "IoError", "message": expected}, how


def test_python_and_the_cli_print_the_same_message(hostile):
    folder, outcomes, _ = hostile
    cli = os.environ.get("DUCTILE_CLI")
    if not cli:
        pytest.skip("DUCTILE_CLI is not set (run under ctest)")
    for path in (folder / "fifo.json", folder / "zero.json", folder / "big.json"):
        done = subprocess.run([cli, "config", "check", str(path)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert f"ductile: error: {outcomes[('detect', str(path))]['message']}" in done.stderr


def test_a_small_regular_config_still_loads(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    loaded = ductile.load_config(str(path))
    assert loaded.format == "deepspeed" and json.loads(loaded.deepspeed) == {
        "train_batch_size": 8}
    # Any extension: the content decides, read once by the same reader.
    other = tmp_path / "ds.conf"
    other.write_text(' \n{"train_batch_size": 8}')
    assert ductile.load_config(str(other)).format == "deepspeed"
