"""The progress bar of `ductile pack` and `ductile elastic`: drawn on stderr
when stderr is a terminal (a pseudo-terminal here) and the run passes a
second, never on a pipe; stdout is the same bytes either way, --json
included. The bar ends with its 100% state and a newline, and its line is
ended before an error message and when SIGINT stops the run."""

import os
import pty
import re
import select
import signal
import subprocess
import threading
import time
import tty

import pytest

from conftest import CLI

# The bar shows once a run has taken 1 s. Inputs are chosen so that the run
# without a terminal takes at least this long on the build under test (a
# sanitizer build is several times slower than a release one), leaving the
# run on a terminal a margin past the second.
LONG_RUN_SECONDS = 1.5
# A run that never ends by itself is stopped after this (a hang fails the
# test instead of the ctest timeout).
DEADLINE_SECONDS = 240

BAR_SEGMENT = re.compile(
    rb"^(?P<label>ductile (?:pack|elastic)): (?P<stage>[A-Za-z ]+?)"
    rb"(?: \[(?P<bar>[#.]+)\] +(?P<percent>\d+)%)?  \d+\.\d s *(?P<newline>\n?)$"
)


def read_all(fd, on_data=None):
    """Reads a pseudo-terminal's master side until every slave is closed."""
    data = b""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the process closed its side
            return data
        if not chunk:
            return data
        data += chunk
        if on_data:
            on_data(data)
    raise AssertionError(f"no end of output after {DEADLINE_SECONDS} s: {data[-300:]!r}")


