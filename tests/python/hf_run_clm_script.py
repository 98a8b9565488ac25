"""A script in the shape of transformers' examples/pytorch/language-modeling/
run_clm.py (not a test by itself): dataclass arguments through
HfArgumentParser, TrainingArguments (with --deepspeed) made before the
model, the model made by AutoModelForCausalLM.from_config (--model_type and
--config_overrides) or .from_pretrained (--model_name_or_path, a model saved
with save_pretrained), the tokenizer's new tokens added and the embeddings
resized, texts grouped into blocks, the Trainer. test_hf_run_clm.py runs it
as it is (HF's DeepSpeed integration) and with its Trainer import line alone
changed to ductile's.

  torchrun --nproc-per-node 2 hf_run_clm_script.py --train_file T \\
      --tokenizer_name TOK [--model_type gpt2 --config_overrides ... | \\
      --model_name_or_path M] --output_dir O --deepspeed ds.json --use_cpu ...
"""

import json
import os
from dataclasses import dataclass, field

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser,
                          TrainingArguments, default_data_collator, set_seed)
from transformers import Trainer

from hf_clm_script import end_rank  # the ranks' end (hf_clm_script.py says why)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None)
    model_type: str | None = field(default=None)
    config_overrides: str | None = field(default=None)
    tokenizer_name: str | None = field(default=None)
    # run_clm.py's --torch_dtype
    dtype: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None)
    block_size: int = field(default=32)
    max_train_samples: int | None = field(default=None)
    extra_tokens: int = field(default=0)


class Blocks(torch.utils.data.Dataset):
    """run_clm.py's group_texts: the token stream cut into blocks, labels
    equal to the inputs."""

    def __init__(self, ids, block, count):
        self.ids, self.block, self.count = ids, block, count

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        block = torch.tensor(self.ids[i * self.block:(i + 1) * self.block])
        return {"input_ids": block, "labels": block.clone()}


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)

    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name
                                              or model_args.model_name_or_path)
    if data_args.extra_tokens:
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(data_args.extra_tokens)])
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path,
                                                     dtype=model_args.dtype)
    else:
        config = AutoConfig.for_model(model_args.model_type)
        if model_args.config_overrides:
            config.update_from_string(model_args.config_overrides)
        model = AutoModelForCausalLM.from_config(config)
    # run_clm.py: resize only when the tokenizer outgrew the embeddings.
    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))

    with open(data_args.train_file, encoding="utf-8") as f:
        ids = tokenizer(f.read())["input_ids"]
    block = data_args.block_size
    count = data_args.max_train_samples or 160
    train = Blocks(ids, block, count)
    evaluation = Blocks(ids[count * block:], block, 16)
    trainer = Trainer(model=model, args=training_args, train_dataset=train,
                      eval_dataset=evaluation, processing_class=tokenizer,
                      data_collator=default_data_collator)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    metrics = trainer.evaluate()
    if training_args.process_index == 0:
        print(json.dumps({"log": trainer.state.log_history, "train_loss": result.training_loss,
                          "eval_loss": metrics["eval_loss"],
                          "files": sorted(os.listdir(training_args.output_dir))}), flush=True)


if __name__ == "__main__":
    main()
    end_rank()
