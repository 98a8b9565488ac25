"""What ductile prints about hostile input is bounded and inert: at most 100
problems of a configuration, then "... and N more" (the probe's 10^6
unknown keys printed 10^6 lines, 243 MB); NUL, control and bidi characters
escaped in every message and log line (a NUL cut the message short, a
right-to-left override was printed raw); an index announcing 2^62 samples
named with its true byte count (it showed a wrapped one)."""

import os
import shutil
import struct
import subprocess

import pytest

import ductile
from ductile import metrics
from conftest import CLI

FIXTURES = os.path.join(os.environ["DUCTILE_BINARY_DIR"], "tests", "core", "loader", "fixtures")
KEYS = 100_000


def check(path):
    proc = subprocess.run([CLI, "config", "check", str(path)], capture_output=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_a_config_of_100000_unknown_keys_prints_100_lines(tmp_path):
    job = tmp_path / "job.toml"
    with open(job, "w") as f:
        f.write('[elasticity]\npolicy = "v0.1"\nmax_train_batch_size = 64\n'
                "micro_batch_sizes = [2]\n")
        for k in range(KEYS):
            f.write(f"unknown_{k:06d} = 1\n")
    code, out, err = check(job)
    assert code == 2, err[-2000:]
    lines = err.decode().splitlines()
    assert len(lines) == 101, (len(lines), lines[:3], lines[-3:])
    assert lines[0].startswith(f"ductile: error: {job}:5:1: unknown key 'unknown_000000' in "
                               "[elasticity]")
    assert lines[99].startswith(f"{job}:104:1: unknown key 'unknown_000099'")
    assert lines[100] == f"... and {KEYS - 100} more"
    with pytest.raises(ductile.ConfigError) as error:
        ductile.load_config(job)
    assert len(error.value.diagnostics) == 100
    assert str(error.value).endswith(f"\n... and {KEYS - 100} more")
    print(f"{KEYS} unknown keys: {len(err)} bytes of stderr")


def test_nul_control_and_bidi_characters_are_escaped(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[elasticity]\npolicy = "v0.1"\nmax_train_batch_size = 64\n'
                   'micro_batch_sizes = [2]\n"a\\u0000b" = 1\n"evil\\u202Etxt.exe" = 2\n'
                   '"\\u001B[31mred" = 3\n')
    code, _, err = check(job)
    assert code == 2
    assert b"\0" not in err and "\u202e".encode() not in err and b"\x1b" not in err
    text = err.decode()
    assert f"{job}:5:1: unknown key 'a\\x00b' in [elasticity]" in text  # the whole message
    assert "unknown key 'evil\\u{202e}txt.exe' in [elasticity]" in text
    assert "unknown key '\\x1b[31mred' in [elasticity]" in text
    with pytest.raises(ductile.ConfigError) as error:
        ductile.load_config(job)
    message = str(error.value)
    assert "'a\\x00b'" in message and "'evil\\u{202e}txt.exe'" in message
    assert not any(c in message for c in "\0\u202e\x1b")


def test_log_lines_and_listings_escape_file_names(tmp_path):
    folder = tmp_path / "plugins\x1b[2J\u202e"
    folder.mkdir()
    shutil.copy(os.path.join(FIXTURES, "bad", "libductile_lr_fixture_text.so"), folder)
    proc = subprocess.run([CLI, "plugins", "list"], capture_output=True, timeout=120,
                          env=dict(os.environ, DUCTILE_PLUGIN_PATH=str(folder)))
    assert proc.returncode == 0, proc.stderr
    for stream in (proc.stdout, proc.stderr):
        assert b"\x1b" not in stream and "\u202e".encode() not in stream
    problem = [line for line in proc.stdout.decode().splitlines() if "fixture_text" in line]
    assert problem and "plugins\\x1b[2J\\u{202e}/libductile_lr_fixture_text.so" in problem[0]
    assert "plugins\\x1b[2J\\u{202e}" in proc.stderr.decode()  # the loader's warning, logged


def test_an_index_announcing_2_62_samples_names_the_true_byte_count(tmp_path):
    prefix = tmp_path / "seqlen_sample_to_metric"
    samples, documents = 2**62, 2
    (tmp_path / "seqlen_sample_to_metric.idx").write_bytes(
        b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 5, samples, documents))
    (tmp_path / "seqlen_sample_to_metric.bin").write_bytes(bytes(8))
    need = samples * 12 + documents * 8 + 34
    assert need > 2**64
    with pytest.raises(ductile.IoError,
                       match=f"truncated: the header announces {samples} samples and {documents} "
                             f"document entries \\({need} bytes\\), the file has 34 bytes"):
        metrics.read_metric(prefix)
