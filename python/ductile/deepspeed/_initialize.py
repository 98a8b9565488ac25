"""``deepspeed.initialize``, ``deepspeed.init_distributed`` and
``deepspeed.add_config_arguments`` on ductile's ZeRO-3 engine, with
DeepSpeed's signatures and return values.

The config is read once, by the pipeline's DeepSpeed mapping (the keys it
honours, warns about or refuses: docs/deepspeed.md); the batch triple is
completed with the world size by DeepSpeed's rules; the optimizer is the
script's (rebound to the shards, so a scheduler made over it keeps
working) or the config's; the scheduler is the script's or the config's
(``ductile.deepspeed.lr_schedules``).
"""

import argparse
import datetime
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from .._config import Config, StrPath, load_config, parse_json
from .._errors import ConfigError, InvalidArgumentError
from ..torch.zero3 import _settings as _zero3_settings
from ..torch.zero3._engine import Zero3Engine
from ._engine import DeepSpeedEngine


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialises torch.distributed's default process group from the
    launcher's environment (torchrun, ``ductile agent``: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), unless it is initialised already or
    ``dist_init_required`` is False. The backend: ``dist_backend``, else
    NCCL when CUDA is available, else gloo. Under mpirun without those
    variables, Open MPI's (OMPI_COMM_WORLD_*) are used with
    ``distributed_port``."""
    if dist_init_required is False or dist.is_initialized():
        return
    env = os.environ
    if "RANK" not in env and "OMPI_COMM_WORLD_RANK" in env and auto_mpi_discovery:
        env["RANK"] = env["OMPI_COMM_WORLD_RANK"]
        env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_SIZE"]
        env["LOCAL_RANK"] = env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(distributed_port))
    if rank == -1 and "RANK" not in env:
        # One process with no launcher: a world of one, as DeepSpeed makes it.
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(distributed_port))
        rank, world_size = 0, 1
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs: dict[str, Any] = {"backend": backend}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank != -1:
        kwargs.update(rank=rank, world_size=world_size)
    if backend == "nccl" and "LOCAL_RANK" in env:
        torch.cuda.set_device(int(env["LOCAL_RANK"]))
    dist.init_process_group(**kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds DeepSpeed's command-line arguments (``--deepspeed``,
    ``--deepspeed_config``, and the deprecated ``--deepscale`` ones) to an
    argparse parser; returns it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for the script; read by ductile as by "
                            "DeepSpeed: it changes nothing by itself)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated: --deepspeed_config")
    return parser


def _config_source(args, config, config_params):
    if config is None and config_params is not None:
        config = config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config",
                                                                         None)
    if from_args is not None and config is not None:
        raise InvalidArgumentError(
            "initialize: a config in args.deepspeed_config "
            f"({from_args!r}) and in config=: give one of them")
    config = from_args if from_args is not None else config
    if config is None:
        raise InvalidArgumentError(
            "initialize: no DeepSpeed config: pass config= (a path or a dict) or "
            "args.deepspeed_config (--deepspeed_config ds.json)")
    return config


def batch_sizes(training, world_size, origin):
    """(train_batch_size, micro-batch per rank, gradient accumulation steps)
    from the keys given, completed with the world size by DeepSpeed's
    rules; ConfigError naming the keys when they disagree."""
    train = training["train_batch_size"]
    micro = training["train_micro_batch_size_per_gpu"]
    gas = training["gradient_accumulation_steps"]
    if train is not None and micro is not None and gas is not None:
        pass
    elif train is not None and micro is not None:
        gas = train // micro // world_size
    elif train is not None and gas is not None:
        micro = train // world_size // gas
    elif micro is not None and gas is not None:
        train = micro * gas * world_size
    elif train is not None:
        gas = 1
        micro = train // world_size
    elif micro is not None:
        gas = 1
        train = micro * world_size
    else:
        raise ConfigError(
            f"{origin}: train_batch_size and train_micro_batch_size_per_gpu are both missing; "
            "give one of them (with gradient_accumulation_steps if it is not 1)")
    if micro <= 0 or gas <= 0 or train != micro * gas * world_size:
        raise ConfigError(
            f"{origin}: train_batch_size = {train} is not train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x world size = {micro} x {gas} x {world_size}; "
            "valid: values whose product matches (or leave one out and ductile completes it)")
    return train, micro, gas


def _rebind(optimizer, model_params):
    """An optimizer_factory that moves the script's `optimizer` onto the
    shards: each of its parameters becomes the shard of the same parameter
    (its state is dropped: it has none before the first step), so the
    object the script holds, and a scheduler made over it, stay valid."""
    def factory(shards):
        position = {id(p): i for i, p in enumerate(model_params)}
        for group in optimizer.param_groups:
            moved = []
            for p in group["params"]:
                if id(p) not in position:
                    raise InvalidArgumentError(
                        "initialize: the optimizer holds a tensor that is not a parameter of "
                        "the model; build it over model.parameters()")
                moved.append(shards[position[id(p)]])
            group["params"] = moved
        optimizer.state.clear()
        return optimizer
    return factory


def _factory_of(optimizer, model_parameters, settings, model_params):
    """The zero3 optimizer_factory for initialize's optimizer arguments."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return _rebind(optimizer, model_params)
    if optimizer is not None:
        if not callable(optimizer):
            raise InvalidArgumentError(
                f"initialize: optimizer must be a torch.optim.Optimizer or a callable taking "
                f"the parameters, got {type(optimizer).__name__}")
        return optimizer
    if settings.optimizer is None:
        return None
    if model_parameters is None:
        return settings.optimizer
    # The config's optimizer over the script's parameter groups (weight
    # decay on some parameters only, ...).
    groups = list(model_parameters)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    position = {id(p): i for i, p in enumerate(model_params)}

    def factory(shards):
        # torch optimizers take parameter groups
        return settings.optimizer([
            dict(group, params=[shards[position[id(p)]] for p in group["params"]
                                if id(p) in position]) for group in groups])
    return factory


