"""A TRL reward-model script (not a test by itself): a saved model given to
RewardTrainer as a path string (a sequence classifier with one label), a
small chosen/rejected dataset. test_trl.py runs it as it is (TRL on
DeepSpeed) and with its RewardTrainer import line alone changed to
ductile's.

  torchrun --nproc-per-node 2 trl_reward_script.py MODEL TEXT OUT ds.json
"""

import json
import os
import sys

from datasets import Dataset
from trl import RewardConfig
from trl import RewardTrainer


from hf_clm_script import end_rank  # the ranks' end (hf_clm_script.py says why)


def main():
    path, text, out, config = sys.argv[1:5]
    with open(text, encoding="utf-8") as f:
        lines = [line.strip() for line in f if len(line.strip()) > 40][:150]
    rows = {"chosen": [line[:28] for line in lines[:96]],
            "rejected": [line[:28] for line in lines[50:146]]}
    args = RewardConfig(output_dir=out, deepspeed=config, use_cpu=True, ddp_backend="gloo",
                        per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        max_steps=4, save_strategy="no", logging_steps=1, learning_rate=3e-3,
                        warmup_steps=1, max_length=32, seed=42, report_to=[], disable_tqdm=True,
                        bf16=False)
    trainer = RewardTrainer(model=path, args=args, train_dataset=Dataset.from_dict(rows))
    result = trainer.train()
    if args.process_index == 0:
        print(json.dumps({"log": trainer.state.log_history, "train_loss": result.training_loss,
                          "files": sorted(os.listdir(out))}), flush=True)


if __name__ == "__main__":
    main()
    end_rank()
