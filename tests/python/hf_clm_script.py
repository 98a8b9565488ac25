"""A causal-LM training script in the shape of transformers'
examples/pytorch/language-modeling/run_clm.py (not a test by itself): a
GPT-2 built from a config, a local text file tokenized by a tokenizer
trained here, texts grouped into blocks, and the Hugging Face Trainer with
TrainingArguments(deepspeed=...) from the command line. test_hf_deepspeed.py
runs it as it is (HF's DeepSpeed integration) and with its Trainer import
line alone changed to ductile's DuctileTrainer.

  torchrun --nproc-per-node 2 hf_clm_script.py --train_file T --output_dir O \
      --deepspeed ds.json [--resume_from_checkpoint O/checkpoint-N] [--device cuda]
"""

import argparse
import json
import os
import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from transformers import Trainer
from transformers import TrainingArguments, default_data_collator, set_seed

BLOCK_SIZE = 32


def build_tokenizer(text_file, vocab_size=256):
    """A byte-level BPE tokenizer trained on the training text itself."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([text_file], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   eos_token="<eos>")


class Blocks(torch.utils.data.Dataset):
    """run_clm.py's group_texts: the token stream cut into BLOCK_SIZE blocks,
    labels equal to the inputs."""

    def __init__(self, ids, count):
        self.ids = ids
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        block = torch.tensor(self.ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        return {"input_ids": block, "labels": block.clone()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    cli = parser.parse_args()

    args = TrainingArguments(
        output_dir=cli.output_dir, deepspeed=cli.deepspeed, use_cpu=cli.device == "cpu",
        ddp_backend="gloo" if cli.device == "cpu" else "nccl",
        per_device_train_batch_size=2, per_device_eval_batch_size=2,
        gradient_accumulation_steps=2, max_steps=cli.max_steps, learning_rate=3e-3,
        weight_decay=0.01, warmup_steps=3, lr_scheduler_type="linear", max_grad_norm=1.0,
        logging_steps=1, save_steps=10, save_strategy="steps", seed=42, report_to=[], disable_tqdm=True, dataloader_drop_last=True)
    set_seed(args.seed)
    tokenizer = build_tokenizer(cli.train_file)
    with open(cli.train_file, encoding="utf-8") as f:
        ids = tokenizer(f.read())["input_ids"]
    train = Blocks(ids, 160)
    evaluation = Blocks(ids[160 * BLOCK_SIZE:], 16)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4,
                        n_positions=BLOCK_SIZE, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                      processing_class=tokenizer, data_collator=default_data_collator)
    result = trainer.train(resume_from_checkpoint=cli.resume_from_checkpoint)
    trainer.save_model()
    metrics = trainer.evaluate()
    if args.process_index == 0:
        print(json.dumps({"log": trainer.state.log_history, "train_loss": result.training_loss,
                          "eval_loss": metrics["eval_loss"],
                          "files": sorted(os.listdir(cli.output_dir))}), flush=True)


def end_rank():
    """Ends the rank once its results are printed: the ranks meet, the
    process group goes, and the interpreter's finalisation is skipped. A
    gloo thread that drops a finished collective's tensors while the
    interpreter finalises aborts the process ("terminate called without an
    active exception", torch's own issue): under HF's DeepSpeed integration
    as under ductile's, about 1 run in 4 when the machine is loaded."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    end_rank()