def _scheduler(lr_scheduler, optimizer, training):
    if lr_scheduler is not None:
        if hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict"):
            return lr_scheduler
        if callable(lr_scheduler):
            return lr_scheduler(optimizer)
        raise InvalidArgumentError(
            f"initialize: lr_scheduler must be a scheduler or a callable taking the optimizer, "
            f"got {type(lr_scheduler).__name__}")
    if training.get("scheduler") is None or optimizer is None:
        return None
    from .lr_schedules import scheduler_from_config
    return scheduler_from_config(training["scheduler"], optimizer)


def _dataloader(training_data, micro_batch, collate_fn, drop_last, world_size, rank):
    if training_data is None:
        return None
    sampler = torch.utils.data.distributed.DistributedSampler(
        training_data, num_replicas=world_size, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(training_data, batch_size=micro_batch, sampler=sampler,
                                       collate_fn=collate_fn, drop_last=drop_last)


def initialize(
        args: argparse.Namespace | None = None, model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Callable[[list[torch.Tensor]], torch.optim.Optimizer]
        | None = None,
        model_parameters: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]] | None = None,
        training_data: torch.utils.data.Dataset | None = None,
        lr_scheduler: Any = None, distributed_port: int = 29500, mpu: None = None,
        dist_init_required: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        config: StrPath | dict[str, Any] | Config | None = None, mesh_param: None = None,
        config_params: StrPath | dict[str, Any] | Config | None = None
) -> tuple[DeepSpeedEngine, torch.optim.Optimizer | None, torch.utils.data.DataLoader | None,
           Any]:
    """DeepSpeed's ``initialize`` on ductile's ZeRO-3 engine: returns
    ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config`` (or ``args.deepspeed_config``, or ``config_params``): a
    DeepSpeed JSON config (path, text or dict) with ZeRO stage 3.
    ``optimizer``: a torch optimizer over ``model.parameters()`` (moved onto
    the shards: the same object is returned), a callable taking the shard
    parameters, or None (the config's Adam/AdamW, over ``model_parameters``'
    groups when given). ``lr_scheduler``: a scheduler over that optimizer, a
    callable taking the optimizer, or None (the config's ``scheduler``).
    ``training_data``: a dataset, returned as a DataLoader of this rank's
    micro-batches (DistributedSampler). Collective.
    Raises ConfigError, InvalidArgumentError, as zero3.initialize does."""
    if model is None:
        raise InvalidArgumentError("initialize: model is required (a torch.nn.Module)")
    if mpu is not None or mesh_param is not None:
        raise InvalidArgumentError(
            "initialize: mpu / mesh_param (model parallelism) are not supported by ductile; "
            "valid: None (data parallelism over the world)")
    source = _config_source(args, config, config_params)
    if isinstance(source, dict) and source.get("steps_per_print") == float("inf"):
        # HF Accelerate's way of saying "never" (JSON has no infinity): the
        # same as leaving the key out.
        source = {k: v for k, v in source.items() if k != "steps_per_print"}
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    loaded = load_config(source, format="deepspeed")
    assert loaded.deepspeed is not None  # load_config refuses any other format
    as_dict = parse_json(loaded.deepspeed, loaded.origin)
    world = _zero3_settings.torch_world(None)
    settings = _zero3_settings.resolve(loaded, None, None, world)
    training = settings.training
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    batch = batch_sizes(training, world_size, loaded.origin)
    model_params = list(model.parameters())
    factory = _factory_of(optimizer, model_parameters, settings, model_params)
    zero3 = Zero3Engine(model, factory, settings, move_model=True)
    scheduler = _scheduler(lr_scheduler, zero3.optimizer, training)
    loader = _dataloader(training_data, batch[1], collate_fn, training["dataloader_drop_last"],
                         world_size, rank)
    engine = DeepSpeedEngine(model, zero3, batch, training, scheduler, loader, as_dict,
                             replan=lambda world: batch_sizes(training, world, loaded.origin))
    return engine, engine.optimizer, loader, scheduler
