"""A causal-LM training loop on Hugging Face Accelerate in the shape of
transformers' examples/pytorch/language-modeling/run_clm_no_trainer.py (not
a test by itself): the Accelerator first, with a DeepSpeed plugin from the
config file; a GPT-2 made by AutoModelForCausalLM.from_config (under ZeRO-3,
partitioned as it is built); a local text tokenized by a tokenizer trained
here; AdamW with run_clm_no_trainer's decay groups and a linear schedule
(or DummyOptim/DummyScheduler when the config names an optimizer and a
scheduler); accelerator.accumulate, backward, clip_grad_norm_; save_state
every --checkpointing_steps steps, load_state on --resume_from_checkpoint;
and save_pretrained of the unwrapped model with get_state_dict at the end.
test_accelerate.py runs it as it is (DeepSpeed's engine) and with its
Accelerator import line alone changed to ductile's.

  torchrun --nproc-per-node 2 accelerate_loop_script.py --train_file T \
      --output_dir O --deepspeed_config ds.json [--resume_from_checkpoint O/step_N]

Rank 0 prints one line {"losses": [...], "steps": [...]}: the loss of each
of its micro-batches, and each optimizer step's number, learning rate and
gradient norm.
"""

import argparse
import json
import math
import os
import sys

import torch
from accelerate.utils import (DeepSpeedPlugin, DummyOptim, DummyScheduler,
                              InitProcessGroupKwargs, set_seed)
from transformers import AutoModelForCausalLM, GPT2Config, default_data_collator, get_scheduler

from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_clm_script import BLOCK_SIZE, Blocks, build_tokenizer, end_rank  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--max_train_steps", type=int, default=12)
    parser.add_argument("--checkpointing_steps", type=int, default=6)
    parser.add_argument("--resume_from_checkpoint", default=None)
    cli = parser.parse_args()
    batch_size, accumulation, learning_rate, weight_decay = 2, 2, 3e-3, 0.01

    # On the CPU, DeepSpeed's engine takes the gloo backend by name (its
    # default would be the GPU's).
    accelerator = Accelerator(
        gradient_accumulation_steps=accumulation,
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cli.deepspeed_config),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    set_seed(42)

    tokenizer = build_tokenizer(cli.train_file)
    with open(cli.train_file, encoding="utf-8") as f:
        ids = tokenizer(f.read())["input_ids"]
    train = Blocks(ids, 160)
    loader = torch.utils.data.DataLoader(train, shuffle=False, batch_size=batch_size,
                                         collate_fn=default_data_collator, drop_last=True)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4,
                        n_positions=BLOCK_SIZE, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    model = AutoModelForCausalLM.from_config(config)

    no_decay = ["bias", "layer_norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n for nd in no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    if "optimizer" in ds_config:
        optimizer = DummyOptim(groups, lr=learning_rate)
    else:
        optimizer = torch.optim.AdamW(groups, lr=learning_rate)
    if "scheduler" in ds_config:
        lr_scheduler = DummyScheduler(optimizer, total_num_steps=cli.max_train_steps,
                                      warmup_num_steps=3)
    else:
        lr_scheduler = get_scheduler("linear", optimizer=optimizer,
                                     num_warmup_steps=3 * accelerator.num_processes,
                                     num_training_steps=cli.max_train_steps
                                     * accelerator.num_processes)
    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader,
                                                                 lr_scheduler)
    steps_per_epoch = math.ceil(len(loader) / accumulation)
    epochs = math.ceil(cli.max_train_steps / steps_per_epoch)

    completed, start_epoch, resume_batches = 0, 0, 0
    if cli.resume_from_checkpoint:
        accelerator.load_state(cli.resume_from_checkpoint)
        done_batches = int(os.path.basename(cli.resume_from_checkpoint.rstrip("/"))
                           .removeprefix("step_")) * accumulation
        start_epoch, resume_batches = divmod(done_batches, len(loader))
        completed = done_batches // accumulation

    losses, steps = [], []
    model.train()
    for epoch in range(start_epoch, epochs):
        active = loader
        if epoch == start_epoch and resume_batches:
            active = accelerator.skip_first_batches(loader, resume_batches)
        for batch in active:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                losses.append(loss.item())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed += 1
                steps.append({"step": completed, "lr": lr_scheduler.get_last_lr()[0],
                              "grad_norm": None if norm is None else float(norm)})
                if completed % cli.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(cli.output_dir, f"step_{completed}"))
            if completed >= cli.max_train_steps:
                break
        if completed >= cli.max_train_steps:
            break

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(cli.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save,
                              state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tokenizer.save_pretrained(cli.output_dir)
        print(json.dumps({"losses": losses, "steps": steps}), flush=True)


if __name__ == "__main__":
    main()
    end_rank()
