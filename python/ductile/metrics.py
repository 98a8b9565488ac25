"""DeepSpeed's data-analyzer metric files (``MMIDIDX`` index + ``.bin`` data,
MMapIndexedDataset version 1), as DeepSpeed's variable-batch loader keeps
sequence lengths in ``{metrics_path}/seqlen/seqlen_sample_to_metric.{bin,idx}``.

Reading goes through the C++ reader (``ductile pack --format mmidx``), which
names the file and the byte offset of anything corrupt. Writing produces the
files DeepSpeed's own ``MMapIndexedDatasetBuilder`` writes for one value per
sample (byte for byte: see tests/python/test_metrics.py), so DeepSpeed reads
what ductile writes and the other way round.
"""

import os
import struct
import tempfile
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from . import _ductile
from ._config import StrPath
from ._errors import InvalidArgumentError, IoError
from ._paths import path_argument

__all__ = ["SEQLEN_PREFIX", "seqlen_prefix", "read_metric", "write_metric",
           "lengths_from_metrics_path"]

SEQLEN_PREFIX = os.path.join("seqlen", "seqlen_sample_to_metric")
_MAGIC = b"MMIDIDX\x00\x00"
# indexed_dataset.py `dtypes`: code -> numpy type.
_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3,
          np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.uint16): 6,
          np.dtype(np.uint32): 7, np.dtype(np.uint64): 8}


class MapDataset(Protocol):
    """A map-style dataset, as the length computations read one: its
    ``len`` and its samples by index (a torch ``Dataset`` with ``__len__``,
    a list, a Hugging Face ``datasets.Dataset``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


def seqlen_prefix(metrics_path: StrPath) -> str:
    """``{metrics_path}/seqlen/seqlen_sample_to_metric``."""
    return os.path.join(os.fspath(metrics_path), SEQLEN_PREFIX)


def read_metric(prefix: StrPath) -> npt.NDArray[np.int64]:
    """Every value of a metric file pair (PREFIX.bin + PREFIX.idx), in order,
    as int64. Raises NotFoundError or IoError naming the file,
    InvalidArgumentError for a prefix that is not a path."""
    path = path_argument(prefix, "prefix", "read_metric")
    return _ductile.batching.read_lengths(path, "mmidx", "", "")


def _atomic_write(path, chunks):
    directory = os.path.dirname(path) or "."
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path))
    except OSError as e:
        raise IoError(f"{path}: cannot be written: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except OSError as e:
        raise IoError(f"{path}: cannot be written: {e.strerror or e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_metric(prefix: StrPath, values: npt.ArrayLike,
                 dtype: npt.DTypeLike = np.int64) -> None:
    """Writes one value per sample as PREFIX.bin/PREFIX.idx in DeepSpeed's
    format. ``dtype``: one of DeepSpeed's (int64 default, as its data
    analyzer writes lengths). Each file is written to a temporary name and
    renamed, so concurrent writers (several ranks) never leave a torn file.
    The values are what :func:`read_metric` reads back: at least one, each
    >= 1 (lengths). Raises InvalidArgumentError for bad values, IoError
    naming the file that cannot be written."""
    prefix = path_argument(prefix, "prefix", "write_metric")
    try:
        dtype = np.dtype(dtype)
    except TypeError as e:
        raise InvalidArgumentError(f"write_metric: dtype {dtype!r} is not a numpy dtype") from e
    if dtype not in _CODES:
        raise InvalidArgumentError(
            f"write_metric: dtype {dtype} is not one DeepSpeed's MMIDIDX format stores; valid: "
            + ", ".join(str(d) for d in _CODES))
    values = np.asarray(values)
    if values.ndim != 1:
        raise InvalidArgumentError(f"write_metric: need one value per sample (1-D), got shape "
                                   f"{values.shape}")
    if len(values) == 0:
        raise InvalidArgumentError("write_metric: no values; read_metric reads one per sample, "
                                   "at least one")
    if values.dtype.kind not in "iu":
        raise InvalidArgumentError(f"write_metric: values must be integers, got {values.dtype}")
    bad = np.flatnonzero(values < 1)
    if len(bad):
        raise InvalidArgumentError(
            f"write_metric: value {int(values[bad[0]])} of sample {int(bad[0])} is invalid; "
            "every value must be >= 1 (read_metric reads lengths)")
    data = values.astype(dtype)
    if not np.array_equal(data.astype(np.int64), values.astype(np.int64)) or (
            values.dtype.kind == "u" and values.max() > np.iinfo(np.int64).max):
        raise InvalidArgumentError(f"write_metric: values do not fit in {dtype}")
    folder = os.path.dirname(prefix) or "."
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise IoError(f"{folder}: cannot create the folder of the metric files: "
                      f"{e.strerror or e}") from e
    n = len(data)
    sizes = np.ones(n, dtype=np.int32)
    pointers = np.arange(n, dtype=np.int64) * dtype.itemsize
    doc_idx = np.array([0, n], dtype=np.int64)
    header = _MAGIC + struct.pack("<Q", 1) + struct.pack("<B", _CODES[dtype]) + struct.pack(
        "<Q", n) + struct.pack("<Q", len(doc_idx))
    _atomic_write(prefix + ".bin", [data.astype(dtype.newbyteorder("<")).tobytes(order="C")])
    _atomic_write(prefix + ".idx", [header, sizes.astype("<i4").tobytes(),
                                    pointers.astype("<i8").tobytes(),
                                    doc_idx.astype("<i8").tobytes()])


def lengths_from_metrics_path(metrics_path: StrPath, dataset: MapDataset | None = None,
                              length_fn: Callable[[Any], int] = len) -> npt.NDArray[np.int64]:
    """DeepSpeed's ``metrics_path`` contract: the lengths in
    ``{metrics_path}/seqlen/seqlen_sample_to_metric.{bin,idx}`` when both
    files exist; otherwise computed once as ``length_fn(dataset[i])`` for
    every sample, written there, and read back. A file whose sample count
    differs from ``len(dataset)`` is an IoError naming it; a corrupt file is
    reported by the reader."""
    prefix = seqlen_prefix(metrics_path)
    have = [os.path.exists(prefix + ext) for ext in (".bin", ".idx")]
    if not all(have):
        if any(have):
            missing = prefix + (".idx" if have[0] else ".bin")
            raise IoError(f"{missing}: missing, but its pair exists; delete "
                          f"{prefix}.bin/.idx to recompute the lengths")
        if dataset is None:
            raise InvalidArgumentError(
                f"{prefix}.bin/.idx do not exist and no dataset was given to compute them")
        lengths = np.fromiter((length_fn(dataset[i]) for i in range(len(dataset))),
                              dtype=np.int64, count=len(dataset))
        bad = np.flatnonzero(lengths < 1)
        if len(bad):
            raise InvalidArgumentError(
                f"sample {int(bad[0])} has length {int(lengths[bad[0]])}: every sample needs a "
                "length >= 1")
        write_metric(prefix, lengths)
    lengths = read_metric(prefix)
    if dataset is not None and len(lengths) != len(dataset):
        raise IoError(f"{prefix}.idx: holds {len(lengths)} samples but the dataset has "
                      f"{len(dataset)}: the metric files belong to another dataset; delete them "
                      "to recompute")
    return lengths
