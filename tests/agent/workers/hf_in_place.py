"""Worker of the agent tests: a Hugging Face Trainer script in the shape of
transformers' examples (TrainingArguments with a DeepSpeed ZeRO-3 config
first, then the model made by ``from_config`` under ZeRO-3's init), on
ductile.hf.DuctileTrainer, gloo on the cpu, a snapshot in memory every step
and a checkpoint on disk every step (the reference resumes from one).

Every log of the Trainer (one a step) is appended to
OUT/losses-<node>.jsonl as {round, world, rank, step, loss, grad_norm,
learning_rate, pid}, and a line is printed.

usage: hf_in_place.py OUT STEPS [--stall NODE K] [--sleep NODE K S] [--wait K FILE]
                      [--max-tokens N] [--trl] [--trainer-optimizer] [--resume CHECKPOINT]

--stall NODE K: the worker of node NODE stops after its checkpoint of step
K (it prints "hf_in_place stalled node=NODE step=K" and sleeps; the test
kills it), so the others cannot complete step K + 1.
--sleep NODE K S: the worker of node NODE sleeps S seconds after its
checkpoint of step K (it answers no round notice meanwhile).
--wait K FILE: every worker waits after its checkpoint of step K until FILE
exists (the test makes it once a node joins).
--max-tokens N: samples of 4 to 16 tokens in DuctileTrainer's packs of at
most N tokens (its variable batches and learning rates).
--trl: a TRL supervised fine-tuning script instead (ductile.trl.SFTTrainer,
SFTConfig, lines of a text with a tokenizer trained on it).
--trainer-optimizer: no optimizer in the DeepSpeed config: the Trainer makes
its own AdamW and learning-rate scheduler, and steps the scheduler itself.
--resume CHECKPOINT: train from a checkpoint on disk (the reference, under
torchrun: the node is named by the rank).
"""
import json
import os
import sys
import time

import torch
import transformers
from hf_trainer_worker import exit_rank

from ductile.hf import DuctileTrainer

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)

SAMPLES, LENGTH, VOCAB = 96, 16, 64


class Tokens(torch.utils.data.Dataset):
    """Fixed sequences of token ids (the same in every process): LENGTH
    tokens each, or 4 to LENGTH with `varied`."""

    def __init__(self, varied):
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=generator)
        self.lengths = [4 + (7 * i) % (LENGTH - 3) if varied else LENGTH
                        for i in range(SAMPLES)]

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        ids = self.ids[index, :self.lengths[index]]
        return {"input_ids": ids, "labels": ids}


class Record(transformers.TrainerCallback):
    """Appends each training log to OUT/losses-<node>.jsonl; stops for good
    after the checkpoint of step K on node NODE (--stall), or waits there
    for a file (--wait)."""

    def __init__(self, out, node, stall, wait, sleep=None):
        self.path = os.path.join(out, f"losses-{node}.jsonl")
        self.node, self.stall, self.wait, self.sleep = node, stall, wait, sleep

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        entry = {"round": int(os.environ.get("DUCTILE_ROUND", "0")),
                 "world": torch.distributed.get_world_size(),
                 "rank": torch.distributed.get_rank(), "step": state.global_step,
                 "loss": logs["loss"], "grad_norm": logs["grad_norm"],
                 "learning_rate": logs["learning_rate"], "pid": os.getpid()}
        with open(self.path, "a") as log:
            log.write(json.dumps(entry) + "\n")
        print(f"hf_in_place round={entry['round']} world={entry['world']} node={self.node} "
              f"step={entry['step']}", flush=True)

    def on_save(self, args, state, control, **kwargs):
        if self.stall == (self.node, state.global_step):
            print(f"hf_in_place stalled node={self.node} step={state.global_step}", flush=True)
            time.sleep(3600)
        if self.sleep is not None and self.sleep[:2] == (self.node, state.global_step):
            time.sleep(self.sleep[2])
        if self.wait is not None and self.wait[0] == state.global_step:
            while not os.path.exists(self.wait[1]):
                time.sleep(0.05)


