"""DynamicBatchSampler: this rank's micro-batches of a token-budget packing,
resumable mid-epoch at the same or another world size."""

import dataclasses
import hashlib

import numpy as np
import torch

from .. import _ductile
from .. import batching as _batching
from .._errors import InvalidArgumentError

_int = _ductile.int_argument  # an int, strictly: no bool, no float (C++ conversion)


def _distributed_rank_and_size(rank, world_size):
    if rank is None or world_size is None:
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        if world_size is None:
            world_size = dist.get_world_size() if initialized else 1
    rank, world_size = _int(rank, "rank"), _int(world_size, "world_size")
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

    **Elastic resume.** :meth:`load_state_dict` also takes a state saved at
    another world size (or another ``gradient_accumulation_steps``): the
    epoch goes on from the last optimizer step the state had completed. The
    samples of the steps already run are set aside, and the ones they left
    are packed again for the new world size (same seed and order). So no
    sample is repeated or skipped; a micro-batch handed out in an unfinished
    step is packed again, since its step never reached the optimizer. Later
    epochs are packed whole at the new world size.
    :class:`VariableBatchLRScheduler` follows the new step sizes.
    """

    def __init__(self, lengths, *, max_tokens, gradient_accumulation_steps=None,
                 effective_batch_size=None, rank=None, world_size=None, order="random",
                 seed=1234, pad_to_step_max=False, **pack_options):
        self.rank, self.world_size = _distributed_rank_and_size(rank, world_size)
        if effective_batch_size is None:
            ga = 1 if gradient_accumulation_steps is None else _int(
                gradient_accumulation_steps, "gradient_accumulation_steps")
            if ga < 1:
                raise InvalidArgumentError(
                    f"gradient_accumulation_steps {ga} is out of range; must be >= 1")
            effective_batch_size = ga * self.world_size
        effective_batch_size = _int(effective_batch_size, "effective_batch_size")
        if effective_batch_size % self.world_size != 0:
            raise InvalidArgumentError(
                f"effective_batch_size {effective_batch_size} is not a multiple of world_size "
                f"{self.world_size}: every rank must process as many micro-batches per step")
        self.effective_batch_size = effective_batch_size
        self.gradient_accumulation_steps = self.effective_batch_size // self.world_size
        self.lengths = np.ascontiguousarray(_batching._as_int64_buffer(lengths))
        self.max_tokens = _int(max_tokens, "max_tokens")
        self.order = order
        self.seed = _int(seed, "seed")
        self.pad_to_step_max = bool(pad_to_step_max)
        self._pack_options = pack_options
        self._fingerprint = _lengths_fingerprint(self.lengths)
        self.epoch = 0
        self._position = 0  # micro-batches of this epoch already handed out on this rank
        # Where step counting starts: the first optimizer step of epoch
        # _anchor_epoch is global step _anchor_step. Its steps already run at
        # other world sizes are _segments: (effective_batch_size, steps) pairs,
        # replayed in order to find the samples they took.
        self._anchor_epoch = 0
        self._anchor_step = 0
        self._segments = []
        self.layout_version = 0  # changes when load_state_dict changes the packing
        self._layouts = {}
        self._step_counts = {}
        self.plan(0)  # checks every option now, not in the training loop

    def _pack(self, epoch, subset, effective_batch_size, ranks):
        seed = self.seed + epoch if self.order == "random" else self.seed
        lengths = self.lengths if subset is None else np.ascontiguousarray(self.lengths[subset])
        plan = _batching.pack(lengths, max_tokens=self.max_tokens, order=self.order, seed=seed,
                              effective_batch_size=effective_batch_size, ranks=ranks,
                              **self._pack_options)
        if subset is None:
            return plan
        return dataclasses.replace(  # ids of the subset back to dataset indices
            plan, sample_ids=subset[plan.sample_ids], dropped_ids=subset[plan.dropped_ids],
            leftover_ids=subset[plan.leftover_ids], lengths=self.lengths)

    def _layout(self, epoch):
        """(plan, batch sizes of the steps run before it) of an epoch."""
        layout = self._layouts.get(epoch)
        if layout is not None:
            return layout
        subset, done_sizes, done_tokens = None, [], []
        if epoch == self._anchor_epoch:
            for effective_batch_size, steps in self._segments:
                earlier = self._pack(epoch, subset, effective_batch_size, 0)
                if steps > earlier.step_count:
                    raise InvalidArgumentError(
                        f"load_state_dict: the state ran {steps} steps of epoch {epoch} at "
                        f"effective_batch_size {effective_batch_size}, but that packing has "
                        f"{earlier.step_count}: it was saved for other data")
                sample_steps = np.repeat(earlier.microbatch_steps,
                                         np.diff(earlier.microbatch_offsets))
                used = np.zeros(len(self.lengths), dtype=bool)
                used[earlier.sample_ids[sample_steps < steps]] = True
                done_sizes.extend(int(s) for s in earlier.batch_sizes[:steps])
                done_tokens.extend(int(t) for t in _step_tokens(earlier)[:steps])
                subset = np.flatnonzero(~used) if subset is None else subset[~used[subset]]
        layout = (self._pack(epoch, subset, self.effective_batch_size, self.world_size),
                  done_sizes, done_tokens)
        if len(self._layouts) > 4:
            self._layouts.pop(min(self._layouts))
        self._layouts[epoch] = layout
        return layout

    def plan(self, epoch=None):
        """The packing of an epoch (a ductile.batching.PackPlan), the same on
        every rank. After an elastic resume, for the resumed epoch: the
        packing of the samples that the steps already run left."""
        return self._layout(self.epoch if epoch is None else int(epoch))[0]

    def batch_sizes(self, epoch=None):
        """Samples per optimizer step (all ranks together) of an epoch, the
        steps run before an elastic resume included."""
        plan, done_sizes, _ = self._layout(self.epoch if epoch is None else int(epoch))
        return np.concatenate([np.asarray(done_sizes, dtype=np.int64), plan.batch_sizes])

    def step_totals(self, epoch=None):
        """Per optimizer step of an epoch, over every rank and micro-batch of
        the step: ``tokens``, ``samples`` and ``labels`` (``tokens -
        samples``: the next-token targets of a causal LM, whose first token
        has none), as int64 arrays indexed like :meth:`batch_sizes`. Every
        rank knows them from the packing, with no communication: pass
        ``labels[step]`` as ``num_items_in_batch`` (Hugging Face's name) to
        normalise the loss by the whole step, as one big batch would."""
        epoch = self.epoch if epoch is None else int(epoch)
        plan, _, done_tokens = self._layout(epoch)
        tokens = np.concatenate([np.asarray(done_tokens, dtype=np.int64), _step_tokens(plan)])
        samples = self.batch_sizes(epoch)
        return {"tokens": tokens, "samples": samples, "labels": tokens - samples}

    def step_of(self, position, epoch=None):
        """The step (index into :meth:`step_totals`) of this rank's
        micro-batch number ``position`` of the epoch, counted as
        :attr:`position` counts: ``enumerate(loader, start=sampler.position)``
        numbers the micro-batches of a loop, resumed or not."""
        epoch = self.epoch if epoch is None else int(epoch)
        plan, done_sizes, _ = self._layout(epoch)
        mine = plan.rank_microbatches[self.rank]
        position = int(position)
        if not 0 <= position < len(mine):
            raise InvalidArgumentError(
                f"step_of: position {position} is out of range; rank {self.rank} has "
                f"{len(mine)} micro-batches in epoch {epoch}")
        return len(done_sizes) + int(plan.microbatch_steps[mine[position]])

    @property
    def position(self):
        """Micro-batches of the current epoch this rank has handed out (where
        the next iteration starts)."""
        return self._position

    def first_step(self, epoch=None):
        """The global index of the epoch's first optimizer step (steps of the
        earlier epochs as they ran, across elastic resumes)."""
        epoch = self.epoch if epoch is None else int(epoch)
        if epoch < self._anchor_epoch:
            raise InvalidArgumentError(
                f"first_step: epoch {epoch} ran before the state this sampler resumed from "
                f"(epoch {self._anchor_epoch}); its steps are not known")
        step = self._anchor_step
        for e in range(self._anchor_epoch, epoch):
            if e not in self._step_counts:
                self._step_counts[e] = len(self.batch_sizes(e))
            step += self._step_counts[e]
        return step

    @property
    def resume_epoch(self):
        """The first epoch whose steps this sampler knows (0 unless resumed)."""
        return self._anchor_epoch

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
        position = self._position if consumed is None else int(consumed)
        if not 0 <= position <= len(self):
            raise InvalidArgumentError(
                f"state_dict: consumed {position} is out of range; this rank has {len(self)} "
                f"micro-batches in epoch {self.epoch}")
        return {"format": "ductile.DynamicBatchSampler", "version": 2, "epoch": self.epoch,
                "position": position, "seed": self.seed, "order": self.order, "rank": self.rank,
                "world_size": self.world_size, "samples": len(self.lengths),
                "lengths_sha256": self._fingerprint, "max_tokens": self.max_tokens,
                "effective_batch_size": self.effective_batch_size,
                "first_step": self.first_step(),
                "segments": [list(s) for s in self._segments]
                if self.epoch == self._anchor_epoch else []}

    def load_state_dict(self, state):
        """Restores a state_dict. At the world size and batch settings it was
        saved with: the next iteration continues with exactly the
        micro-batches that were still to come on this rank. At others
        (elastic resume, the state of any rank): the epoch continues after the
        last step the state completed. Raises InvalidArgumentError for a state
        of other data or other packing settings, and for a damaged one."""
        if not isinstance(state, dict) or state.get("format") != "ductile.DynamicBatchSampler":
            raise InvalidArgumentError("load_state_dict: not a DynamicBatchSampler state_dict")
        version = state.get("version")
        if version not in (1, 2):
            raise InvalidArgumentError(
                f"load_state_dict: state version {version!r} is not supported; this ductile "
                "reads versions 1 and 2")
        needed = ["epoch", "position", "seed", "order", "rank", "world_size", "samples",
                  "max_tokens", "effective_batch_size"]
        if version == 2:
            needed += ["lengths_sha256", "first_step", "segments"]
        missing = [k for k in needed if k not in state]
        if missing:
            raise InvalidArgumentError(
                f"load_state_dict: the state lacks {', '.join(missing)}: it is damaged")
        mine = {"seed": self.seed, "order": self.order, "samples": len(self.lengths),
                "max_tokens": self.max_tokens, "lengths_sha256": self._fingerprint}
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise InvalidArgumentError(
                    f"load_state_dict: the state has {key} = {state[key]!r}, this sampler "
                    f"{value!r}: it was saved for other data or another packing")
        epoch, position = _state_int(state, "epoch"), _state_int(state, "position")
        world_size = _state_int(state, "world_size", 1)
        effective = _state_int(state, "effective_batch_size", 1)
        rank = _state_int(state, "rank")
        first_step = _state_int(state, "first_step") if version == 2 else None
        segments = [tuple(_segment(s)) for s in state.get("segments", [])]
        if effective % world_size or rank >= world_size:
            raise InvalidArgumentError(
                f"load_state_dict: rank {rank}, world_size {world_size} and "
                f"effective_batch_size {effective} do not fit together: it is damaged")
        same_layout = world_size == self.world_size and effective == self.effective_batch_size
        if same_layout and rank != self.rank:
            raise InvalidArgumentError(
                f"load_state_dict: the state is rank {rank}'s and this sampler is rank "
                f"{self.rank} at the same world size {world_size}: load each rank's own state")
        if first_step is None and not same_layout:
            raise InvalidArgumentError(
                f"load_state_dict: a version 1 state (world_size {world_size}, "
                f"effective_batch_size {effective}) resumes only at those settings; this "
                f"sampler has world_size {self.world_size}, effective_batch_size "
                f"{self.effective_batch_size}")
        if first_step is None:  # version 1: every epoch ran whole at this layout
            self._anchor_epoch, self._anchor_step, self._segments = 0, 0, []
        else:
            self._anchor_epoch, self._anchor_step, self._segments = epoch, first_step, segments
        if not same_layout:
            # Whole steps only: a micro-batch of an unfinished step never
            # reached the optimizer, so its samples are packed again.
            self._segments = segments + [(effective, position // (effective // world_size))]
            position = 0
        self._layouts, self._step_counts = {}, {}
        self.layout_version += 1
        self.epoch = epoch
        if position > len(self):
            raise InvalidArgumentError(
                f"load_state_dict: position {position} is out of range; rank {self.rank} has "
                f"{len(self)} micro-batches in epoch {epoch}")
        self._position = position


def _step_tokens(plan):
    tokens, _ = plan.microbatch_tokens()
    per_step = np.bincount(plan.microbatch_steps, weights=tokens, minlength=plan.step_count)
    return per_step.astype(np.int64)


def _lengths_fingerprint(lengths):
    return hashlib.sha256(np.ascontiguousarray(lengths, dtype=np.int64).tobytes()).hexdigest()


def _state_int(state, key, low=0):
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgumentError(
            f"load_state_dict: {key} = {value!r} must be an integer >= {low}: the state is "
            "damaged")
    return int(value)


def _segment(value):
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or value[0] < 1 or value[1] < 0):
        raise InvalidArgumentError(
            f"load_state_dict: segment {value!r} must be [effective_batch_size >= 1, "
            "steps >= 0]: the state is damaged")
    return int(value[0]), int(value[1])
