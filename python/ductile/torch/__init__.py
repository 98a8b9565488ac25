"""ductile for PyTorch: variable-batch data loading and learning-rate scaling
(the equivalent of DeepSpeed's
``get_dataloader_and_lr_scheduler_for_variable_batch_size``), on the C++
packing pipeline (``ductile.batching.pack``) and the lr plugins.

    sampler = DynamicBatchSampler(lengths, max_tokens=4096, gradient_accumulation_steps=2,
                                  order="random", seed=42)          # rank/world from torch.distributed
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=PadCollate())
    scheduler = VariableBatchLRScheduler(optimizer, sampler, lr_rule="sqrt",
                                         base_batch_size=64, schedule="warmup_linear",
                                         warmup_steps=100, total_steps=10_000)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for i, (tokens, lengths) in enumerate(loader):
            loss = ...; loss.backward()
            if (i + 1) % sampler.gradient_accumulation_steps == 0:
                optimizer.step(); scheduler.step(); optimizer.zero_grad()

Nothing here computes a packing or a learning rate: both come from C++.
"""

import numpy as np
import torch

from .. import batching as _batching
from .. import metrics as _metrics
from .._errors import InvalidArgumentError
from ._collate import FlattenCollate, PadCollate, PaddedSamples

__all__ = ["DynamicBatchSampler", "FlattenCollate", "PadCollate", "PaddedSamples",
           "VariableBatchLRScheduler",
           "variable_batch_dataloader", "get_dataloader_and_lr_scheduler_for_variable_batch_size"]


def _distributed_rank_and_size(rank, world_size):
    if rank is None or world_size is None:
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        if world_size is None:
            world_size = dist.get_world_size() if initialized else 1
    rank, world_size = int(rank), int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgumentError(
            f"rank {rank} of world_size {world_size}: need world_size >= 1 and "
            "0 <= rank < world_size")
    return rank, world_size


class DynamicBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches (lists of dataset indices) of a
    token-budget packing: a batch sampler for ``DataLoader(batch_sampler=...)``.

    Every epoch is one ``ductile.batching.pack`` call over all samples, the
    same on every rank (same seed), with ``effective_batch_size =
    gradient_accumulation_steps x world_size`` micro-batches per optimizer
    step; rank ``r`` takes micro-batches r, r + world_size, ... (torch's
    DistributedSampler rule), so each rank gets exactly
    ``gradient_accumulation_steps`` micro-batches per step and every packed
    sample is seen exactly once per epoch across ranks (the plan's
    ``leftover_ids`` and ``dropped_ids`` are the ones that are not).

    ``lengths``: the length of every sample (int64 buffer, list or tensor).
    ``order``: "random" reshuffles every epoch (seed + epoch, see
    :meth:`set_epoch`), "seqlen" or "dataloader". ``rank``/``world_size``:
    default from torch.distributed (0/1 when it is not initialised).
    ``pad_to_step_max``: yield ``(index, length)`` pairs, ``length`` being
    the longest sample of the step (pipeline parallelism: use with
    :class:`PaddedSamples`). Other keyword arguments are those of
    ``ductile.batching.pack`` (``sampler``, ``min_batch_size``,
    ``max_batch_size``, ``same_size_microbatches``, ``budget``, ``params``,
    ``runtime``, ``plugin_path``).
    """

    def __init__(self, lengths, *, max_tokens, gradient_accumulation_steps=None,
                 effective_batch_size=None, rank=None, world_size=None, order="random",
                 seed=1234, pad_to_step_max=False, **pack_options):
        self.rank, self.world_size = _distributed_rank_and_size(rank, world_size)
        if effective_batch_size is None:
            ga = 1 if gradient_accumulation_steps is None else int(gradient_accumulation_steps)
            if ga < 1:
                raise InvalidArgumentError(
                    f"gradient_accumulation_steps {ga} is out of range; must be >= 1")
            effective_batch_size = ga * self.world_size
        elif effective_batch_size % self.world_size != 0:
            raise InvalidArgumentError(
                f"effective_batch_size {effective_batch_size} is not a multiple of world_size "
                f"{self.world_size}: every rank must process as many micro-batches per step")
        self.effective_batch_size = int(effective_batch_size)
        self.gradient_accumulation_steps = self.effective_batch_size // self.world_size
        self.lengths = np.ascontiguousarray(_batching._as_int64_buffer(lengths))
        self.max_tokens = int(max_tokens)
        self.order = order
        self.seed = int(seed)
        self.pad_to_step_max = bool(pad_to_step_max)
        self._pack_options = pack_options
        self.epoch = 0
        self._position = 0  # micro-batches of this epoch already handed out on this rank
        self._plans = {}
        self.plan(0)  # checks every option now, not in the training loop

    def plan(self, epoch=None):
        """The packing of an epoch (a ductile.batching.PackPlan), the same on every rank."""
        epoch = self.epoch if epoch is None else int(epoch)
        plan = self._plans.get(epoch)
        if plan is None:
            seed = self.seed + epoch if self.order == "random" else self.seed
            plan = _batching.pack(self.lengths, max_tokens=self.max_tokens, order=self.order,
                                  seed=seed, effective_batch_size=self.effective_batch_size,
                                  ranks=self.world_size, **self._pack_options)
            if len(self._plans) > 4:
                self._plans.pop(min(self._plans))
            self._plans[epoch] = plan
        return plan

    def batch_sizes(self, epoch=None):
        """Samples per optimizer step (all ranks together) of an epoch."""
        return self.plan(epoch).batch_sizes

    def set_epoch(self, epoch):
        """Selects the epoch to iterate; with order="random" its packing is
        shuffled with seed + epoch. Keeps the position restored by
        load_state_dict when it is that state's epoch."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self._position = 0

    def _microbatches(self):
        plan = self.plan()
        return plan, plan.rank_microbatches[self.rank]

    def __len__(self):
        return len(self._microbatches()[1])

    def __iter__(self):
        plan, mine = self._microbatches()
        start = self._position
        for position in range(start, len(mine)):
            m = mine[position]
            ids = plan.microbatch(m).tolist()
            self._position = position + 1
            if self.pad_to_step_max:
                pad = int(plan.batch_max_seqlens[plan.microbatch_steps[m]])
                yield [(i, pad) for i in ids]
            else:
                yield ids
        # A finished epoch: the next iteration starts the next one from the top.
        self._position = 0
        self.epoch += 1

    def state_dict(self, consumed=None):
        """Where this rank stands: epoch and micro-batches handed out in it.
        With DataLoader workers (which fetch ahead) pass ``consumed``, the
        micro-batches the training loop has processed in this epoch."""
        return {"format": "ductile.DynamicBatchSampler", "version": 1, "epoch": self.epoch,
                "position": self._position if consumed is None else int(consumed),
                "seed": self.seed, "order": self.order, "rank": self.rank,
                "world_size": self.world_size, "samples": len(self.lengths),
                "max_tokens": self.max_tokens, "effective_batch_size": self.effective_batch_size}

    def load_state_dict(self, state):
        """Restores a state_dict: the next iteration continues with exactly the
        micro-batches that were still to come. Raises InvalidArgumentError
        when the state belongs to another configuration."""
        if not isinstance(state, dict) or state.get("format") != "ductile.DynamicBatchSampler":
            raise InvalidArgumentError("load_state_dict: not a DynamicBatchSampler state_dict")
        for key in ("seed", "order", "world_size", "samples", "max_tokens",
                    "effective_batch_size"):
            mine = self.state_dict()[key]
            if state[key] != mine:
                raise InvalidArgumentError(
                    f"load_state_dict: the state has {key} = {state[key]!r}, this sampler "
                    f"{mine!r}: it was saved with another configuration")
        self.epoch = int(state["epoch"])
        self._position = int(state["position"])


