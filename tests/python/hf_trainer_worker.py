"""One rank of test_hf.py's Trainer run (not a test by itself): a tiny Llama
trained for 2 epochs by ductile.hf.DuctileTrainer under torchrun (gloo, CPU).
Writes OUT/rank<r>.json: the (epoch, sample) pairs this rank fetched and the
learning rate of every optimizer step.

  torchrun --nproc_per_node 2 hf_trainer_worker.py OUT
"""

import json
import os
import random
import sys

import torch
from hf_models import VOCAB, tiny_model
from transformers import TrainerCallback, TrainingArguments

from ductile.hf import DuctileTrainer

def counting_samples(seed, count, longest):
    """Learnable sequences: a + k * d (mod VOCAB), d in 1..3."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, d, n = rng.randrange(VOCAB), rng.randint(1, 3), rng.randint(2, longest)
        out.append([(a + k * d) % VOCAB for k in range(n)])
    return out


SAMPLES = counting_samples(21, count=240, longest=40)
SETTINGS = dict(max_tokens=96, gradient_accumulation_steps=2, seed=5, learning_rate=1e-2,
                warmup_steps=2, lr_rule="sqrt", base_batch_size=8)


class Recorded(torch.utils.data.Dataset):
    def __init__(self):
        self.seen = []
        self.epoch = None

    def __len__(self):
        return len(SAMPLES)

    def __getitem__(self, i):
        self.seen.append([self.epoch(), i])
        return {"input_ids": torch.tensor(SAMPLES[i])}


class StepRates(TrainerCallback):
    """The rate each optimizer step ran with (before the scheduler steps)."""

    def __init__(self):
        self.lrs = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


class StopAt(TrainerCallback):
    """Saves a checkpoint at step `step` and ends the run there, as a job
    that is killed right after a save."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True


def main():
    out = sys.argv[1]
    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"), use_cpu=True, ddp_backend="gloo",
        num_train_epochs=2, learning_rate=SETTINGS["learning_rate"],
        lr_scheduler_type="linear", warmup_steps=SETTINGS["warmup_steps"],
        gradient_accumulation_steps=SETTINGS["gradient_accumulation_steps"],
        seed=SETTINGS["seed"], logging_steps=1, save_strategy="no", report_to=[],
        disable_tqdm=True)
    dataset = Recorded()
    rates = StepRates()
    trainer = DuctileTrainer(model=tiny_model("llama", "sdpa"), args=args,
                             train_dataset=dataset, callbacks=[rates],
                             lengths=[len(s) for s in SAMPLES],
                             max_tokens=SETTINGS["max_tokens"], lr_rule=SETTINGS["lr_rule"],
                             base_batch_size=SETTINGS["base_batch_size"])
    dataset.epoch = lambda: trainer.ductile_sampler.epoch
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    with open(os.path.join(out, f"rank{args.process_index}.json"), "w") as f:
        json.dump({"seen": dataset.seen, "lrs": rates.lrs, "steps": trainer.state.global_step,
                   "max_steps": trainer.state.max_steps,
                   "losses": losses, "world_size": args.world_size}, f)


def exit_rank():
    """Ends a Trainer rank once its results are written and closed: the
    ranks meet, the process group goes, and the interpreter's finalisation
    is skipped. The Trainer's DDP wrapper keeps the gloo group alive after
    destroy_process_group; a gloo thread that drops a finished collective's
    tensors while the interpreter finalises needs the GIL, cannot have it,
    and aborts the rank ("terminate called without an active exception": 2
    runs in 6 under load; torch's own issue, pytorch/pytorch#190489)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_rank()
