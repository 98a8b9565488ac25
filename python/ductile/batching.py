"""Variable-batch packing: sample lengths in, micro-batches, steps, ranks and
learning rates out (DeepSpeed's ``batch_by_seqlens`` + ``scale_lr``, done by
ductile's batching and lr plugins in C++).

    plan = ductile.batching.pack(lengths, max_tokens=4096, effective_batch_size=8,
                                 ranks=2, lr_rule="sqrt", base_batch_size=64,
                                 base_lr=3e-4, schedule="warmup_linear",
                                 warmup_steps=100, total_steps=10000)
    plan.microbatch(0)          # sample ids of micro-batch 0 (numpy view)
    plan.lrs[step]              # learning rate of a step
    ductile.batching.plot(plan, "plan.png")

``lengths`` is a 1-D int64 buffer (numpy array, array.array('q'),
memoryview, a CPU torch tensor): read in place, never copied. Lists are
converted once.
"""

import dataclasses
import io
import json
import os
from typing import Any

import numpy as np

from . import _ductile
from ._config import load_config
from ._errors import InvalidArgumentError, IoError

__all__ = ["pack", "PackPlan", "read_lengths", "plot", "LrRule", "LrSchedule",
           "settings_from_config"]

LrRule = _ductile.batching.LrRule
LrSchedule = _ductile.batching.LrSchedule


def read_lengths(file, *, format="auto", column="", count_column=""):
    """Per-sample lengths from a file, as ``ductile pack --lengths`` reads
    them: text (one a line), CSV (``column``; ``count_column`` for a
    histogram), .npy, or DeepSpeed's MMIDIDX metric (PREFIX, PREFIX.bin or
    PREFIX.idx; ``format="mmidx"``). Returns an int64 numpy array. Raises
    NotFoundError, IoError (corrupt file), InvalidArgumentError (bad value),
    each naming the file and position."""
    return _ductile.batching.read_lengths(os.fspath(file), format, column, count_column)


def _as_int64_buffer(values):
    """A buffer the C++ side can read in place; lists and torch tensors are
    converted (tensors without copying when on the CPU)."""
    if values is None:
        return None
    module = type(values).__module__
    if module.startswith("torch"):
        values = values.detach().cpu().numpy()
    try:
        memoryview(values)
        return values
    except TypeError:
        pass
    array = np.asarray(values)
    if array.dtype.kind in "iu" or array.size == 0:
        return np.ascontiguousarray(array, dtype=np.int64)
    return array  # the C++ side reports the dtype


