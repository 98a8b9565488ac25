"""ZeRO-3 for torch.nn models through ductile's parameter coordinator.

    import ductile.torch.zero3 as zero3
    dist.init_process_group("gloo")              # torchrun; or run under mpirun
    with zero3.init():                           # optional: build straight into shards
        model = MyModel()
    engine = zero3.initialize(model, lambda params: torch.optim.Adam(params, lr=1e-3),
                              "zero.toml")       # [zero] and [accelerator], or DeepSpeed JSON
    for batch in loader:
        loss = loss_fn(engine(batch))
        engine.backward(loss)                    # or loss.backward() (not with fp16)
        engine.step()                            # optimizer on shards, grads cleared
    engine.save("ckpt/")                         # atomic; load on any world size
    engine.save_consolidated("hf/")              # Hugging Face safetensors
    dist.destroy_process_group()                 # before exit (docs/zero3.md)

Every parameter is partitioned over the ranks of the job's world:
torch.distributed's process group when it is initialised (gloo on cpu,
NCCL on cuda: torchrun, ``ductile agent``), else the accelerator's own
(Open MPI under mpirun, NCCL over an MPI bootstrap, or one process). Each
rank keeps one shard, and ``param.data`` is an empty tensor except while a
module using it runs. The parameters go by group: a hooked module's own
(a transformer block's, by default), gathered in one collective before its
forward and its backward and released after; the coordinator (C++) records
the order, prefetches along it and decides what to keep. When a block's
backward is done, its gradients are reduce-scattered (small groups sharing
a collective) into one flat gradient shard; the optimizer, built by
``optimizer_factory`` over the shards, steps on shards (fp32 masters with
mixed precision).

Also: gradient accumulation (``no_sync()``), ``clip_grad_norm_``, mixed
precision (``MixedPrecision``, fp16 loss scaling), ``state_dict()``,
``GatheredParameters``, non-reentrant activation checkpointing,
``step_in_backward``, and optimizer offload to the host under a device
memory budget (``offload_optimizer``, ``max_device_memory``). Limits: a
parameter used by a module it does not
belong to must be declared with ``register_external_parameter``;
``model.state_dict()`` sees the empty placeholders: use
``engine.state_dict()``. docs/zero3.md describes it all.
"""

from ._engine import Zero3Engine, initialize, register_external_parameter
from ._gradients import DynamicLossScaler, MixedPrecision
from ._param import GatheredParameters, init

__all__ = ["initialize", "init", "Zero3Engine", "register_external_parameter",
           "GatheredParameters", "MixedPrecision", "DynamicLossScaler"]
