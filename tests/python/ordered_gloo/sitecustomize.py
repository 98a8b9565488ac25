"""Gloo process groups with one worker thread, for the processes of the
drop-in tests' DeepSpeed runs (dropin_support.py puts this folder first on
their PYTHONPATH; Python imports it as it starts). Not a test by itself.

DeepSpeed's ZeRO-3 gathers a list of parameters (GatheredParameters, the
model zero.Init builds, the 16-bit model it saves) by starting one
asynchronous all-gather a parameter and waiting on the handle of the last
one only, then reading every gathered buffer. On a GPU that is enough: NCCL
runs a group's collectives one after another on one CUDA stream, so when
the last one has ended the earlier ones have too. Gloo instead hands a
group's asynchronous operations to a pool of worker threads (two by
default), so an earlier all-gather may still be filling its buffer when the
last one ends, and DeepSpeed computes with, or saves, weights partly
gathered: the same command gives other losses from run to run.

With a single worker thread gloo runs the operations in the order they
were started, each to its end before the next, which is the order DeepSpeed
relies on. The collectives, their tensors and every value DeepSpeed
computes stay the same; only their overlap is gone.
"""

import datetime

import torch.distributed.distributed_c10d as c10d

_Gloo = c10d.ProcessGroupGloo


class _OneThreadGloo(c10d.ProcessGroupGloo):
    """torch's ProcessGroupGloo as torch.distributed creates it (store,
    rank, size, timeout), with one worker thread on the default device."""

    def __init__(self, store, rank, size, timeout=datetime.timedelta(seconds=1800)):
        options = _Gloo._Options()
        options._timeout = timeout
        options._threads = 1
        options._devices = [_Gloo.create_default_device()]
        super().__init__(store, rank, size, options)


# torch.distributed looks the class up in this module when it makes a
# group, so every gloo group of the process (DeepSpeed's included) is one.
c10d.ProcessGroupGloo = _OneThreadGloo