@dataclasses.dataclass
class PackPlan:
    """The result of :func:`pack` (pipeline::PackPlan; arrays are numpy, int64
    unless noted, owned by the plan).

    Micro-batch ``i`` holds ``sample_ids[microbatch_offsets[i]:microbatch_offsets[i+1]]``
    and belongs to step ``microbatch_steps[i]``. Per step: ``batch_sizes``
    (samples), ``batch_max_seqlens`` (longest sample), ``lrs`` (float64, when
    a rule was given, else None). With ``ranks``: ``microbatch_ranks[i]``
    (= i % ranks, its owner) and ``rank_microbatches[r]`` (the micro-batches
    rank ``r`` processes, in order: DistributedSampler's assignment, padded
    by repeating from the start when the count is not a multiple of ranks).
    ``dropped_ids``: longer than max_tokens; ``leftover_ids``: fit but not
    packed (trimmed to whole steps). ``options``: the sampler's effective
    settings; ``stats``: tokens, padded tokens, efficiencies, seconds.
    """

    sample_ids: np.ndarray
    microbatch_offsets: np.ndarray
    microbatch_steps: np.ndarray
    microbatch_ranks: np.ndarray
    rank_microbatches: list
    batch_sizes: np.ndarray
    batch_max_seqlens: np.ndarray
    lrs: "np.ndarray | None"
    dropped_ids: np.ndarray
    leftover_ids: np.ndarray
    options: dict
    stats: dict
    lengths: np.ndarray = dataclasses.field(repr=False)
    # The C++ plan the arrays are views of (its to_json writes the CLI's format).
    _plan: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def microbatch_count(self):
        return len(self.microbatch_steps)

    @property
    def step_count(self):
        return len(self.batch_sizes)

    def microbatch(self, i):
        return self.sample_ids[self.microbatch_offsets[i]:self.microbatch_offsets[i + 1]]

    def microbatches(self):
        return [self.microbatch(i) for i in range(self.microbatch_count)]

    def microbatch_tokens(self):
        """Per micro-batch: (tokens, padded tokens = samples x longest)."""
        lengths = np.asarray(self.lengths, dtype=np.int64)
        sizes = np.diff(self.microbatch_offsets)
        if len(sizes) == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        per_sample = lengths[self.sample_ids]
        starts = self.microbatch_offsets[:-1]
        tokens = np.add.reduceat(per_sample, starts)
        longest = np.maximum.reduceat(per_sample, starts)
        return np.where(sizes > 0, tokens, 0), np.where(sizes > 0, longest * sizes, 0)

    def step_padding_share(self):
        """Per step: the share of positions that are padding when every
        micro-batch is padded to its longest sample (PadCollate), float64 in
        [0, 1). Flattened micro-batches (FlattenCollate) have none."""
        tokens, padded = self.microbatch_tokens()
        steps = self.step_count
        real = np.bincount(self.microbatch_steps, weights=tokens, minlength=steps)
        positions = np.bincount(self.microbatch_steps, weights=padded, minlength=steps)
        return np.divide(positions - real, positions, out=np.zeros(steps), where=positions > 0)

    def to_json(self):
        """The fields of ``ductile pack --json`` (without stats), written by the
        same C++ function as the CLI's."""
        return json.loads(self._plan.to_json(with_stats=False))


def pack(lengths, *, max_tokens=None, sampler="greedy", order=None, seed=None,
         min_batch_size=None, max_batch_size=None, effective_batch_size=None,
         same_size_microbatches=None, budget=None, params=None, ranks=0, lr_rule=None,
         lr_params=None, base_lr=None, base_batch_size=None, schedule=None,
         warmup_steps=None, total_steps=None, min_lr=None, runtime=None, plugin_path=None):
    """Packs ``lengths`` into micro-batches and steps, assigns ranks and
    computes each step's learning rate: ``pipeline::pack_plan``, every option
    of ``ductile pack``.

    Sampler (options left None keep the sampler's defaults, so a custom
    sampler sees only keys it declares): ``sampler`` ("greedy", DeepSpeed's;
    "bfd"; any batching plugin), ``max_tokens`` (budget of a micro-batch),
    ``order`` ("dataloader", "seqlen", "random"), ``seed``,
    ``min_batch_size``, ``max_batch_size`` (0: none), ``effective_batch_size``
    (micro-batches per step, across all ranks), ``same_size_microbatches``
    (pipeline parallelism), ``budget`` ("sum" or "padded"); ``params``: any
    other parameter of the sampler's schema.
    ``ranks``: assign micro-batches to this many data-parallel ranks (0: no).
    Learning rate (when ``lr_rule`` is given: "linear", "sqrt", "none" or any
    lr plugin, with ``lr_params``): ``base_lr`` tuned for ``base_batch_size``
    samples, base ``schedule`` ("constant", "warmup_linear", "warmup_cosine")
    with ``warmup_steps``, ``total_steps``, ``min_lr``.
    ``runtime`` (a ductile.Runtime) or ``plugin_path``: where plugins are found.

    Raises InvalidArgumentError (bad array, length <= 0, bad option: named
    as the keyword argument), ConfigError (a parameter the plugin's schema
    rejects), NotFoundError (unknown sampler or rule), NotEnoughSamplesError.
    """
    lengths = _as_int64_buffer(lengths)
    options = dict(sampler=sampler, max_tokens=max_tokens, order=order, seed=seed,
                   min_batch_size=min_batch_size, max_batch_size=max_batch_size,
                   effective_batch_size=effective_batch_size,
                   same_size_microbatches=same_size_microbatches, budget=budget, params=params,
                   ranks=ranks, lr_rule=lr_rule, lr_params=lr_params,
                   base_batch_size=base_batch_size, schedule=schedule, base_lr=base_lr,
                   min_lr=min_lr, warmup_steps=warmup_steps, total_steps=total_steps)
    out = _ductile.batching.pack(lengths, options, runtime, plugin_path)
    offsets = out.pop("rank_offsets")
    flat = out.pop("rank_microbatches")
    out["rank_microbatches"] = [flat[offsets[r]:offsets[r + 1]] for r in range(len(offsets) - 1)]
    return PackPlan(lengths=np.asarray(lengths), _plan=out.pop("plan"), **out)


