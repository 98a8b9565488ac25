"""Reading parameters' slices from safetensors files (``zero3.initialize``'s
``load_from``, transformers' ``from_pretrained`` under ductile's ZeRO-3):
each rank reads only the bytes of its own slices."""

import json
import math
import os

import torch

from ..._errors import IncompatibleError, IoError


def _safetensors_files(path, opened):
    """{tensor name: file} of a safetensors file or folder; a single file's
    header, read for its names, is kept in `opened` for its reads."""
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise IoError(f"{index}: not a safetensors index: {e}") from e
            return {k: os.path.join(path, v) for k, v in weight_map.items()}
        single = os.path.join(path, "model.safetensors")
        if not os.path.isfile(single):
            raise IoError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
        path = single
    opened[path] = _SafetensorsFile(path)
    return {k: path for k in opened[path].entries}


# A safetensors file: an 8-byte little-endian header length, a JSON header
# ({key: {"dtype", "shape", "data_offsets": [begin, end]}}, "__metadata__"),
# then the tensors' bytes, row-major. Read with pread, a slice's bytes and
# nothing else reach the process: a mapping (safetensors' safe_open) would
# leave every page a rank touched resident in it until closed.
_HEADER_LIMIT = 100 << 20
_READ_CHUNK = 64 << 20
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class _SafetensorsFile:
    """One safetensors file: its header, read once, and element ranges of
    its tensors, read with pread. Bounded: the header's size, and every
    range within the file."""

    def __init__(self, path):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise IoError(f"{path}: cannot open: {e.strerror}") from e
        try:
            self.size = os.fstat(self.fd).st_size
            length = int.from_bytes(self._pread(8, 0), "little")
            if length > min(_HEADER_LIMIT, self.size - 8):
                raise IoError(f"{path}: safetensors header of {length} bytes; valid: at most "
                              f"{min(_HEADER_LIMIT, self.size - 8)} (the file's size, 100 MiB)")
            try:
                header = json.loads(self._pread(length, 8))
            except ValueError as e:
                raise IoError(f"{path}: the safetensors header is not JSON: {e}") from e
            if not isinstance(header, dict):
                raise IoError(f"{path}: the safetensors header is not a JSON object")
            self.base = 8 + length
            self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
        except BaseException:
            os.close(self.fd)
            raise

    def close(self):
        os.close(self.fd)

    def _pread(self, count, offset, into=None):
        out = memoryview(bytearray(count) if into is None else into)
        done = 0
        while done < count:
            got = os.preadv(self.fd, [out[done:done + min(_READ_CHUNK, count - done)]],
                            offset + done)
            if got == 0:
                raise IoError(f"{self.path}: ends at byte {offset + done}, a tensor's bytes "
                              f"reach {offset + count}: the file is truncated")
            done += got
        return out.obj

    def entry(self, key):
        """(dtype, shape, first byte, end byte) of `key`, checked."""
        entry = self.entries.get(key, {})
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise IoError(f"{self.path}: '{key}' has no valid safetensors entry (dtype one of "
                          f"{', '.join(_DTYPES)}, shape, data_offsets): {entry!r}") from e
        item = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= self.size - self.base or end - begin != math.prod(
                shape) * item:
            raise IoError(f"{self.path}: '{key}' has data_offsets [{begin}, {end}] for "
                          f"{math.prod(shape)} elements of {entry['dtype']} in a file of "
                          f"{self.size} bytes")
        return dtype, shape, begin, end

    def read(self, key, lo, hi):
        """Elements [lo, hi) of the flattened tensor `key` (new memory)."""
        dtype, _, begin, _ = self.entry(key)
        item = torch.empty((), dtype=dtype).element_size()
        data = self._pread((hi - lo) * item, self.base + begin + lo * item)
        return torch.frombuffer(data, dtype=dtype) if hi > lo else torch.empty(0, dtype=dtype)


class SafetensorsSource:
    """Reads each parameter's slice [lo, hi) of the flattened tensor from a
    safetensors file or folder: only that slice's bytes."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._open: dict[str, _SafetensorsFile] = {}
        self.files = _safetensors_files(self.path, self._open)

    def _handle(self, file):
        f = self._open.get(file)
        if f is None:
            f = self._open[file] = _SafetensorsFile(file)
        return f

    def close(self):
        for f in self._open.values():
            f.close()
        self._open.clear()

    def key_for(self, names):
        return next((name for name in names if name in self.files), None)

    def read(self, key, shape, lo, hi):
        f = self._handle(self.files[key])
        stored = f.entry(key)[1]
        if stored != tuple(shape):
            raise IncompatibleError(
                f"{self.files[key]}: '{key}' has shape {list(stored)}, the model's parameter "
                f"{list(shape)}")
        return f.read(key, lo, hi)
