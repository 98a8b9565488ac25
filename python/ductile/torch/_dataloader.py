"""DataLoader, sampler and LR scheduler built together: from keyword
arguments, or from a DeepSpeed config (DeepSpeed's entry point)."""

from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import torch

from .. import batching as _batching
from .. import metrics as _metrics
from .._config import Config, StrPath
from .._errors import InvalidArgumentError
from ..metrics import MapDataset
from ._collate import FlattenCollate, PadCollate, PaddedSamples
from ._lr_scheduler import VariableBatchLRScheduler
from ._sampler import DynamicBatchSampler, Lengths, _distributed_rank_and_size


def variable_batch_dataloader(
        dataset: MapDataset, *, lengths: Lengths | None = None,
        metrics_path: StrPath | None = None, length_fn: Callable[[Any], int] = len,
        optimizer: torch.optim.Optimizer | None = None, max_tokens: int,
        gradient_accumulation_steps: int = 1, order: str = "random", seed: int = 1234,
        rank: int | None = None, world_size: int | None = None, lr_rule: str | None = None,
        base_batch_size: float | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        lr_options: Mapping[str, Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        collate: Literal["pad", "flatten"] | None = None,
        sample_padding_fn: Callable[[Any, int], Any] | None = None, num_workers: int = 0,
        pin_memory: bool = False, **pack_options: Any
) -> tuple[torch.utils.data.DataLoader, VariableBatchLRScheduler | None, DynamicBatchSampler]:
    """DataLoader + LR scheduler for variable-size batches of a map-style dataset.

    Lengths: ``lengths`` (one per sample), or DeepSpeed's ``metrics_path``
    contract (read ``{metrics_path}/seqlen/seqlen_sample_to_metric``, else
    computed with ``length_fn`` and written there), else computed with
    ``length_fn``. ``sample_padding_fn(sample, length)``: pad every sample of
    a step to the step's longest (pipeline parallelism; use with
    ``same_size_microbatches=True`` for equal micro-batch sizes). With an
    ``optimizer`` and ``lr_rule``, a :class:`VariableBatchLRScheduler`
    (``base_batch_size``, ``lr_scheduler`` and ``lr_options``: its other
    keyword arguments). Collation: ``collate_fn``, or ``collate="pad"``
    (:class:`PadCollate`, the default) or ``"flatten"`` (:class:`FlattenCollate`:
    padding-free rows in the contract of HF's ``DataCollatorWithFlattening``).
    Returns ``(loader, scheduler or None, sampler)``.
    """
    collate_fn = _collate_of(collate, collate_fn)
    if lengths is None:
        if metrics_path is not None:
            lengths = _metrics.lengths_from_metrics_path(metrics_path, dataset, length_fn)
        else:
            lengths = np.fromiter((length_fn(dataset[i]) for i in range(len(dataset))),
                                  dtype=np.int64, count=len(dataset))
    if len(lengths) != len(dataset):
        raise InvalidArgumentError(f"lengths has {len(lengths)} entries but the dataset has "
                                   f"{len(dataset)} samples")
    sampler = DynamicBatchSampler(lengths, max_tokens=max_tokens,
                                  gradient_accumulation_steps=gradient_accumulation_steps,
                                  rank=rank, world_size=world_size, order=order, seed=seed,
                                  pad_to_step_max=sample_padding_fn is not None, **pack_options)
    if sample_padding_fn is not None:
        dataset = PaddedSamples(dataset, sample_padding_fn)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                         collate_fn=collate_fn,
                                         num_workers=num_workers, pin_memory=pin_memory)
    scheduler = None
    if optimizer is not None and lr_rule is not None:
        if base_batch_size is None:
            raise InvalidArgumentError(f"lr_rule '{lr_rule}' needs base_batch_size (the batch "
                                       "size the optimizer's learning rate is tuned for)")
        scheduler = VariableBatchLRScheduler(optimizer, sampler, lr_rule=lr_rule,
                                             base_batch_size=base_batch_size,
                                             lr_scheduler=lr_scheduler, **(lr_options or {}))
    return loader, scheduler, sampler


_COLLATES = {"pad": PadCollate, "flatten": FlattenCollate}


def _collate_of(collate, collate_fn):
    if collate is not None and collate_fn is not None:
        raise InvalidArgumentError(
            f"collate={collate!r} and collate_fn are both given; give one of them")
    if collate_fn is not None:
        return collate_fn
    if collate is None:
        return PadCollate()
    if not isinstance(collate, str) or collate not in _COLLATES:
        raise InvalidArgumentError(
            f"collate={collate!r} is not valid; use 'pad' or 'flatten' (or a collate_fn)")
    return _COLLATES[collate]()


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset: MapDataset, ds_config: StrPath | dict[str, Any] | Config,
        optimizer: torch.optim.Optimizer | None = None, *,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        rank: int | None = None, world_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        collate: Literal["pad", "flatten"] | None = None,
        sample_padding_fn: Callable[[Any, int], Any] | None = None,
        length_fn: Callable[[Any], int] = len, num_workers: int = 0, pin_memory: bool = False
) -> tuple[torch.utils.data.DataLoader, VariableBatchLRScheduler | None, DynamicBatchSampler]:
    """DeepSpeed's entry point, from a DeepSpeed config (dict, JSON text or
    file): data_efficiency.data_sampling.dynamic_batching (max_tokens,
    lr_scaling_method, sequence_picking_order, min/max_batch_size,
    metrics_path), data_efficiency.seed, train_batch_size (micro-batches per
    step over all ranks, the LR's base batch size), optimizer.params.lr and a
    WarmupDecayLR scheduler, all read by the same C++ mapping as ``ductile
    pack --config``. Returns ``(loader, scheduler, sampler)``."""
    kwargs, lengths_spec = _batching.settings_from_config(ds_config)
    params = dict(kwargs.pop("params"))
    metrics_prefix = lengths_spec["file"]
    metrics_path = metrics_prefix[:-len(_metrics.SEQLEN_PREFIX)] \
        if metrics_prefix.endswith(_metrics.SEQLEN_PREFIX) else metrics_prefix
    lengths = _metrics.lengths_from_metrics_path(metrics_path, dataset, length_fn)
    rank, world_size = _distributed_rank_and_size(rank, world_size)
    effective = int(params.pop("effective_batch_size", world_size))
    if effective % world_size:
        raise InvalidArgumentError(
            f"train_batch_size {effective} is not a multiple of the world size {world_size}")
    lr_options = {k: kwargs[k] for k in ("schedule", "warmup_steps", "total_steps", "min_lr",
                                         "base_lr") if k in kwargs}
    lr_options["lr_params"] = kwargs.get("lr_params")
    if lr_scheduler is not None:
        lr_options.pop("base_lr", None)
    return variable_batch_dataloader(
        dataset, lengths=lengths, optimizer=optimizer, max_tokens=params.pop("max_tokens"),
        gradient_accumulation_steps=effective // world_size,
        order=params.pop("order"), seed=params.pop("seed"), rank=rank,
        world_size=world_size, lr_rule=kwargs.get("lr_rule"),
        base_batch_size=kwargs.get("base_batch_size"), lr_scheduler=lr_scheduler,
        lr_options=lr_options, collate_fn=collate_fn, collate=collate,
        sample_padding_fn=sample_padding_fn,
        num_workers=num_workers, pin_memory=pin_memory, sampler=kwargs.get("sampler", "greedy"),
        params=params, runtime=kwargs.get("runtime"))

