"""A ZeRO-3 checkpoint's whole fp32 weights as Hugging Face files, with
DeepSpeed's ``zero_to_fp32.py`` command line:

    python -m ductile.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--tag TAG]
        [--safe_serialization] [--max_shard_size 5GB] [--exclude_frozen_parameters]

also as ``ductile zero-to-fp32 ...``, and as the ``zero_to_fp32.py`` that
``save_checkpoint`` leaves in each checkpoint folder (a Trainer's
``checkpoint-N``). One process, no torch.distributed, any world size the
checkpoint was saved at. Exit status 0, or 2 with a message naming the
argument or file for a user's error. docs/deepspeed.md, "Taking the model
away".
"""

import argparse
import os
import sys

from ._errors import Error
from .torch.zero3._consolidate import convert

SCRIPT_NAME = "zero_to_fp32.py"

# What save_checkpoint writes into a checkpoint folder.
SCRIPT = '''#!/usr/bin/env python
"""This checkpoint's whole fp32 weights as files that from_pretrained loads,
written by ductile's ZeRO-3 (it needs the ductile package):

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--tag TAG] [--safe_serialization]
        [--max_shard_size 5GB] [--exclude_frozen_parameters]
"""
import sys

from ductile.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
'''


def write_script(folder: str) -> None:
    """Leaves SCRIPT in `folder` as zero_to_fp32.py (atomically, executable),
    as DeepSpeed leaves its own in each checkpoint folder."""
    path = os.path.join(folder, SCRIPT_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            if f.read(len(SCRIPT) + 1) == SCRIPT:
                return
    except OSError:
        pass
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(SCRIPT)
    os.chmod(partial, 0o755)
    os.replace(partial, path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zero_to_fp32",
        description="Write a ZeRO-3 checkpoint's whole fp32 weights as Hugging Face files "
                    "(model.safetensors or pytorch_model.bin) that from_pretrained loads.")
    p.add_argument("checkpoint_dir",
                   help="the folder save_checkpoint wrote (with 'latest'), e.g. "
                        "output/checkpoint-12")
    p.add_argument("output_dir", help="the folder to write the weights into (made if need be)")
    p.add_argument("--max_shard_size", default="5GB",
                   help="the largest weight file before the weights are split over several, "
                        "with an index (default 5GB)")
    p.add_argument("--safe_serialization", action="store_true",
                   help="write safetensors (model*.safetensors) instead of pytorch_model*.bin")
    p.add_argument("-t", "--tag", default=None,
                   help="the save to convert (a folder of checkpoint_dir, e.g. global_step12; "
                        "default: the one 'latest' names)")
    p.add_argument("--exclude_frozen_parameters", action="store_true",
                   help="leave out parameters the optimizer keeps no state for")
    p.add_argument("-d", "--debug", action="store_true", help="list each file written")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        written = convert(args.checkpoint_dir, args.output_dir, tag=args.tag,
                          safe_serialization=args.safe_serialization,
                          max_shard_size=args.max_shard_size,
                          exclude_frozen_parameters=args.exclude_frozen_parameters)
    except Error as error:
        print(f"zero_to_fp32: error: {error}", file=sys.stderr)
        return 2
    weights = [w for w in written if not w.endswith(".json")]
    print(f"zero_to_fp32: wrote the fp32 weights of {args.checkpoint_dir} into "
          f"{args.output_dir} ({len(weights)} file{'s' if len(weights) != 1 else ''})")
    if args.debug:
        for path in written:
            print(f"  {path} ({os.path.getsize(path)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