def run_on_terminal(args, on_stderr=None):
    """Runs `ductile ARGS` with stderr on a new pseudo-terminal (raw: bytes
    arrive as written) and stdout on a pipe. `on_stderr(proc, data)` sees
    stderr as it grows. Returns (exit code, stdout, stderr)."""
    master, slave = pty.openpty()
    tty.setraw(slave)
    try:
        proc = subprocess.Popen([CLI, *map(str, args)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=slave)
    finally:
        os.close(slave)
    out = {}
    reader = threading.Thread(target=lambda: out.setdefault("stdout", proc.stdout.read()))
    reader.start()
    try:
        err = read_all(master, (lambda data: on_stderr(proc, data)) if on_stderr else None)
    except BaseException:
        proc.kill()
        raise
    finally:
        os.close(master)
        reader.join()
    return proc.wait(), out["stdout"], err


def run_on_pipes(args):
    """Runs `ductile ARGS` with stdout and stderr on pipes: (code, stdout, stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.run([CLI, *map(str, args)], stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=DEADLINE_SECONDS)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def long_input(make_args, sizes):
    """The first size whose run without a terminal takes LONG_RUN_SECONDS:
    (args, code, stdout, stderr) of that run, the reference."""
    for size in sizes:
        args = make_args(size)
        code, out, err, seconds = run_on_pipes(args)
        if seconds >= LONG_RUN_SECONDS:
            return args, code, out, err
    raise AssertionError(f"no input of {sizes} runs {LONG_RUN_SECONDS} s: {args}")


def bar_segments(err, label):
    """The lines the bar drew ("\\r" then a line), each checked to be one."""
    assert err.startswith(b"\r"), err[:200]
    segments = err[1:].split(b"\r")
    for segment in segments:
        match = BAR_SEGMENT.match(segment)
        assert match, f"not a bar line: {segment!r}"
        assert match["label"] == label
        if match["percent"] is not None:
            assert 0 <= int(match["percent"]) <= 100
    return [BAR_SEGMENT.match(s) for s in segments]


def check_finished_bar(err, label):
    """Redrawn in place at least once, ends at 100% with one newline."""
    segments = bar_segments(err, label)
    assert len(segments) >= 2, err
    final = segments[-1]
    assert final["stage"] == b"done" and final["percent"] == b"100" and final["newline"] == b"\n"
    assert set(final["bar"]) == {ord("#")}
    assert all(s["newline"] == b"" for s in segments[:-1])
    assert err.count(b"\n") == 1


def write_histogram(path, samples):
    """A lengths histogram of `samples` samples over lengths 1..4096: a few
    kilobytes whatever the count (`ductile pack --count-column`)."""
    lengths = 4096
    with open(path, "w") as f:
        f.write("length,count\n")
        for length in range(1, lengths + 1):
            count = samples // lengths + (1 if length <= samples % lengths else 0)
            f.write(f"{length},{count}\n")
    return path


def pack_args(tmp_path, samples, *extra):
    lengths = write_histogram(tmp_path / f"lengths_{samples}.csv", samples)
    return ["pack", "--lengths", lengths, "--column", "length", "--count-column", "count",
            "--max-tokens", "8192", *extra]


def without_packing_time(out):
    """The human summary less its one timed row."""
    return [line for line in out.splitlines() if not line.startswith(b"  packing time")]


def without_seconds(out):
    """The plan's JSON less the time the packing took (its one timed value)."""
    assert out.count(b'"seconds":') == 1
    return re.sub(rb'"seconds":[-+.0-9eE]+', b'"seconds":', out)


def elastic_config(tmp_path, cap):
    """The optimal policy over many micro batches: its search grows with the cap."""
    path = tmp_path / f"optimal_{cap}.toml"
    path.write_text(
        "[elasticity]\n"
        'policy = "optimal"\n'
        f"max_train_batch_size = {cap}\n"
        "micro_batch_sizes = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43]\n"
        "min_gpus = 1\n"
        "max_gpus = 100000\n")
    return path


ELASTIC_CAPS = [10**10, 10**12, 10**14]


@pytest.fixture(scope="module")
def long_elastic(tmp_path_factory):
    """`ductile elastic` on a config whose search is long: (args, its stdout without a terminal)."""
    folder = tmp_path_factory.mktemp("elastic")
    args, code, out, err = long_input(
        lambda cap: ["--log-level", "error", "elastic", "--config", elastic_config(folder, cap)],
        ELASTIC_CAPS)
    assert code == 0, err
    assert err == b""  # no bar on a pipe
    return args, out


def test_pack_draws_a_bar_on_a_terminal_and_prints_the_same_summary(tmp_path):
    args, code, out, err = long_input(
        lambda samples: pack_args(tmp_path, samples, "--order", "random", "--ranks", "8",
                                  "--lr-rule", "sqrt", "--base-batch-size", "1000",
                                  "--base-lr", "0.001", "--effective-batch-size", "4"),
        [3_000_000, 9_000_000, 27_000_000, 81_000_000])
    assert code == 0, err
    assert err == b""  # stderr a pipe: not one bar byte
    assert b"\r" not in out

    term_code, term_out, term_err = run_on_terminal(args)
    assert term_code == 0, term_err
    check_finished_bar(term_err, b"ductile pack")
    assert without_packing_time(term_out) == without_packing_time(out)
    assert b"\r" not in term_out


def test_pack_json_keeps_stdout_free_of_the_bar(tmp_path):
    args, code, out, err = long_input(lambda samples: pack_args(tmp_path, samples, "--json"),
                                      [1_000_000, 3_000_000, 9_000_000, 27_000_000])
    assert code == 0, err
    assert err == b""

    term_code, term_out, term_err = run_on_terminal(args)
    assert term_code == 0, term_err
    check_finished_bar(term_err, b"ductile pack")
    # One line of JSON, the same plan (but the time it took).
    assert term_out.endswith(b"}\n") and term_out.count(b"\n") == 1
    assert b"\r" not in term_out and b"ductile pack:" not in term_out
    assert without_seconds(term_out) == without_seconds(out)


def test_elastic_draws_a_bar_during_the_optimal_search(long_elastic):
    args, out = long_elastic
    code, term_out, term_err = run_on_terminal(args)
    assert code == 0, term_err
    check_finished_bar(term_err, b"ductile elastic")
    assert {s["stage"] for s in bar_segments(term_err, b"ductile elastic")} == {
        b"searching batch sizes", b"done"}
    assert term_out == out


def test_an_error_starts_a_line_of_its_own_after_the_bar(long_elastic):
    # 99991 is prime: no batch size up to the cap has it as a GPU count, and
    # the policy says so once its search is over.
    args = [*long_elastic[0], "--world-size", "99991"]
    code, out, err = run_on_terminal(args)
    assert code == 2, err
    assert out == b""
    bar, message = err.split(b"\nductile: error: ")
    segments = bar_segments(bar + b"\n", b"ductile elastic")
    assert b"100%" not in bar  # stopped where it was, not finished
    assert segments[-1]["stage"] == b"searching batch sizes"
    assert b"99991" in message and message.endswith(b"\n")


def test_sigint_ends_the_bar_line(tmp_path):
    # A search that runs for minutes: it is interrupted once the bar shows.
    args = ["--log-level", "error", "elastic", "--config", elastic_config(tmp_path, 10**18)]
    interrupted = []

    def interrupt_once_drawn(proc, data):
        if b"\r" in data and not interrupted:
            proc.send_signal(signal.SIGINT)
            interrupted.append(True)

    code, out, err = run_on_terminal(args, interrupt_once_drawn)
    assert interrupted, err
    assert code == -signal.SIGINT  # the signal's default action, as without a bar
    assert out == b""
    segments = bar_segments(err, b"ductile elastic")
    assert segments[-1]["newline"] == b"\n" and err.count(b"\n") == 1
    assert b"100%" not in err
