"""A DeepSpeed training script over a transformers model (not a test by
itself), in the shape of HF's non-Trainer DeepSpeed integration:
HfDeepSpeedConfig made first, so that from_pretrained builds the model under
ZeRO-3's zero.Init, then deepspeed.initialize and a few steps.
test_hf_run_clm.py runs it as it is and with its import line alone changed
to ``import ductile.deepspeed as deepspeed``.

  torchrun --nproc-per-node 2 deepspeed_hf_script.py MODEL_DIR
"""

import json
import sys

import deepspeed
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

from hf_clm_script import end_rank  # the ranks' end (hf_clm_script.py says why)

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
          "zero_optimization": {"stage": 3}}


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    keep = HfDeepSpeedConfig(CONFIG)  # noqa: F841  (transformers holds a weak reference)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=CONFIG)
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / torch.distributed.get_world_size())
    if rank == 0:
        print(json.dumps({"losses": losses}), flush=True)
    end_rank()


if __name__ == "__main__":
    main()
