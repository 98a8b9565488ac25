"""A TRL preference-tuning script (not a test by itself): a model made with
AutoModelForCausalLM.from_pretrained given to DPOTrainer as an object (its
reference model loaded by TRL from the same path), DPOConfig with a
DeepSpeed config, a small prompt/chosen/rejected dataset. test_trl.py runs
it as it is (TRL on DeepSpeed) and with its DPOTrainer import line alone
changed to ductile's.

  torchrun --nproc-per-node 2 trl_dpo_script.py MODEL TEXT OUT ds.json [RESUME]
"""

import json
import os
import sys

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig
from trl import DPOTrainer


from hf_clm_script import end_rank  # the ranks' end (hf_clm_script.py says why)


def main():
    path, text, out, config = sys.argv[1:5]
    resume = sys.argv[5] if len(sys.argv) > 5 else None
    with open(text, encoding="utf-8") as f:
        lines = [line.strip() for line in f if len(line.strip()) > 40][:150]
    # A line's start as the prompt, its continuation as the chosen answer,
    # and another line's as the rejected one (the tokenizer has about one
    # token a character: 14 of each fit max_length).
    rows = {"prompt": [line[:14] for line in lines[:96]],
            "chosen": [line[14:28] for line in lines[:96]],
            "rejected": [line[14:28] for line in lines[50:146]]}
    args = DPOConfig(output_dir=out, deepspeed=config, use_cpu=True, ddp_backend="gloo",
                     per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
                     save_steps=3, logging_steps=1, learning_rate=3e-3, warmup_steps=2,
                     max_length=32, seed=42, report_to=[], disable_tqdm=True, bf16=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_dict(rows),
                         processing_class=tokenizer)
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    if args.process_index == 0:
        print(json.dumps({"log": trainer.state.log_history, "train_loss": result.training_loss,
                          "files": sorted(os.listdir(out))}), flush=True)


if __name__ == "__main__":
    main()
    end_rank()