class VariableBatchLRScheduler:
    """Scales the learning rate of every optimizer step by that step's real
    batch size (samples over all ranks, from the sampler's packing) with an lr
    rule plugin ("linear", "sqrt", "none" or any other), as DeepSpeed's
    VariableBatchSizeLR does.

    Without ``lr_scheduler``: each param group follows the C++
    variable-batch schedule (``ductile.batching.LrSchedule``) whose base rate
    is the group's initial lr (or ``base_lr``), with the base ``schedule``
    ("constant", "warmup_linear", "warmup_cosine"), ``warmup_steps``,
    ``total_steps``, ``min_lr``. With ``lr_scheduler`` (any
    torch.optim.lr_scheduler on the same optimizer): its rates are the base,
    scaled by the rule each step.

    Stepping follows DeepSpeed: construction sets the rate of step 0; call
    :meth:`step` after every ``optimizer.step()``. Steps run through the
    sampler's epochs in order (epoch 0's steps, then epoch 1's, ...).
    """

    def __init__(self, optimizer, sampler, *, lr_rule="linear", base_batch_size,
                 lr_params=None, base_lr=None, schedule="constant", warmup_steps=0,
                 total_steps=0, min_lr=0.0, lr_scheduler=None, runtime=None, plugin_path=None):
        self.optimizer = optimizer
        self.sampler = sampler
        self.base_batch_size = float(base_batch_size)
        self.lr_scheduler = lr_scheduler
        self.rule = _batching.LrRule(str(lr_rule), lr_params, runtime, plugin_path)
        self._schedule_args = dict(schedule=schedule, min_lr=float(min_lr),
                                   warmup_steps=int(warmup_steps), total_steps=int(total_steps))
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs = [float(base_lr) if base_lr is not None else float(g["initial_lr"])
                         for g in optimizer.param_groups]
        self.last_step = 0
        self._sizes = []       # batch sizes of the steps of epochs 0 .. _epochs - 1
        self._epochs = 0
        self._schedules = None
        self._unscaled = None
        if lr_scheduler is not None:
            self._unscaled = [g["lr"] for g in optimizer.param_groups]
        self._apply()

    def _cover(self, step):
        """Makes sure the batch sizes of `step` are known."""
        grown = False
        while len(self._sizes) <= step:
            sizes = self.sampler.batch_sizes(self._epochs)
            if len(sizes) == 0:
                raise InvalidArgumentError(f"epoch {self._epochs} of the sampler has no steps")
            self._sizes.extend(int(s) for s in sizes)
            self._epochs += 1
            grown = True
        if grown or self._schedules is None:
            if self.lr_scheduler is None:
                self._schedules = [
                    _batching.LrSchedule(self.rule, self.base_batch_size, self._sizes,
                                         base_lr=lr, **self._schedule_args)
                    for lr in self.base_lrs]
            else:
                self._schedules = []

    def batch_size(self, step=None):
        """Samples of a step (default: the current one)."""
        step = self.last_step if step is None else int(step)
        self._cover(step)
        return self._sizes[step]

    def lr_at(self, step):
        """The rates of every param group at ``step`` (no lr_scheduler only)."""
        self._cover(int(step))
        return [s.lr_at(int(step)) for s in self._schedules]

    def _apply(self):
        step = self.last_step
        self._cover(step)
        if self.lr_scheduler is None:
            rates = [s.lr_at(step) for s in self._schedules]
        else:
            batch = float(self._sizes[step])
            rates = [self.rule.scale(lr, batch, self.base_batch_size) for lr in self._unscaled]
        for group, lr in zip(self.optimizer.param_groups, rates):
            group["lr"] = lr
        self._last_lr = rates

    def step(self):
        """Moves to the next optimizer step and sets its learning rates."""
        if self.lr_scheduler is not None:
            # The wrapped scheduler steps from its own (unscaled) rates, so
            # chainable schedulers see what they set, never our scaling.
            for group, lr in zip(self.optimizer.param_groups, self._unscaled):
                group["lr"] = lr
            self.lr_scheduler.step()
            self._unscaled = [g["lr"] for g in self.optimizer.param_groups]
        self.last_step += 1
        self._apply()

    def get_last_lr(self):
        return list(self._last_lr)

    def state_dict(self):
        return {"format": "ductile.VariableBatchLRScheduler", "version": 1,
                "last_step": self.last_step, "base_lrs": list(self.base_lrs),
                "base_batch_size": self.base_batch_size, "rule": self.rule.name,
                "schedule": dict(self._schedule_args),
                "unscaled": None if self._unscaled is None else list(self._unscaled),
                "lr_scheduler": None if self.lr_scheduler is None
                else self.lr_scheduler.state_dict()}

    def load_state_dict(self, state):
        """Restores a state_dict: the following steps get exactly the rates
        they would have had. Raises InvalidArgumentError for a state of
        another configuration."""
        if not isinstance(state, dict) or state.get("format") != "ductile.VariableBatchLRScheduler":
            raise InvalidArgumentError(
                "load_state_dict: not a VariableBatchLRScheduler state_dict")
        mine = self.state_dict()
        for key in ("base_batch_size", "rule", "schedule", "base_lrs"):
            if state[key] != mine[key]:
                raise InvalidArgumentError(
                    f"load_state_dict: the state has {key} = {state[key]!r}, this scheduler "
                    f"{mine[key]!r}: it was saved with another configuration")
        if (state["lr_scheduler"] is None) != (self.lr_scheduler is None):
            raise InvalidArgumentError("load_state_dict: the state was saved "
                                       + ("with" if state["lr_scheduler"] else "without")
                                       + " a wrapped lr_scheduler; this scheduler differs")
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            self._unscaled = list(state["unscaled"])
        self.last_step = int(state["last_step"])
        self._apply()


