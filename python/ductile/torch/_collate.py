"""Collation of a micro-batch of ``DynamicBatchSampler``: padded to its
longest sample (:class:`PadCollate`), or flattened into one row with no
padding at all (:class:`FlattenCollate`)."""

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from .._errors import InvalidArgumentError
from ..metrics import MapDataset


def _pad_stack(tensors, pad_value, pad_to=None):
    longest = max(t.shape[0] for t in tensors) if tensors else 0
    if pad_to is not None:
        longest = max(longest, int(pad_to))
    out = tensors[0].new_full((len(tensors), longest) + tuple(tensors[0].shape[1:]), pad_value)
    for i, t in enumerate(tensors):
        out[i, :t.shape[0]] = t
    return out


class PadCollate:
    """Collates a micro-batch, padding to its longest sample (dimension 0 of
    each sample) with ``pad_value``.

    Samples that are tensors (or sequences of numbers) give ``(padded,
    lengths)``: a ``[batch, longest, ...]`` tensor and the int64 lengths.
    Samples that are dicts give a dict with each tensor field padded the same
    way plus ``"lengths"`` (of the first field, or ``length_key``).
    """

    def __init__(self, pad_value: float = 0, length_key: str | None = None) -> None:
        self.pad_value = pad_value
        self.length_key = length_key

    def __call__(self, samples: Sequence[Any]
                 ) -> tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]:
        if not samples:
            raise InvalidArgumentError("PadCollate: an empty micro-batch")
        first = samples[0]
        if isinstance(first, dict):
            out = {}
            for key in first:
                values = [s[key] for s in samples]
                if torch.is_tensor(values[0]) and values[0].dim() > 0:
                    out[key] = _pad_stack(values, self.pad_value)
                else:
                    out[key] = torch.as_tensor(values)
            key = self.length_key or next(k for k in first if torch.is_tensor(first[k]))
            out["lengths"] = torch.tensor([s[key].shape[0] for s in samples], dtype=torch.int64)
            return out
        tensors = [s if torch.is_tensor(s) else torch.as_tensor(s) for s in samples]
        lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
        return _pad_stack(tensors, self.pad_value), lengths


class PaddedSamples(torch.utils.data.Dataset):
    """Wraps a map-style dataset for ``DynamicBatchSampler(pad_to_step_max=True)``:
    index ``(i, length)`` returns ``sample_padding_fn(dataset[i], length)``, so
    every micro-batch of a step has the same sequence length (pipeline
    parallelism, DeepSpeed's required_microbatches_of_same_lengths)."""

    def __init__(self, dataset: MapDataset, sample_padding_fn: Callable[[Any, int], Any]) -> None:
        self.dataset = dataset
        self.sample_padding_fn = sample_padding_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int | tuple[int, int]) -> Any:
        if isinstance(index, tuple):
            i, length = index
            return self.sample_padding_fn(self.dataset[i], length)
        return self.dataset[index]


def _token_ids(value, where):
    """A sample's token ids as a 1-D int64 tensor (from a tensor, a NumPy
    array or a list of ints)."""
    ids = value if torch.is_tensor(value) else torch.as_tensor(value)
    if ids.numel() == 0:
        raise InvalidArgumentError(f"FlattenCollate: {where} has no tokens")
    if ids.dim() != 1:
        raise InvalidArgumentError(
            f"FlattenCollate: {where} has shape {tuple(ids.shape)}; each sample must be one "
            "sequence of token ids (1 dimension)")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InvalidArgumentError(
            f"FlattenCollate: {where} has dtype {ids.dtype}; token ids must be integers")
    return ids.to(torch.int64)


