"""DynamicBatchSampler: this rank's micro-batches of a token-budget packing,
resumable mid-epoch at the same or another world size."""

import bisect
import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from .. import _ductile
from .. import batching as _batching
from .._errors import InvalidArgumentError, shown as _shown

_int = _ductile.int_argument  # an int, strictly: no bool, no float (C++ conversion)

# One length per sample: a list, a NumPy integer array (int64 is read without
# a copy) or an integer tensor.
Lengths: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor

# The largest epoch a sampler iterates or a state names (no training runs 2^31
# epochs; an epoch is added to the 64-bit seed of the random order).
MAX_EPOCH = 2**31 - 1
# How many epochs ahead of the first one it knows a sampler packs to find a
# step (epoch_of): a resumed schedule further ahead than that was saved with
# a sampler state to load first.
MAX_EPOCHS_AHEAD = 4096
# The elastic re-forms one epoch of a state may list (each is packed again
# on resume).
MAX_SEGMENTS = 4096

_STATE_KEYS = {
    1: {"format", "version", "epoch", "position", "seed", "order", "rank", "world_size",
        "samples", "max_tokens", "effective_batch_size"},
}
_STATE_KEYS[2] = _STATE_KEYS[1] | {"lengths_sha256", "first_step", "segments"}


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

    def __init__(self, lengths: Lengths, *, max_tokens: int,
                 gradient_accumulation_steps: int | None = None,
                 effective_batch_size: int | None = None, rank: int | None = None,
                 world_size: int | None = None, order: str = "random", seed: int = 1234,
                 pad_to_step_max: bool = False, **pack_options: Any) -> None:
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
        self._segments: list[tuple[int, int]] = []
        self.layout_version = 0  # changes when load_state_dict changes the packing
        # epoch -> (plan, batch sizes and tokens of the steps run before it)
        self._layouts: dict[int, tuple[_batching.PackPlan, list[int], list[int]]] = {}
        self._starts = [0]  # first global step of epochs _anchor_epoch, _anchor_epoch + 1, ...
        self.plan(0)  # checks every option now, not in the training loop

    def _pack(self, epoch, subset, effective_batch_size, ranks):
        seed = self.seed + _check_epoch(epoch, self.seed, "epoch") \
            if self.order == "random" else self.seed
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
        if self.order != "random" and epoch != self._anchor_epoch:
            _check_epoch(epoch, self.seed, "epoch")
            epoch = self._anchor_epoch + 1  # every other epoch is packed alike
        layout = self._layouts.get(epoch)
        if layout is not None:
            return layout
        subset = None
        done_sizes: list[int] = []
        done_tokens: list[int] = []
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

    def plan(self, epoch: int | None = None) -> _batching.PackPlan:
        """The packing of an epoch (a ductile.batching.PackPlan), the same on
        every rank. After an elastic resume, for the resumed epoch: the
        packing of the samples that the steps already run left."""
        return self._layout(self.epoch if epoch is None else int(epoch))[0]

    def batch_sizes(self, epoch: int | None = None) -> npt.NDArray[np.int64]:
        """Samples per optimizer step (all ranks together) of an epoch, the
        steps run before an elastic resume included."""
        plan, done_sizes, _ = self._layout(self.epoch if epoch is None else int(epoch))
        return np.concatenate([np.asarray(done_sizes, dtype=np.int64), plan.batch_sizes])

    def step_totals(self, epoch: int | None = None) -> dict[str, npt.NDArray[np.int64]]:
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

    def step_of(self, position: int, epoch: int | None = None) -> int:
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
    def position(self) -> int:
        """Micro-batches of the current epoch this rank has handed out (where
        the next iteration starts)."""
        return self._position

    def first_step(self, epoch: int | None = None) -> int:
        """The global index of the epoch's first optimizer step (steps of the
        earlier epochs as they ran, across elastic resumes)."""
        epoch = self.epoch if epoch is None else _check_epoch(int(epoch), self.seed, "epoch")
        if epoch < self._anchor_epoch:
            raise InvalidArgumentError(
                f"first_step: epoch {epoch} ran before the state this sampler resumed from "
                f"(epoch {self._anchor_epoch}); its steps are not known")
        k = epoch - self._anchor_epoch
        if k >= 2 and self.order != "random":
            # Without the random order every epoch after the first one known
            # is packed alike: as many steps each.
            return self.first_step(self._anchor_epoch + 1) + \
                (k - 1) * self._step_count(self._anchor_epoch + 1)
        while k >= len(self._starts):
            e = self._anchor_epoch + len(self._starts) - 1
            self._starts.append(self._starts[-1] + self._step_count(e))
        return self._starts[k]

    def _step_count(self, epoch):
        return len(self.batch_sizes(epoch))

    def epoch_of(self, step: int) -> int:
        """The epoch whose optimizer steps include global step ``step``.
        With the random order, packs the epochs from the first one known
        (0, or the one resumed) up to it, each once, at most
        MAX_EPOCHS_AHEAD of them: a step further ahead is an
        InvalidArgumentError before any packing, as is a step before the
        first one known. Without it, at most two epochs are packed."""
        step = int(step)
        first = self._starts[0]
        if step < first:
            raise InvalidArgumentError(
                f"step {step} is before step {first}, where the sampler resumed (epoch "
                f"{self._anchor_epoch}): its batch size is not known; load the state_dict saved "
                "with this one")
        if self.order != "random":
            steps = self._step_count(self._anchor_epoch)
            if step < first + steps:
                return self._anchor_epoch
            later = self._step_count(self._anchor_epoch + 1)
            epoch = self._anchor_epoch + 1 + (step - first - steps) // later
            if epoch > MAX_EPOCH:
                raise InvalidArgumentError(
                    f"step {step} lies in epoch {epoch} (the epochs after epoch "
                    f"{self._anchor_epoch} have {later} steps each), past the last epoch, "
                    f"{MAX_EPOCH}")
            return epoch
        known = len(self._starts) - 1  # the epochs whose first step is known, after the first
        if step >= self._starts[known]:
            # Before packing: how far ahead the step lies, at the steps of the
            # last epoch whose count is known.
            last = self._anchor_epoch + max(known - 1, 0)
            steps = max(self._starts[known] - self._starts[known - 1] if known else
                        self._step_count(last), 1)
            self._check_ahead(self._anchor_epoch + known + (step - self._starts[known]) // steps,
                              step, f"epoch {last} has {steps} steps")
            k = known
            while self.first_step(self._anchor_epoch + k + 1) <= step:
                k += 1
                if k > MAX_EPOCHS_AHEAD:
                    self._check_ahead(self._anchor_epoch + k, step, "the steps of the epochs "
                                      "before it")
            return self._anchor_epoch + k
        # The last epoch whose first step is <= step.
        return self._anchor_epoch + bisect.bisect_right(self._starts, step, 0, known) - 1

    def _check_ahead(self, epoch, step, why):
        if epoch - self._anchor_epoch > MAX_EPOCHS_AHEAD:
            raise InvalidArgumentError(
                f"step {step} lies in epoch {epoch} or about ({why}), more than "
                f"{MAX_EPOCHS_AHEAD} epochs after epoch {self._anchor_epoch}, the first this "
                "sampler knows: a resume that far ahead loads the sampler's state_dict, saved "
                "with the schedule's, first")
        return epoch

    @property
    def resume_epoch(self) -> int:
        """The first epoch whose steps this sampler knows (0 unless resumed)."""
        return self._anchor_epoch

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch to iterate; with order="random" its packing is
        shuffled with seed + epoch. Keeps the position restored by
        load_state_dict when it is that state's epoch."""
        epoch = _check_epoch(_int(epoch, "set_epoch: epoch", 0, MAX_EPOCH), self.seed,
                             "set_epoch: epoch")
        if epoch != self.epoch:
            self.epoch = epoch
            self._position = 0

    def _microbatches(self):
        plan = self.plan()
        return plan, plan.rank_microbatches[self.rank]

    def __len__(self) -> int:
        return len(self._microbatches()[1])

    def __iter__(self) -> Iterator[list[int] | list[tuple[int, int]]]:
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

    def state_dict(self, consumed: int | None = None,
                   epoch: int | None = None) -> dict[str, Any]:
        """Where this rank stands: epoch and micro-batches handed out in it.
        With DataLoader workers (which fetch ahead) pass ``consumed``, the
        micro-batches the training loop has processed in this epoch, and
        ``epoch``, the epoch the loop is in (the sampler's own may be ahead):
        ``consumed=0, epoch=e + 1`` once epoch e's last step is done."""
        if epoch is None:
            epoch = self.epoch
        else:
            epoch = _check_epoch(_int(epoch, "state_dict: epoch", 0, MAX_EPOCH), self.seed,
                                 "state_dict: epoch")
            if epoch < self._anchor_epoch:
                raise InvalidArgumentError(
                    f"state_dict: epoch {epoch} ran before the state this sampler resumed "
                    f"from (epoch {self._anchor_epoch}); give epoch {self._anchor_epoch} or later")
        if consumed is None and epoch != self.epoch:
            raise InvalidArgumentError(
                f"state_dict: epoch {epoch} is not the sampler's ({self.epoch}): give consumed, "
                "the micro-batches processed in it, too")
        position = self._position if consumed is None else int(consumed)
        if position != 0:  # an epoch's start needs no packing to check
            available = len(self.plan(epoch).rank_microbatches[self.rank])
            if not 0 <= position <= available:
                raise InvalidArgumentError(
                    f"state_dict: consumed {position} is out of range; this rank has "
                    f"{available} micro-batches in epoch {epoch}")
        return {"format": "ductile.DynamicBatchSampler", "version": 2, "epoch": epoch,
                "position": position, "seed": self.seed, "order": self.order, "rank": self.rank,
                "world_size": self.world_size, "samples": len(self.lengths),
                "lengths_sha256": self._fingerprint, "max_tokens": self.max_tokens,
                "effective_batch_size": self.effective_batch_size,
                "first_step": self.first_step(epoch),
                "segments": [list(s) for s in self._segments]
                if epoch == self._anchor_epoch else []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
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
        check_state_keys(state, sorted(_STATE_KEYS[version]), version,
                         "DynamicBatchSampler.state_dict")
        mine = {"seed": self.seed, "order": self.order, "samples": len(self.lengths),
                "max_tokens": self.max_tokens, "lengths_sha256": self._fingerprint}
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise InvalidArgumentError(
                    f"load_state_dict: the state has {key} = {state[key]!r}, this sampler "
                    f"{value!r}: it was saved for other data or another packing")
        samples = len(self.lengths)
        epoch = _state_int(state, "epoch", high=MAX_EPOCH)
        _check_epoch(epoch, self.seed, "load_state_dict: epoch")
        # Bounds before any packing: a micro-batch holds a sample at least,
        # so no epoch has more steps (or micro-batches) than samples.
        position = _state_int(state, "position", high=samples)
        world_size = _state_int(state, "world_size", 1, samples)
        effective = _state_int(state, "effective_batch_size", 1, samples)
        rank = _state_int(state, "rank")
        first_step = _state_int(state, "first_step", high=epoch * samples) \
            if version == 2 else None
        listed = state.get("segments", [])
        if not isinstance(listed, list) or len(listed) > MAX_SEGMENTS:
            raise InvalidArgumentError(
                f"load_state_dict: segments must be a list of at most {MAX_SEGMENTS} "
                f"[effective_batch_size, steps] pairs, got {_shown(listed)}: the state is damaged")
        segments = [tuple(_segment(s)) for s in listed]
        if sum(steps for _, steps in segments) > samples:
            raise InvalidArgumentError(
                f"load_state_dict: the segments ran {sum(steps for _, steps in segments)} steps "
                f"of epoch {epoch}, more than its {samples} samples allow: the state is damaged")
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
        self._layouts, self._starts = {}, [self._anchor_step]
        self.layout_version += 1
        self.epoch = epoch
        if position > len(self):
            raise InvalidArgumentError(
                f"load_state_dict: position {position} is out of range; rank {self.rank} has "
                f"{len(self)} micro-batches in epoch {epoch}")
        self._position = position


def check_state_keys(state, keys, version, writer):
    """InvalidArgumentError unless `state` has exactly `keys` (in the order
    a message names the missing ones), as `writer` of `version` writes it."""
    missing = [key for key in keys if key not in state]
    if missing:
        raise InvalidArgumentError(
            f"load_state_dict: the state lacks {', '.join(missing)}: it is damaged")
    extra = sorted(repr(key) for key in state if key not in keys)
    if extra:
        raise InvalidArgumentError(
            f"load_state_dict: the state has keys a version {version} state does not have: "
            f"{', '.join(extra[:10])}{' ...' if len(extra) > 10 else ''}: it was not written by "
            f"{writer}")


def _step_tokens(plan):
    tokens, _ = plan.microbatch_tokens()
    per_step = np.bincount(plan.microbatch_steps, weights=tokens, minlength=plan.step_count)
    return per_step.astype(np.int64)


def _lengths_fingerprint(lengths):
    return hashlib.sha256(np.ascontiguousarray(lengths, dtype=np.int64).tobytes()).hexdigest()


def _state_int(state, key, low=0, high=None):
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low or (
            high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise InvalidArgumentError(
            f"load_state_dict: {key} = {_shown(value)} must be an integer {bound}: the state is "
            "damaged or of other data")
    return int(value)


def _check_epoch(epoch, seed, what):
    """`epoch` when a sampler can iterate it: 0..MAX_EPOCH, and seed + epoch
    (the random order's seed) a 64-bit integer."""
    if not 0 <= epoch <= MAX_EPOCH:
        raise InvalidArgumentError(f"{what} = {_shown(epoch)} is out of range; an epoch is "
                                   f"between 0 and {MAX_EPOCH}")
    if seed + epoch > 2**63 - 1:
        raise InvalidArgumentError(
            f"{what} = {epoch} with seed = {seed}: the random order's seed, seed + epoch, "
            "exceeds 2^63 - 1; use a smaller seed")
    return epoch


def _segment(value):
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or value[0] < 1 or value[1] < 0):
        raise InvalidArgumentError(
            f"load_state_dict: segment {value!r} must be [effective_batch_size >= 1, "
            "steps >= 0]: the state is damaged")
    return int(value[0]), int(value[1])
