"""ductile for PyTorch: variable-batch data loading and learning-rate scaling
(the equivalent of DeepSpeed's
``get_dataloader_and_lr_scheduler_for_variable_batch_size``), on the C++
packing pipeline (``ductile.batching.pack``) and the lr plugins.

    # rank and world size from torch.distributed
    sampler = DynamicBatchSampler(lengths, max_tokens=4096, gradient_accumulation_steps=2,
                                  order="random", seed=42)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=PadCollate())
    scheduler = VariableBatchLRScheduler(optimizer, sampler, lr_rule="sqrt",
                                         base_batch_size=64, schedule="warmup_linear",
                                         warmup_steps=100, total_steps=10_000)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for i, (tokens, lengths) in enumerate(loader):
            loss = ...; loss.backward()
            if (i + 1) % sampler.gradient_accumulation_steps == 0:
                optimizer.step(); scheduler.step(); optimizer.zero_grad()

Nothing here computes a packing or a learning rate: both come from C++.
"""

from ._collate import FlattenCollate, PadCollate, PaddedSamples
from ._dataloader import (get_dataloader_and_lr_scheduler_for_variable_batch_size,
                          variable_batch_dataloader)
from ._lr_scheduler import VariableBatchLRScheduler
from ._sampler import DynamicBatchSampler

__all__ = ["DynamicBatchSampler", "FlattenCollate", "PadCollate", "PaddedSamples",
           "VariableBatchLRScheduler",
           "variable_batch_dataloader", "get_dataloader_and_lr_scheduler_for_variable_batch_size"]