class FlattenCollate:
    """Concatenates the samples of a micro-batch into one row of shape
    ``[1, total_tokens]`` with no padding: the contract of Hugging Face's
    ``DataCollatorWithFlattening`` (same keys, dtypes and values), so a
    ``transformers`` model consumes it unchanged and keeps the samples apart
    through ``position_ids`` (eager and sdpa attention) or the
    ``cu_seq_lens`` keys (flash-attention's varlen kernels).

    Output keys:

    - ``input_ids``: the samples' token ids, concatenated (int64);
    - ``labels``: each sample's ``labels`` (or its ``input_ids``) with
      ``separator_id`` (-100, ignored by the loss) at its first token, so no
      sample is trained to predict the next sample's first token (int64);
    - ``position_ids``: ``position_ids_start, +1, ...`` restarting at every
      sample (int64), unless ``return_position_ids=False``;
    - with ``return_flash_attn_kwargs=True``: ``cu_seq_lens_q`` and
      ``cu_seq_lens_k`` (int32 offsets ``[0, l0, l0 + l1, ...]``) and
      ``max_length_q``/``max_length_k`` (Python ints);
    - with ``return_seq_idx=True``: ``seq_idx``, the sample index of every
      token (int32);
    - with ``block_attention_mask="bidirectional"`` or ``"causal"``:
      ``attention_mask`` of shape ``[1, 1, T, T]`` (``mask_dtype``, float32
      by default), 0 where a token may attend and the dtype's minimum where
      not: within its own sample only (and, for ``"causal"``, not ahead).
      transformers passes a 4-D mask to the attention unchanged (eager adds
      it, sdpa takes it as ``attn_mask``), so models whose mask builder
      ignores ``position_ids`` keep the samples apart too: encoders such as
      BERT (transformers 5.23 builds BERT's mask without ``position_ids``, so
      without this its flattened samples attend to each other). It costs
      ``T * T`` elements a micro-batch, and attention still runs over the
      whole row.

    Run the model with ``use_cache=False`` (or ``config.use_cache = False``):
    transformers 5.23 builds the per-sample attention mask from
    ``position_ids`` only when it is given no cache, and with the configs'
    default ``use_cache=True`` eager and sdpa attention let the samples see
    each other, silently.

    A sample is a dict with ``input_ids`` (and optionally ``labels`` of the
    same length), or the token ids themselves (a 1-D tensor, array or list).
    Errors (an empty micro-batch, an empty or multi-dimensional sample,
    labels of another length, non-integer ids) raise
    ``ductile.InvalidArgumentError`` naming the sample.
    """

    def __init__(self, *, return_position_ids: bool = True, separator_id: int = -100,
                 return_flash_attn_kwargs: bool = False, return_seq_idx: bool = False,
                 position_ids_start: int = 0,
                 block_attention_mask: Literal["bidirectional", "causal"] | None = None,
                 mask_dtype: torch.dtype = torch.float32) -> None:
        if block_attention_mask not in (None, "bidirectional", "causal"):
            raise InvalidArgumentError(
                f"FlattenCollate: block_attention_mask={block_attention_mask!r} is not valid; "
                "use None, 'bidirectional' or 'causal'")
        if not isinstance(mask_dtype, torch.dtype) or not mask_dtype.is_floating_point:
            raise InvalidArgumentError(
                f"FlattenCollate: mask_dtype={mask_dtype!r} is not valid; use a floating-point "
                "torch.dtype (the mask is added to the attention scores)")
        self.block_attention_mask = block_attention_mask
        self.mask_dtype = mask_dtype
        self.return_position_ids = bool(return_position_ids)
        self.separator_id = int(separator_id)
        self.return_flash_attn_kwargs = bool(return_flash_attn_kwargs)
        self.return_seq_idx = bool(return_seq_idx)
        self.position_ids_start = int(position_ids_start)

    def __call__(self, samples: Sequence[Any]) -> dict[str, Any]:
        if len(samples) == 0:
            raise InvalidArgumentError("FlattenCollate: an empty micro-batch")
        ids, labels = [], []
        for i, sample in enumerate(samples):
            if isinstance(sample, dict):
                if "input_ids" not in sample:
                    raise InvalidArgumentError(
                        f"FlattenCollate: sample {i} of the micro-batch has no 'input_ids' "
                        f"(its keys: {', '.join(map(str, sample))})")
                sample_ids = _token_ids(sample["input_ids"], f"sample {i}'s input_ids")
                sample_labels = sample.get("labels")
            else:
                sample_ids, sample_labels = _token_ids(sample, f"sample {i}"), None
            if sample_labels is None:
                sample_labels = sample_ids
            else:
                sample_labels = _token_ids(sample_labels, f"sample {i}'s labels")
                if sample_labels.numel() != sample_ids.numel():
                    raise InvalidArgumentError(
                        f"FlattenCollate: sample {i} has {sample_ids.numel()} input_ids but "
                        f"{sample_labels.numel()} labels; they must be the same length")
            sample_labels = sample_labels.clone()
            sample_labels[0] = self.separator_id
            ids.append(sample_ids)
            labels.append(sample_labels)
        lengths = torch.tensor([t.numel() for t in ids], dtype=torch.int64)
        batch = {"input_ids": torch.cat(ids).unsqueeze(0),
                 "labels": torch.cat(labels).unsqueeze(0)}
        total = int(lengths.sum())
        if self.return_position_ids:
            # Token t of a sample starting at offset o has position t - o.
            starts = torch.cumsum(lengths, 0) - lengths
            positions = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(
                starts, lengths)
            batch["position_ids"] = (positions + self.position_ids_start).unsqueeze(0)
        if self.return_seq_idx:
            batch["seq_idx"] = torch.repeat_interleave(
                torch.arange(len(ids), dtype=torch.int32), lengths).unsqueeze(0)
        if self.return_flash_attn_kwargs:
            offsets = torch.zeros(len(ids) + 1, dtype=torch.int32)
            offsets[1:] = torch.cumsum(lengths, 0)
            batch["cu_seq_lens_q"] = offsets
            batch["cu_seq_lens_k"] = offsets.clone()
            batch["max_length_q"] = batch["max_length_k"] = int(lengths.max())
        if self.block_attention_mask is not None:
            batch["attention_mask"] = self._block_mask(lengths, total)
        return batch

    def _block_mask(self, lengths, total):
        sample = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        allowed = sample.unsqueeze(1) == sample.unsqueeze(0)
        if self.block_attention_mask == "causal":
            allowed = torch.tril(allowed)
        mask = torch.zeros((total, total), dtype=self.mask_dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.mask_dtype).min)
        return mask.view(1, 1, total, total)
