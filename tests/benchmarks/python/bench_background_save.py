"""What a zero3 disk checkpoint costs the training step, written in the
foreground (``engine.save(root)``) and from the step's in-memory snapshot
in the background (``engine.save(root, background=True)``), as under
``ductile agent`` (DUCTILE_SNAPSHOT_DIR in /dev/shm, a snapshot every step).
One rank, GPT-2 of the ZeRO-3 race's size (41.7 M parameters, Adam: 477 MiB
of shards and optimizer state); prints medians of --saves saves of each:
the step with its snapshot, the foreground save, and for a background save
the time save() takes to return and the step after it, which joins the save
before its optimizer update.

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_background_save.py
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    snapshots = tempfile.mkdtemp(prefix="bench-background-save-", dir=SHM)
    checkpoints = tempfile.mkdtemp(prefix="bench-background-save-")
    os.environ.update(DUCTILE_SNAPSHOT_DIR=snapshots, LOCAL_RANK="0")
    try:
        run(args.saves, checkpoints)
    finally:
        shutil.rmtree(snapshots, ignore_errors=True)
        shutil.rmtree(checkpoints, ignore_errors=True)


def run(saves, checkpoints):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import ductile.torch.zero3 as zero3
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=512, n_layer=8, n_head=8, vocab_size=32000,
                                       n_positions=256))
    engine = zero3.initialize(model, lambda shards: torch.optim.Adam(shards, lr=1e-4),
                              '[accelerator]\nbackend = "cpu"\n[zero]\ncoordinator = '
                              '"partitioned"\n')
    ids = torch.randint(0, 32000, (2, 128))

    def step():
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        return time.perf_counter() - start

    def timed(call):
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    for _ in range(3):
        step()
    steps = [step() for _ in range(5)]
    foreground, returns, after = [], [], []
    for i in range(saves):
        foreground.append(timed(lambda: engine.save(os.path.join(checkpoints, f"fg{i}"))))
        step()
        returns.append(timed(lambda: engine.save(os.path.join(checkpoints, f"bg{i}"),
                                                 background=True)))
        after.append(step())
        step()
    med = statistics.median
    print(f"step with its snapshot {med(steps) * 1e3:.0f} ms; a save in the foreground "
          f"{med(foreground) * 1e3:.0f} ms; in the background: save() returns in "
          f"{med(returns) * 1e3:.0f} ms and the step after it takes {med(after) * 1e3:.0f} ms "
          f"({(med(after) - med(steps)) * 1e3:+.0f} ms)")


if __name__ == "__main__":
    main()
