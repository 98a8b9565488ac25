"""_ductile.shard_io: CRC-32C (the CPU instruction and the table giving the
same values, both checked against a bit-by-bit reference), write_buffers,
which writes buffers into a real file and checksums them in the same pass,
and copy_buffers, the same into a mapping of a file."""

import errno
import os
import random
import resource
import shutil
import tempfile

import numpy as np
import pytest

import ductile
from ductile import _ductile

shard_io = _ductile.shard_io


def reference_crc32c(data, value=0):
    """CRC-32C bit by bit, straight from its definition (reflected
    polynomial 0x82F63B78, all-ones start and final XOR)."""
    state = value ^ 0xFFFFFFFF
    for byte in data:
        state ^= byte
        for _ in range(8):
            state = (state >> 1) ^ (0x82F63B78 if state & 1 else 0)
    return state ^ 0xFFFFFFFF


def test_the_check_value():
    # The CRC-32C catalogue's check value of "123456789".
    assert shard_io.crc32c(b"123456789") == 0xE3069283
    assert shard_io.crc32c_portable(b"123456789") == 0xE3069283
    assert reference_crc32c(b"123456789") == 0xE3069283
    assert shard_io.crc32c(b"") == 0 and shard_io.crc32c(b"", 0x1234) == 0x1234


def test_both_ways_match_the_reference_at_odd_lengths_and_offsets():
    rng = random.Random(7)
    data = rng.randbytes(5000)
    view = memoryview(data)
    for _ in range(60):
        start = rng.randrange(0, 64)
        length = rng.randrange(0, 2000)
        piece = view[start:start + length]
        expected = reference_crc32c(piece)
        assert shard_io.crc32c(piece) == expected, (start, length)
        assert shard_io.crc32c_portable(piece) == expected, (start, length)


def test_the_cpu_instruction_and_the_table_agree_on_large_buffers():
    """Large enough for the instruction's three interleaved stripes (of
    8 KiB and of 256 bytes) and their joining; lengths and offsets odd."""
    if not shard_io.crc32c_uses_cpu_instruction():
        pytest.skip("this CPU has no CRC-32C instruction: crc32c() is the table")
    rng = random.Random(11)
    data = memoryview(rng.randbytes(3 << 20))
    for start, length in [(0, 3 * 8192), (1, 3 * 8192 + 7), (3, 3 * 256 + 5), (5, 3 * 256 - 1),
                          (7, (3 << 20) - 7), (2, 1_000_003), (6, 24_575), (4, 99_999)]:
        piece = data[start:start + length]
        assert shard_io.crc32c(piece) == shard_io.crc32c_portable(piece), (start, length)


def test_a_value_continues_the_crc():
    rng = random.Random(3)
    data = rng.randbytes(300_001)
    whole = shard_io.crc32c(data)
    for cut in (0, 1, 4096, 100_003, 300_001):
        first = shard_io.crc32c(data[:cut])
        assert shard_io.crc32c(data[cut:], first) == whole
        assert shard_io.crc32c_portable(data[cut:], first) == whole
    assert shard_io.crc32c(b"6789", shard_io.crc32c(b"12345")) == 0xE3069283


def test_read_only_buffers_and_arrays_are_read():
    data = bytes(range(256)) * 40
    expected = reference_crc32c(data)
    assert shard_io.crc32c(memoryview(data)) == expected
    array = np.frombuffer(data, dtype=np.float32)  # read-only
    assert not array.flags.writeable and shard_io.crc32c(array) == expected


def test_bad_arguments_are_named():
    with pytest.raises(ductile.InvalidArgumentError, match=r"value = -1 is out of range; must "
                                                          r"be between 0 and 4294967295"):
        shard_io.crc32c(b"x", -1)
    strided = np.arange(10, dtype=np.int64)[::2]
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"buffer = array\(.*\) is not a contiguous buffer \(ndarray\)"):
        shard_io.crc32c(strided)
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"buffer = 'text' is not a contiguous buffer \(str\)"):
        shard_io.crc32c("text")


def chunks_of(rng):
    """Buffers of several kinds and odd sizes, one larger than a write
    block (256 KiB), one empty."""
    return [rng.randbytes(17), bytearray(rng.randbytes(600_001)), b"",
            memoryview(rng.randbytes(70_000))[3:], np.frombuffer(rng.randbytes(4096), np.int32)]


