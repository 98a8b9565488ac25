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

from typing import Any

import torch

from ..._config import PluginPath, StrPath, load_config
from ._engine import (ConfigSource, Groups, OptimizerFactory, Zero3Engine,
                      register_external_parameter)
from ._full import GatheredParameters
from ._init import init
from ._precision import DynamicLossScaler, MixedPrecision

__all__ = ["initialize", "init", "Zero3Engine", "register_external_parameter",
           "GatheredParameters", "MixedPrecision", "DynamicLossScaler"]


def initialize(model: torch.nn.Module, optimizer_factory: OptimizerFactory | None = None,
               config: ConfigSource | None = None, *, plugin_path: PluginPath = None,
               mixed_precision: MixedPrecision | str | torch.dtype | None = None,
               load_from: StrPath | None = None,
               group: "torch.distributed.ProcessGroup | None" = None,
               step_in_backward: bool = False, groups: Groups = "auto",
               allow_config_plugins: bool = False,
               offload_optimizer: bool | str | dict[str, Any] | None = None,
               max_device_memory: int | float | None = None) -> Zero3Engine:
    """Partitions ``model``'s parameters and installs the hooks; returns the
    engine. Collective: every rank calls it with the same model structure.

    ``optimizer_factory``: called with the list of shard parameters (one flat
    tensor per parameter, in ``model.named_parameters()`` order, fp32 masters
    with mixed precision), returns a ``torch.optim`` optimizer (or None: no
    optimizer). ``config``: a ductile TOML (path or text; a dict of sections
    through ``ductile.load_config(d, format="toml")``) with a ``[zero]``
    section (e.g. ``coordinator = "partitioned"``) and an ``[accelerator]``
    section, or a DeepSpeed JSON config (path, text, or dict, as
    ``deepspeed.initialize`` takes it: ZeRO stage 3; its bf16/fp16,
    gradient_clipping, optimizer and scheduler keys are honoured: the
    scheduler is ``engine.lr_scheduler``, stepped by ``step()``), or a loaded
    ``ductile.Config``. When
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
    ``no_sync()`` for all but the last micro-batch). ``groups``: which
    modules are hooked and gather their parameters as one group (one
    collective each way): "auto" (the transformer blocks: a Hugging Face
    model's ``_no_split_modules``, else each child of an ``nn.ModuleList``;
    the root takes the rest), "module" (every module with parameters), a
    tuple of module classes or a callable ``module -> bool`` (those, and the
    root). ``offload_optimizer``: "cpu" (or True) keeps every group's fp32
    master and Adam state in host memory, stepped by the cpu_adam plugin
    (a dict takes DeepSpeed's offload_optimizer keys: device, pin_memory,
    ratio); the optimizer must be Adam or AdamW. ``max_device_memory``:
    bytes (int) or a fraction of the device's memory (float): the groups'
    optimizers that do not fit go to the host. ``engine.stats()`` reports
    the placement and the device bytes (docs/zero3.md, "Offload").
    ``mixed_precision``, ``offload_optimizer`` and ``optimizer_factory``
    win over what the config sets for the same thing (its bf16/fp16
    sections, offload_optimizer key, optimizer section), with a UserWarning
    naming the key they replace.
    ``allow_config_plugins``: load plugins from the directories the
    config's own ``[plugins] path`` names (off: see ``ductile.load_config``).
    Under ``ductile agent``, the engine writes snapshots of the training
    state into DUCTILE_SNAPSHOT_DIR every ``[zero] snapshot_interval``
    steps, and loads DUCTILE_SNAPSHOT_RESTORE when a round resumes from
    one (``engine.restored_from_memory``: its step; docs/zero3.md,
    "Snapshots in memory").
    Raises ConfigError (also for a plugin the config selects from a
    directory it names, without ``allow_config_plugins``),
    InvalidArgumentError (a parameter of an unsupported dtype or on the
    wrong device, a bad ``groups``).
    """
    if config is not None:
        config = load_config(config, plugin_path=plugin_path,
                             allow_config_plugins=allow_config_plugins)
    engine = Zero3Engine(model, optimizer_factory, config, plugin_path=plugin_path,
                         mixed_precision=mixed_precision, load_from=load_from, group=group,
                         step_in_backward=step_in_backward, groups=groups,
                         offload_optimizer=offload_optimizer,
                         max_device_memory=max_device_memory)
    scheduler = (engine.training or {}).get("scheduler")
    if scheduler is not None and engine.optimizer is not None:
        from ...deepspeed.lr_schedules import scheduler_from_config
        engine.lr_scheduler = scheduler_from_config(scheduler, engine.optimizer)
    return engine
