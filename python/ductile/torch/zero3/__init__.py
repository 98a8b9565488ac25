"""ZeRO-3 for torch.nn models through ductile's parameter coordinator.

    import ductile.torch.zero3 as zero3
    engine = zero3.initialize(model, lambda params: torch.optim.Adam(params, lr=1e-3),
                              "zero.toml")       # [zero] and [accelerator] sections
    for batch in loader:
        loss = loss_fn(engine(batch))
        engine.backward(loss)                    # or loss.backward()
        engine.step()                            # optimizer on shards, grads cleared
    engine.save("ckpt/")                         # load on any world size: engine.load("ckpt/")

Every parameter is partitioned over the ranks of the configured accelerator
(cpu over Open MPI under mpirun, cuda over NCCL); each rank keeps one shard,
and ``param.data`` is an empty tensor except while a module using it runs.
Module hooks fetch a module's parameters before its forward and its
backward and release them after; the coordinator (C++) records the module
order, prefetches along it and decides what to keep. Each full gradient is
reduce-scattered (averaged over ranks) into a gradient shard as soon as
autograd has produced it; the optimizer, built by ``optimizer_factory`` over
the shards, steps on shards.

Backward uses torch 2's multi-gradient hooks on each module's outputs
(fetch) and inputs, positional and keyword (release); non-reentrant
activation checkpointing works. Limits: a parameter used by a module it
does not belong to must be declared with ``register_external_parameter``;
``model.state_dict()`` sees the empty placeholders: use
``engine.full_parameters()`` or ``engine.save()``.
"""

from ._engine import Zero3Engine, register_external_parameter
from ._full import GatheredParameters
from ._init import init
from ._precision import DynamicLossScaler, MixedPrecision

__all__ = ["initialize", "init", "Zero3Engine", "register_external_parameter",
           "GatheredParameters", "MixedPrecision", "DynamicLossScaler"]


def initialize(model, optimizer_factory=None, config=None, *, plugin_path=None,
               mixed_precision=None, load_from=None, group=None, step_in_backward=False):
    """Partitions ``model``'s parameters and installs the hooks; returns the
    engine. Collective: every rank calls it with the same model structure.

    ``optimizer_factory``: called with the list of shard parameters (one flat
    tensor per parameter, in ``model.named_parameters()`` order, fp32 masters
    with mixed precision), returns a ``torch.optim`` optimizer (or None: no
    optimizer). ``config``: a ductile TOML (path, text, or dict of sections)
    with a ``[zero]`` section (e.g. ``coordinator = "partitioned"``) and an
    ``[accelerator]`` section, or a DeepSpeed JSON config (ZeRO stage 3; its
    bf16/fp16 and gradient_clipping keys are honoured). When
    torch.distributed is initialised (torchrun) and ``[accelerator]
    communicator`` is "auto" or "host", its process group (``group``, or the
    default one) is the world: no MPI. ``mixed_precision``: a
    ``MixedPrecision``, or "bf16"/"fp16" (fp32 masters and reduction).
    Initial values: the slices ``zero3.init`` kept, safetensors files
    (``load_from``), or rank 0's values, broadcast as
    DistributedDataParallel does. ``step_in_backward``: one optimizer per
    shard (``optimizer_factory([shard])``), stepped as soon as that shard's
    gradient is reduce-scattered, so the gradient shards never all exist at
    once (no global clipping or fp16 loss scaling then; accumulate with
    ``no_sync()`` for all but the last micro-batch). Raises ConfigError,
    InvalidArgumentError (a parameter of an unsupported dtype or on the
    wrong device).
    """
    return Zero3Engine(model, optimizer_factory, config, plugin_path=plugin_path,
                       mixed_precision=mixed_precision, load_from=load_from, group=group,
                       step_in_backward=step_in_backward)
