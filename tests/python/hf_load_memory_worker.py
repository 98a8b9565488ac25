"""One rank of test_hf_load_memory.py (not a test by itself): loads a saved
model with AutoModelForCausalLM.from_pretrained under a ZeRO-3 DeepSpeed
config, as a fine-tuning script does once TrainingArguments exist, and
writes the growth of its peak resident memory over the load.

  torchrun --nproc-per-node 2 hf_load_memory_worker.py MODEL OUT ds.json ductile|plain

"ductile": the script imports ductile.hf first (its one line), so the model
is partitioned by ductile's zero.Init and loaded slice by slice. "plain":
the control, one process without ZeRO-3: the same model made whole from
its config (a plain from_pretrained may leave the weights in the file's
mapping, which the measure would not see as the process's own).
"""

import json
import os
import sys

import torch


from hf_clm_script import end_rank  # the ranks' end (hf_clm_script.py says why)


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak():
    """Sets the peak resident memory (VmHWM) to the current one, so that a
    peak reached while importing does not hide the load's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main():
    model_dir, out, config, mode = sys.argv[1:5]
    if mode == "ductile":
        import ductile.hf  # noqa: F401  (the script's one changed line)
    from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments
    if mode == "ductile":
        args = TrainingArguments(output_dir=os.path.join(out, "args"), deepspeed=config,
                                 use_cpu=True, ddp_backend="gloo", report_to=[])
        rank = args.process_index
    else:
        rank = 0
    torch.set_num_threads(1)
    reset_peak()
    before = status_bytes("VmRSS")
    if mode == "ductile":
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    grown = status_bytes("VmHWM") - before
    if mode == "ductile":
        from ductile.torch.zero3._param import shard_of
        sliced = [shard_of(p) for p in model.parameters()]
        assert all(s is not None for s in sliced), "a parameter was left whole"
        kept = sum(s.values.numel() * s.values.element_size() for s in sliced)
    else:
        kept = sum(p.numel() * p.element_size() for p in model.parameters())
    with open(os.path.join(out, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump({"grown": grown, "kept": kept}, f)
    end_rank()


if __name__ == "__main__":
    main()