def test_write_buffers_onto_a_new_file(tmp_path):
    chunks = chunks_of(random.Random(5))
    expected = b"".join(bytes(c) for c in chunks)
    path = tmp_path / "new.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        assert shard_io.write_buffers(fd, chunks) == (len(expected), reference_crc32c(expected))
        # pwrite: the descriptor's own position stays where it was.
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
    finally:
        os.close(fd)
    assert path.read_bytes() == expected


def test_write_buffers_over_a_longer_file_from_an_offset(tmp_path):
    """As a snapshot reuses a superseded file: written over in place, the
    tail beyond what is written left for the caller to truncate; a second
    call continues the first's offset and CRC."""
    rng = random.Random(9)
    path = tmp_path / "reused.bin"
    old = rng.randbytes(2_000_000)
    path.write_bytes(old)
    first, second = chunks_of(rng), chunks_of(rng)
    head = b"".join(bytes(c) for c in first)
    tail = b"".join(bytes(c) for c in second)
    fd = os.open(path, os.O_WRONLY)
    try:
        size, crc = shard_io.write_buffers(fd, first)
        assert (size, crc) == (len(head), shard_io.crc32c(head))
        more, crc = shard_io.write_buffers(fd, second, offset=size, value=crc)
        assert more == len(tail) and crc == reference_crc32c(head + tail)
    finally:
        os.close(fd)
    assert path.read_bytes() == head + tail + old[len(head) + len(tail):]


def write_error(path, flags):
    """The OSError write_buffers raises writing into `path` opened so."""
    fd = os.open(path, flags)
    try:
        with pytest.raises(OSError) as error:
            shard_io.write_buffers(fd, [b"data"])
    finally:
        os.close(fd)
    return error.value


def test_write_errors_are_oserrors_with_errno(tmp_path):
    path = tmp_path / "read-only.bin"
    path.write_bytes(b"before")
    error = write_error(path, os.O_RDONLY)
    assert error.errno == errno.EBADF
    assert error.strerror == os.strerror(errno.EBADF)
    assert path.read_bytes() == b"before"
    if os.path.exists("/dev/full"):  # a device whose every write fails ENOSPC
        assert write_error("/dev/full", os.O_WRONLY).errno == errno.ENOSPC


