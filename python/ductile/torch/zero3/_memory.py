"""Tensors over memory the C++ coordinator owns, without copying, and the
element types both sides understand.

On the cpu backend the coordinator's "device" memory is host memory: a
writable memoryview over it goes to ``torch.frombuffer``; so does a shard
the coordinator keeps in host memory on any backend (parameter offload). On
cuda device memory goes through ``__cuda_array_interface__`` to
``torch.as_tensor``. The
tensors never own the memory; whoever makes one keeps it only while the
coordinator keeps the buffer (see materialize and dematerialize in _param.py).
"""

import torch

from ... import _ductile
from ..._errors import InvalidArgumentError, UnsupportedError

# torch dtype -> (ductile element type name, __cuda_array_interface__ typestr)
_TYPES = {
    torch.float32: ("float32", "<f4"),
    torch.float64: ("float64", "<f8"),
    torch.float16: ("float16", "<f2"),
    torch.bfloat16: ("bfloat16", "<u2"),  # no typestr for bf16: carried as raw 16-bit words
    torch.int32: ("int32", "<i4"),
    torch.int64: ("int64", "<i8"),
    torch.uint8: ("uint8", "|u1"),
}

_ELEMENT_SIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _TYPES}


def type_name(dtype, what):
    """ductile's name for a torch dtype; InvalidArgumentError naming `what`
    for a type the collectives cannot carry."""
    entry = _TYPES.get(dtype)
    if entry is None:
        valid = ", ".join(str(t) for t in _TYPES)
        raise InvalidArgumentError(
            f"zero3: {what} has dtype {dtype}, which cannot be partitioned; valid: {valid}")
    return entry[0]


class _CudaArray:
    """A minimal __cuda_array_interface__ holder for torch.as_tensor."""

    def __init__(self, address, numel, typestr):
        self.__cuda_array_interface__ = {
            "data": (address, False), "shape": (numel,), "typestr": typestr, "version": 2,
            "strides": None}


class DeviceMemory:
    """Makes flat tensors over the coordinator's memory on its backend."""

    def __init__(self, backend, device=None):
        self.backend = backend
        if backend == "cpu":
            self.device = torch.device("cpu")
        elif backend == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device()) \
                if device is None else torch.device(device)
        else:
            raise UnsupportedError(
                f"zero3: the {backend} accelerator is not supported from PyTorch; valid: cpu, "
                "cuda")

    def tensor(self, address, numel, dtype):
        """A 1-D tensor of `numel` elements of `dtype` at `address`."""
        if self.backend == "cpu":
            return self.host_tensor(address, numel, dtype)
        typestr = _TYPES[dtype][1]
        t = torch.as_tensor(_CudaArray(address, numel, typestr), device=self.device)
        return t.view(dtype) if dtype == torch.bfloat16 else t

    @staticmethod
    def host_tensor(address, numel, dtype):
        """A 1-D cpu tensor of `numel` elements of `dtype` over the
        coordinator's host memory at `address`."""
        view = _ductile.zero.host_view(address, numel * _ELEMENT_SIZE[dtype])
        return torch.frombuffer(view, dtype=dtype)
