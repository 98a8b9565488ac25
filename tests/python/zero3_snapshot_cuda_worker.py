"""One rank of test_zero3_cuda.py's snapshot test (under torchrun, on one
GPU; not a test by itself).

  zero3_snapshot_cuda_worker.py SPEC.json

Trains the tests' causal LM on cuda with a snapshot of every step written
into DUCTILE_SNAPSHOT_DIR on a thread (snapshot_overlap), the calls that
make the host wait for the GPU replaced by spies that count those made on
the training thread inside step(). Writes out/result.json: the spied calls,
the snapshot mappings' pinning, the snapshots skipped, and for each
committed snapshot whether its shard file is byte for byte the file
write_file writes (the path of saves) from the same header and the tensors'
values at that step, and whether its recorded size and CRC-32C are
write_file's.

SPEC keys: out (folder), zero_config (TOML path), steps, device ("cuda", the
default; "cpu" runs the same over gloo).
"""

import json
import os
import sys
import threading

import torch

from zero3_model import Windows, loss_of, make_model

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)

# Calls that make the host wait for the device (Tensor's: on a cuda tensor).
WAITS = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
         (torch.cuda.Stream, "synchronize"), (torch.Tensor, "item"), (torch.Tensor, "cpu"),
         (torch.Tensor, "tolist"), (torch.Tensor, "__float__")]


def main(spec):
    import torch.distributed as dist

    import ductile.torch.zero3 as zero3
    from ductile.torch.zero3 import _checkpoint, _checkpoint_files, _snapshot_mapping

    device = spec.get("device", "cuda")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    engine = zero3.initialize(make_model(seed=0).to(device),
                              lambda ps: torch.optim.Adam(ps, lr=3e-3), spec["zero_config"])
    engine.snapshot_overlap = True
    root = os.environ["DUCTILE_SNAPSHOT_DIR"]
    in_step, waits = [False], []

    def spy(owner, name):
        original = getattr(owner, name)

        def waited(*args, **kwargs):
            on_host = owner is not torch.Tensor or args[0].is_cuda
            if in_step[0] and on_host and threading.current_thread() is threading.main_thread():
                waits.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)
        setattr(owner, name, waited)

    for owner, name in WAITS:
        spy(owner, name)
    windows = Windows()
    values, checks, pinned = {}, [], set()

    def check(step):
        """The committed snapshot of `step` against write_file's bytes."""
        folder = os.path.join(root, f"step{step}")
        path = os.path.join(folder, "rank0-of-1.bin")
        with open(path, "rb") as f:
            fields = _checkpoint_files.read_header(f, path)[0]
        with open(os.path.join(folder, "manifest.json")) as f:
            shard = json.load(f)["shards"][0]
        expected = os.path.join(spec["out"], f"expected{step}.bin")
        chunks = [_checkpoint_files.header(fields["save_id"], fields["step"], 0, 1)]
        chunks += [_checkpoint_files.raw_bytes(v) for v in values.pop(step)]
        record = _checkpoint_files.write_file(expected, chunks, durable=False)
        with open(path, "rb") as a, open(expected, "rb") as b:
            same = a.read() == b.read()
        checks.append({"step": step, "same_bytes": same,
                       "same_record": [shard["bytes"], shard["crc32c"]] == record})

    for s in range(spec["steps"]):
        x, y = (t.to(device) for t in windows.step(s))
        engine.backward(loss_of(engine(x), y))
        in_step[0] = True
        engine.step()
        in_step[0] = False
        writing = engine._snapshots.writing
        if writing is not None and writing.step == s + 1:
            # Its values, copied on the compute stream after the step.
            values[s + 1] = [t.detach().clone() for t in writing.file.tensors]
        committed = _checkpoint.committed_name(root)
        if committed is not None and int(committed[4:]) in values:
            check(int(committed[4:]))
        pinned.update(m.pinned for m in _snapshot_mapping.MAPPINGS._kept.values())
    engine.wait_for_save()
    check(int(_checkpoint.committed_name(root)[4:]))
    skipped = engine.stats()["snapshots_skipped"]
    engine.close()
    with open(os.path.join(spec["out"], "result.json"), "w") as f:
        json.dump({"waits": waits, "checks": checks, "pinned": sorted(pinned),
                   "skipped": skipped,
                   "mappings_after_close": len(_snapshot_mapping.MAPPINGS._kept)}, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