def test_write_buffers_names_bad_arguments(tmp_path):
    fd = os.open(tmp_path / "f.bin", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(ductile.InvalidArgumentError,
                           match=r"buffers = b'data' is not a list of buffers; give a list"):
            shard_io.write_buffers(fd, b"data")
        with pytest.raises(ductile.InvalidArgumentError,
                           match=r"buffers\[1\] = 7 is not a contiguous buffer \(int\)"):
            shard_io.write_buffers(fd, [b"a", 7])
        with pytest.raises(ductile.InvalidArgumentError, match=r"offset = -1 is out of range"):
            shard_io.write_buffers(fd, [b"a"], offset=-1)
        with pytest.raises(ductile.InvalidArgumentError, match=r"fd = -3 is out of range"):
            shard_io.write_buffers(-3, [b"a"])
    finally:
        os.close(fd)
    assert os.path.getsize(tmp_path / "f.bin") == 0


def mapped_files():
    """The paths this process maps, as /proc/self/maps lists them."""
    with open("/proc/self/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}


def shared_memory_dir():
    with open("/proc/mounts") as mounts:
        if not any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts):
            pytest.skip("/dev/shm is not a tmpfs here")
    return tempfile.mkdtemp(prefix="ductile-shard-io-", dir="/dev/shm")


def write_through(path, data, offset=0, flags=os.O_WRONLY | os.O_CREAT):
    fd = os.open(path, flags, 0o600)
    try:
        return shard_io.write_buffers(fd, [data[i:i + (3 << 20)] for i in range(0, len(data),
                                                                              3 << 20)], offset)
    finally:
        os.close(fd)


def test_a_large_file_in_shared_memory_is_written_through_a_kept_mapping():
    """A snapshot's shard in /dev/shm: written through a mapping kept from
    one write to the next (listed in /proc/self/maps between calls), over
    the same pages when the file is renamed (a reused snapshot file),
    shrunk by the caller or grown; a read-only descriptor still fails as
    pwrite does; a deleted file's mapping is dropped at the next call."""
    folder = shared_memory_dir()
    try:
        rng = random.Random(11)
        first = os.path.join(folder, "step1.bin")
        data = rng.randbytes(20 << 20)
        assert write_through(first, data) == (len(data), shard_io.crc32c(data))
        assert open(first, "rb").read() == data
        assert first in mapped_files()

        second = os.path.join(folder, "step2.bin")
        os.rename(first, second)
        shorter = rng.randbytes(18 << 20)
        assert write_through(second, shorter) == (len(shorter), shard_io.crc32c(shorter))
        os.truncate(second, len(shorter))
        assert open(second, "rb").read() == shorter
        longer = rng.randbytes(24 << 20)
        assert write_through(second, longer[4096:], offset=4096)[0] == len(longer) - 4096
        assert write_through(second, longer[:4096])[0] == 4096
        assert open(second, "rb").read() == longer

        with pytest.raises(OSError) as error:
            write_through(second, shorter, flags=os.O_RDONLY)
        assert error.value.errno == errno.EBADF
        assert open(second, "rb").read() == longer

        os.unlink(second)
        other = os.path.join(folder, "other.bin")
        write_through(other, data)
        kept = mapped_files()
        assert other in kept
        assert not any(name.startswith(second) for name in kept), kept
        os.unlink(other)
    finally:
        shutil.rmtree(folder)


def test_a_grown_file_keeps_its_pages_mapped():
    """A snapshot's shard file grows by a byte when the step in its header
    gains a digit: it is written through the kept mapping, at the same
    addresses, with far fewer page faults than through a new mapping of a
    file of the same size, whose every page is faulted in first. A file
    grown further is written through the mapping moved."""
    folder = shared_memory_dir()
    try:
        data = random.Random(5).randbytes(64 << 20)
        chunks = [memoryview(data)[i:i + (8 << 20)] for i in range(0, len(data), 8 << 20)]
        grown = [b"x"] + chunks
        kept, fresh = os.path.join(folder, "step9.bin"), os.path.join(folder, "other.bin")
        with open(fresh, "wb") as f:
            f.write(data)  # its pages exist, and no mapping of it is kept yet

        def faults_writing(path, buffers):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                written = shard_io.write_buffers(fd, buffers, 0)[0]
                return written, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            finally:
                os.close(fd)

        assert faults_writing(kept, chunks)[0] == len(data)
        written, new_mapping = faults_writing(fresh, chunks)
        assert written == len(data)
        written, extended = faults_writing(kept, grown)
        assert written == len(data) + 1
        assert extended < new_mapping // 2, \
            f"{extended} page faults rewriting a file grown by one byte, {new_mapping} through " \
            "a new mapping"
        with open(kept, "rb") as f:
            assert f.read(1) == b"x" and f.read() == data
        # Grown past the room mapped beyond its end: the mapping is moved.
        longer = [b"y" * (16 << 20)] + chunks
        assert faults_writing(kept, longer)[0] == len(data) + (16 << 20)
        with open(kept, "rb") as f:
            assert f.read(16 << 20) == b"y" * (16 << 20) and f.read() == data
    finally:
        shutil.rmtree(folder)


def test_copy_buffers_into_a_mapping_from_an_offset(tmp_path):
    """As a snapshot fills its file's mapping: the buffers copied one after
    another from the offset, the bytes around them untouched, and the CRC-32C
    of what was copied, continuing a given value."""
    import mmap
    rng = random.Random(11)
    chunks = chunks_of(rng)
    data = b"".join(bytes(c) for c in chunks)
    path = tmp_path / "mapped.bin"
    old = rng.randbytes(len(data) + 100)
    path.write_bytes(old)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), len(old)) as memory:
        array = np.frombuffer(memory, dtype=np.uint8)
        assert shard_io.copy_buffers(array, 60, chunks, shard_io.crc32c(b"head")) == \
            (len(data), reference_crc32c(b"head" + data))
        del array
        memory.flush()
    assert path.read_bytes() == old[:60] + data + old[60 + len(data):]


def test_copy_buffers_names_bad_arguments():
    target = bytearray(8)
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"target = b'readonly' is not a writable contiguous buffer"):
        shard_io.copy_buffers(b"readonly", 0, [b"a"])
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"buffers = b'data' is not a list of buffers; give a list"):
        shard_io.copy_buffers(target, 0, b"data")
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"buffers\[1\] = 7 is not a contiguous buffer \(int\)"):
        shard_io.copy_buffers(target, 0, [b"a", 7])
    with pytest.raises(ductile.InvalidArgumentError, match=r"offset = -1 is out of range"):
        shard_io.copy_buffers(target, -1, [b"a"])
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"offset = 5 plus the 4 bytes of the buffers is past the target's 8 "
                             r"bytes"):
        shard_io.copy_buffers(target, 5, [b"data"])
    assert target == bytearray(8)