def settings_from_config(config, *, plugin_path=None, allow_config_plugins=False):
    """The packing and learning-rate settings of a configuration, exactly as
    ``ductile pack --config`` reads them: a ductile TOML ([batching] and [lr]
    sections) or a DeepSpeed config (data_efficiency.data_sampling.
    dynamic_batching, train_batch_size, optimizer, scheduler).

    Returns ``(pack_kwargs, lengths)``: keyword arguments of :func:`pack`, and
    the keyword arguments of :func:`read_lengths` for the lengths file the
    config names (DeepSpeed: ``{metrics_path}/seqlen/seqlen_sample_to_metric``)
    or None. ``allow_config_plugins``: see ductile.load_config."""
    config = load_config(config, plugin_path=plugin_path,
                         allow_config_plugins=allow_config_plugins)
    if config.format == "deepspeed":
        kwargs, lengths = _ductile.batching.settings_from_deepspeed(
            config.deepspeed, config.origin, config.base_dir, config.runtime)
    else:
        kwargs, lengths = _ductile.batching.settings_from_config(config.runtime)
    kwargs["runtime"] = config.runtime
    return kwargs, lengths


# The figure draws a bar or a point per step shown and a bar per micro-batch
# of those steps: both bounded, so that its time and memory do not grow with
# the plan (the histogram bins every micro-batch in numpy).
MAX_PLOT_STEPS = 1000
MAX_PLOT_MICROBATCHES = 4000


def plot(plan, path, *, title=None, max_steps=60):
    """Draws the plan, as the illustrations of DeepSpeed's variable-batch PR:
    per step the batch size, tokens and padding of each micro-batch (stacked
    bars, one column per micro-batch) and the learning rate; then what one
    looks at when tuning the budget: the padding share of each step when
    micro-batches are padded (PadCollate; flattened ones, FlattenCollate, have
    none), and a histogram of positions per micro-batch, padded against
    flattened. Writes ``path`` (any format matplotlib writes, by its
    extension: .png, .svg, .pdf; none: .png). Shows the first ``max_steps``
    steps (an int from 1 to MAX_PLOT_STEPS; the plan's length when shorter)
    and at most MAX_PLOT_MICROBATCHES micro-batches of them (the histogram:
    all). matplotlib is imported here only.
    Raises InvalidArgumentError (a bad argument, named), IoError (``path``
    could not be written, named)."""
    if not isinstance(plan, PackPlan):
        raise InvalidArgumentError(
            f"plot: plan is a {type(plan).__name__}; valid: a PackPlan (ductile.batching.pack)")
    steps = min(plan.step_count,
                _ductile.int_argument(max_steps, "plot: max_steps", 1, MAX_PLOT_STEPS))
    if steps == 0:
        raise InvalidArgumentError("plot: the plan has no steps")
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"plot: path is a {type(path).__name__}; valid: a str or an os.PathLike")
    path = os.fspath(path)
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase

    image_format = os.path.splitext(path)[1][1:].lower() or "png"
    formats = FigureCanvasBase.get_supported_filetypes()
    if image_format not in formats:
        raise InvalidArgumentError(
            f"plot: path {path!r} names the format {image_format!r}; valid: a path ending in "
            + ", ".join(f".{name}" for name in sorted(formats)))
    fig = _draw(plan, steps, title, plt)
    try:
        # Into memory first: a failed write is then the file's own, seen
        # below, never lost in a backend's buffered stream.
        image = io.BytesIO()
        fig.savefig(image, format=image_format, dpi=100)
    finally:
        plt.close(fig)
    try:
        with open(path, "wb") as out:
            out.write(image.getbuffer())
    except OSError as e:
        raise IoError(f"plot: cannot write {path!r}: {e.strerror or e}") from e
    return path


