"""A TRL supervised fine-tuning script (not a test by itself): a saved
model given to SFTTrainer as a path string, SFTConfig with a DeepSpeed
config, a small text dataset. test_trl.py runs it as it is (TRL on
DeepSpeed) and with its SFTTrainer import line alone changed to ductile's.

  torchrun --nproc-per-node 2 trl_sft_script.py MODEL TEXT OUT ds.json [RESUME]
"""

import json
import os
import sys

from datasets import Dataset
from trl import SFTConfig
from trl import SFTTrainer


from hf_clm_script import end_rank  # the ranks' end (hf_clm_script.py says why)


def main():
    model, text, out, config = sys.argv[1:5]
    resume = sys.argv[5] if len(sys.argv) > 5 else None
    with open(text, encoding="utf-8") as f:
        lines = [line.strip() for line in f if len(line.strip()) > 40][:96]
    dataset = Dataset.from_dict({"text": lines})
    args = SFTConfig(output_dir=out, deepspeed=config, use_cpu=True, ddp_backend="gloo",
                     per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
                     save_steps=3, logging_steps=1, learning_rate=3e-3, warmup_steps=2,
                     max_length=32, seed=42, report_to=[], disable_tqdm=True, bf16=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset)
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    if args.process_index == 0:
        print(json.dumps({"log": trainer.state.log_history, "train_loss": result.training_loss,
                          "files": sorted(os.listdir(out))}), flush=True)


if __name__ == "__main__":
    main()
    end_rank()
