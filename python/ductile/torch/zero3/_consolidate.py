"""A ZeRO-3 checkpoint's whole fp32 weights, offline: read from its rank
files at whatever world size they were written, in one process without
torch.distributed, and written as Hugging Face weight files that
``from_pretrained`` loads (``ductile zero-to-fp32``, the ``zero_to_fp32.py``
of each checkpoint folder: docs/deepspeed.md, "Taking the model away").

A parameter's whole value is its optimizer shard (the fp32 master under
mixed precision) of every old rank, back to back: rank q holds elements
[q x shard_numel, (q + 1) x shard_numel) of the flattened parameter.
"""

import json
import os
import re
import shutil

import torch

from ..._errors import InvalidArgumentError, IoError
from ._checkpoint_files import (RankFiles, checkpoint_key, read_manifest, resolve, shard_layout,
                                tag_problem)
from ._param import _plan_files

# A size as transformers' save_pretrained and DeepSpeed's script take it:
# "5GB" (powers of 1000), "5GiB" (powers of 1024), or bytes.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size such as "5GB", "500MiB" or 1000000; InvalidArgumentError
    naming the value otherwise."""
    if isinstance(text, int) and text > 0:
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise InvalidArgumentError(
            f"--max_shard_size {text!r} is not a size; valid: a positive number of bytes, or "
            "with a unit (KB, MB, GB, TB as powers of 1000, KiB, MiB, GiB, TiB of 1024), "
            "e.g. 5GB")
    return int(float(match.group(1)) * _UNITS[unit])


def checkpoint_folder(checkpoint_dir: str, tag: str | None = None) -> str:
    """The folder of the save to convert: checkpoint_dir/tag, else the one
    checkpoint_dir/latest names, else checkpoint_dir itself when it holds a
    save's manifest."""
    if not os.path.isdir(checkpoint_dir):
        raise IoError(f"checkpoint_dir '{checkpoint_dir}' is not a folder; valid: the folder "
                      "save_checkpoint wrote (with 'latest'), or one of its tag folders")
    if tag is not None:
        problem = tag_problem(tag)
        folder = os.path.join(checkpoint_dir, tag)
        if problem is not None or not os.path.isdir(folder):
            tags = sorted(t for t in os.listdir(checkpoint_dir)
                          if os.path.isdir(os.path.join(checkpoint_dir, t))
                          and tag_problem(t) is None)
            raise InvalidArgumentError(
                f"--tag {tag!r}: no such save in '{checkpoint_dir}'"
                + (f" ({problem})" if problem else "")
                + f"; valid: {', '.join(tags) if tags else 'none (the folder has no save)'}")
        return folder
    return checkpoint_dir


class Consolidated:
    """The whole fp32 parameters of one save, read one at a time."""

    def __init__(self, checkpoint_dir: str, tag: str | None = None) -> None:
        key, self.variable = checkpoint_key()
        self.source = resolve(checkpoint_folder(checkpoint_dir, tag))
        self.path, self.manifest = read_manifest(self.source, key, self.variable)
        self.parameters = self.manifest["parameters"]
        self.offsets, self.layout = shard_layout(self.parameters, self.path)
        self.world = int(self.manifest["world_size"])
        # A save before the first step has no optimizer state for any
        # parameter, and none is frozen then.
        self.stepped = any(p["state"] for p in self.parameters)

    def frozen(self, meta: dict) -> bool:
        """A parameter the optimizer keeps no state for: not trained."""
        return self.stepped and not meta["state"]

    def nbytes(self, index: int) -> int:
        """Bytes of parameter `index`'s whole value."""
        return int(self.parameters[index]["numel"]) * self.offsets[index][1][0][1].itemsize

    def read(self, files: RankFiles, index: int) -> torch.Tensor:
        """Parameter `index`'s whole value (new memory, its saved shape)."""
        meta = self.parameters[index]
        shard, entry = self.offsets[index]
        _, dtype, base = entry[0]  # the parameter itself, before its state
        numel = int(meta["numel"])
        out = torch.empty(numel, dtype=dtype)
        raw = memoryview(out.view(torch.uint8).numpy())
        size = dtype.itemsize
        for q in range(self.world):
            lo, hi = q * shard, min((q + 1) * shard, numel)
            if lo >= hi:
                break
            f, start = files.get(q)
            f.seek(start + base)
            want = (hi - lo) * size
            if f.readinto(raw[lo * size:hi * size]) != want:
                raise IoError(f"{f.name}: short read of parameter '{meta['name']}'")
        return out.view(meta["shape"])


def convert(checkpoint_dir: str, output_dir: str, tag: str | None = None,
            safe_serialization: bool = False, max_shard_size: str | int = "5GB",
            exclude_frozen_parameters: bool = False) -> list[str]:
    """Writes the save's whole fp32 weights into `output_dir` as DeepSpeed's
    zero_to_fp32.py names them: model.safetensors (safe_serialization) or
    pytorch_model.bin, split past `max_shard_size` into
    model-0000k-of-0000n files with an index. The checkpoint folder's
    config.json, when it has one (a Trainer checkpoint), is copied beside
    them, so ``from_pretrained(output_dir)`` loads it. Holds at most one
    output file's tensors. Returns the files written."""
    limit = parse_size(max_shard_size)
    saved = Consolidated(checkpoint_dir, tag)
    chosen = [i for i, meta in enumerate(saved.parameters)
              if not (exclude_frozen_parameters and saved.frozen(meta))]
    nbytes = {i: saved.nbytes(i) for i in chosen}
    plan = _plan_files([(i, nbytes[i]) for i in chosen], limit)
    stem, ext = ("model", ".safetensors") if safe_serialization else ("pytorch_model", ".bin")
    names = [stem + ext] if len(plan) == 1 else [
        f"{stem}-{k + 1:05d}-of-{len(plan):05d}{ext}" for k in range(len(plan))]
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise IoError(f"output_dir '{output_dir}': cannot create it: {e.strerror}") from e
    files = RankFiles(saved.source, saved.path, saved.manifest, saved.layout,
                      signed_by=saved.variable)
    written = []
    try:
        for name, indices in zip(names, plan):
            tensors = {saved.parameters[i]["name"]: saved.read(files, i) for i in indices}
            target = os.path.join(output_dir, name)
            _write(tensors, target, safe_serialization)
            written.append(target)
            del tensors
    finally:
        files.close()
    if len(plan) > 1:
        index = {"metadata": {"total_size": sum(nbytes.values())},
                 "weight_map": {saved.parameters[i]["name"]: name
                                for name, indices in zip(names, plan) for i in indices}}
        target = os.path.join(output_dir, f"{stem}{ext}.index.json")
        _atomic_text(target, json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(target)
    config = os.path.join(checkpoint_dir, "config.json")
    if os.path.isfile(config) and os.path.realpath(checkpoint_dir) != os.path.realpath(
            output_dir):
        shutil.copyfile(config, os.path.join(output_dir, "config.json"))
        written.append(os.path.join(output_dir, "config.json"))
    return written


def _write(tensors, target, safe_serialization):
    partial = target + ".partial"
    try:
        if safe_serialization:
            from safetensors.torch import save_file
            save_file(tensors, partial, metadata={"format": "pt"})
        else:
            torch.save(tensors, partial)
        os.replace(partial, target)
    except OSError as e:
        raise IoError(f"{target}: cannot write: {e.strerror}") from e


def _atomic_text(target, text):
    try:
        with open(target + ".partial", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(target + ".partial", target)
    except OSError as e:
        raise IoError(f"{target}: cannot write: {e.strerror}") from e