def _draw(plan, steps, title, plt):
    tokens, padded = plan.microbatch_tokens()
    mb = np.flatnonzero(plan.microbatch_steps < steps)[:MAX_PLOT_MICROBATCHES]
    x = np.arange(len(mb))
    step_of = plan.microbatch_steps[mb]
    rows = 4 if plan.lrs is not None else 3
    fig = plt.figure(figsize=(11, 2.6 * rows))
    grid = fig.add_gridspec(rows, 2)
    ax = fig.add_subplot(grid[0, :])
    ax.bar(x, tokens[mb], color="tab:blue", label="tokens")
    ax.bar(x, padded[mb] - tokens[mb], bottom=tokens[mb], color="tab:orange",
           label="padding (to the micro-batch's longest)")
    ax.axhline(plan.options["max_tokens"], color="k", lw=0.8, ls="--", label="max_tokens")
    boundaries = np.flatnonzero(np.diff(step_of)) + 0.5
    for b in boundaries:
        ax.axvline(b, color="grey", lw=0.5)
    shown = "" if len(mb) == np.count_nonzero(plan.microbatch_steps < steps) else \
        f"; the first {len(mb)}"
    ax.set_xlabel(f"micro-batch (grey lines separate steps{shown})")
    ax.set_ylabel("tokens")
    ax.legend(loc="upper right", fontsize=8)
    ax = fig.add_subplot(grid[1, :])
    ax.bar(np.arange(steps), plan.batch_sizes[:steps], color="tab:green")
    ax.set_ylabel("batch size (samples)")
    ax.set_xlabel("step")
    if plan.lrs is not None:
        ax = fig.add_subplot(grid[2, :])
        ax.plot(np.arange(steps), plan.lrs[:steps], marker=".", color="tab:red")
        ax.set_ylabel("learning rate")
        ax.set_xlabel("step")
    _plot_padding(fig.add_subplot(grid[rows - 1, 0]), plan, steps)
    _plot_positions(fig.add_subplot(grid[rows - 1, 1]), plan, tokens, padded)
    fig.suptitle(title or (f"{plan.options['order']} order, max_tokens "
                           f"{plan.options['max_tokens']}, "
                           f"{plan.options['effective_batch_size']} micro-batches per step"))
    fig.tight_layout()
    return fig


def _plot_padding(ax, plan, steps):
    share = 100 * plan.step_padding_share()[:steps]
    ax.plot(np.arange(steps), share, marker=".", color="tab:orange", label="padded (PadCollate)")
    ax.plot(np.arange(steps), np.zeros(steps), color="tab:blue", label="flattened")
    ax.set_ylim(0, 100)
    ax.set_xlabel("step")
    ax.set_ylabel("padding share (%)")
    ax.legend(loc="center right", fontsize=8)


def _plot_positions(ax, plan, tokens, padded):
    budget = plan.options["max_tokens"]
    bins = np.linspace(0, max(budget, int(padded.max(initial=0))), 41)
    ax.hist(padded, bins=bins, color="tab:orange", alpha=0.6, label="padded: samples x longest")
    ax.hist(tokens, bins=bins, color="tab:blue", alpha=0.6, label="flattened: tokens")
    ax.axvline(budget, color="k", lw=0.8, ls="--", label="max_tokens")
    ax.set_xlabel("positions a micro-batch (all steps)")
    ax.set_ylabel("micro-batches")
    ax.legend(loc="upper left", fontsize=8)