def sft_trainer(out, steps, config, callbacks):
    """TRL's SFTTrainer on ductile's engine over a tiny GPT-2 and lines of
    the GPL's text."""
    from datasets import Dataset
    from hf_clm_script import build_tokenizer
    from trl import SFTConfig

    from ductile.trl import SFTTrainer

    text = os.path.join(os.environ["DUCTILE_TEST_DATA_DIR"], "text", "gpl-3.0.txt")
    tokenizer = build_tokenizer(text)
    tokenizer.pad_token = tokenizer.eos_token
    with open(text, encoding="utf-8") as f:
        lines = [line.strip() for line in f if len(line.strip()) > 40][:96]
    args = SFTConfig(output_dir=os.path.join(out, "trainer"), deepspeed=config, use_cpu=True,
                     ddp_backend="gloo", per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, max_steps=steps, save_steps=1,
                     logging_steps=1, learning_rate=3e-3, warmup_steps=2, max_length=32,
                     seed=0, report_to=[], disable_tqdm=True, bf16=False)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=32,
        pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id))
    return SFTTrainer(model=model, args=args, processing_class=tokenizer,
                      train_dataset=Dataset.from_dict({"text": lines}), callbacks=callbacks)


def main(out, steps, stall, wait, max_tokens, trl, resume, sleep, trainer_optimizer):
    node = os.environ.get("DUCTILE_AGENT_NODE_ID") or f"rank{os.environ['RANK']}"
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                        "eps": "auto",
                                                        "weight_decay": "auto"}},
              "snapshot": {"interval": 1, "replicas": 1}}
    if trainer_optimizer:
        del config["optimizer"]
    callbacks = [Record(out, node, stall, wait, sleep)]
    if trl:
        sft_trainer(out, steps, config, callbacks).train(resume_from_checkpoint=resume)
        print(f"hf_in_place done node={node} pid={os.getpid()}", flush=True)
        exit_rank()
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, "trainer"), use_cpu=True, ddp_backend="gloo",
        deepspeed=config, max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, lr_scheduler_type="linear",
        warmup_steps=2, logging_steps=1, save_strategy="steps", save_steps=1, report_to=[],
        disable_tqdm=True, seed=0, dataloader_num_workers=0)
    model_config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(model_config)
    dataset = Tokens(varied=max_tokens is not None)
    packs = {} if max_tokens is None else {"max_tokens": max_tokens, "base_batch_size": 8,
                                           "lengths": dataset.lengths}
    trainer = DuctileTrainer(model=model, args=args, train_dataset=dataset,
                             callbacks=callbacks, **packs)
    trainer.train(resume_from_checkpoint=resume)
    print(f"hf_in_place done node={node} pid={os.getpid()}", flush=True)
    exit_rank()


if __name__ == "__main__":
    out, steps = sys.argv[1], int(sys.argv[2])
    options, stall, wait, max_tokens, trl, resume, sleep = (sys.argv[3:], None, None, None,
                                                             False, None, None)
    trainer_optimizer = False
    while options:
        if options[0] == "--stall":
            stall, options = (options[1], int(options[2])), options[3:]
        elif options[0] == "--sleep":
            sleep, options = (options[1], int(options[2]), float(options[3])), options[4:]
        elif options[0] == "--wait":
            wait, options = (int(options[1]), options[2]), options[3:]
        elif options[0] == "--max-tokens":
            max_tokens, options = int(options[1]), options[2:]
        elif options[0] == "--trainer-optimizer":
            trainer_optimizer, options = True, options[1:]
        elif options[0] == "--trl":
            trl, options = True, options[1:]
        elif options[0] == "--resume":
            resume, options = options[1], options[2:]
        else:
            sys.exit(f"hf_in_place.py: unknown option {options[0]!r}")
    main(out, steps, stall, wait, max_tokens, trl, resume, sleep, trainer_optimizer)