def variable_batch_dataloader(dataset, *, lengths=None, metrics_path=None, length_fn=len,
                              optimizer=None, max_tokens, gradient_accumulation_steps=1,
                              order="random", seed=1234, rank=None, world_size=None,
                              lr_rule=None, base_batch_size=None, lr_scheduler=None,
                              lr_options=None, collate_fn=None, sample_padding_fn=None,
                              num_workers=0, pin_memory=False, **pack_options):
    """DataLoader + LR scheduler for variable-size batches of a map-style dataset.

    Lengths: ``lengths`` (one per sample), or DeepSpeed's ``metrics_path``
    contract (read ``{metrics_path}/seqlen/seqlen_sample_to_metric``, else
    computed with ``length_fn`` and written there), else computed with
    ``length_fn``. ``sample_padding_fn(sample, length)``: pad every sample of
    a step to the step's longest (pipeline parallelism; use with
    ``same_size_microbatches=True`` for equal micro-batch sizes). With an
    ``optimizer`` and ``lr_rule``, a :class:`VariableBatchLRScheduler`
    (``base_batch_size``, ``lr_scheduler`` and ``lr_options``: its other
    keyword arguments). Returns ``(loader, scheduler or None, sampler)``.
    """
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
                                         collate_fn=collate_fn or PadCollate(),
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


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset, ds_config, optimizer=None, *, lr_scheduler=None, rank=None, world_size=None,
        collate_fn=None, sample_padding_fn=None, length_fn=len, num_workers=0,
        pin_memory=False):
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
        order=params.pop("order", "dataloader"), seed=params.pop("seed", 1234), rank=rank,
        world_size=world_size, lr_rule=kwargs.get("lr_rule"),
        base_batch_size=kwargs.get("base_batch_size"), lr_scheduler=lr_scheduler,
        lr_options=lr_options, collate_fn=collate_fn, sample_padding_fn=sample_padding_fn,
        num_workers=num_workers, pin_memory=pin_memory, sampler=kwargs.get("sampler", "greedy"),
        params=params, runtime=kwargs.get("runtime"))

