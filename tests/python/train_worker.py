"""One rank of the 2-rank training run of test_training.py (not a test by
itself): a small causal byte-level transformer LM trained on the lines of
tests/data/text/gpl-3.0.txt with ductile's token-budget sampler and sqrt LR
scaling with warm-up, gradients averaged over ranks with torch.distributed
(gloo). Writes one JSON record per optimizer step to OUT/rank<r>.json.

  train_worker.py RANK WORLD PORT OUT

Three runs in one process (one torch import): uninterrupted; stopped after
k steps with every state_dict saved; resumed from them in fresh objects.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import ductile.torch as dt

CORPUS = os.path.join(os.environ["DUCTILE_TEST_DATA_DIR"], "text", "gpl-3.0.txt")
EPOCHS = 2
MAX_TOKENS = 512
BASE_LR = 4e-3


class Lines(torch.utils.data.Dataset):
    """Every non-empty line of the corpus (with its newline) as bytes."""

    def __init__(self, path):
        with open(path, "rb") as f:
            self.lines = [line for line in f.read().split(b"\n") if line.strip()]

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, i):
        return {"tokens": torch.tensor(list(self.lines[i] + b"\n"), dtype=torch.int64),
                "index": i}


class TinyLM(nn.Module):
    def __init__(self, vocab=256, d=64, heads=4, layers=2, max_len=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x, padding):
        t = x.shape[1]
        causal = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        h = self.embed(x) + self.pos(torch.arange(t))
        return self.head(self.blocks(h, mask=causal, src_key_padding_mask=padding))


def train(rank, world, stop_after=None, checkpoint=None, resume=None):
    """Trains from scratch (or from `resume`) to the end of EPOCHS, or until
    `stop_after` optimizer steps, then saves every state_dict to
    `checkpoint`. Returns one record per optimizer step."""
    torch.manual_seed(0)
    dataset = Lines(CORPUS)
    model = TinyLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=BASE_LR)
    # Rank and world size come from torch.distributed.
    loader, scheduler, sampler = dt.variable_batch_dataloader(
        dataset, length_fn=lambda sample: len(sample["tokens"]), max_tokens=MAX_TOKENS,
        gradient_accumulation_steps=1, order="random", seed=7, optimizer=optimizer,
        lr_rule="sqrt", base_batch_size=16,
        lr_options=dict(schedule="warmup_linear", warmup_steps=10, total_steps=200, min_lr=1e-4))
    assert (sampler.rank, sampler.world_size) == (rank, world)
    records = []
    start_epoch = 0
    if resume:
        state = torch.load(f"{resume}.rank{rank}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch = state["sampler"]["epoch"]
    for epoch in range(start_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        step_labels = sampler.step_totals()["labels"]
        for i, batch in enumerate(loader, start=sampler.position):
            tokens, lengths = batch["tokens"], batch["lengths"]
            step = scheduler.last_step
            lr = optimizer.param_groups[0]["lr"]
            inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
            valid = torch.arange(targets.shape[1])[None, :] < (lengths - 1)[:, None]
            targets[~valid] = -100
            logits = model(inputs, ~valid)
            loss_sum = nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1),
                                                   ignore_index=-100, reduction="sum")
            loss_sum.backward()
            # The step's mean loss over every token of both ranks; gradients
            # summed over ranks and divided by the same token count.
            totals = torch.tensor([loss_sum.item(), float(valid.sum())], dtype=torch.float64)
            dist.all_reduce(totals)
            # Every rank knew the step's label count from the packing alone.
            if totals[1].item() != step_labels[sampler.step_of(i)]:
                raise AssertionError(f"rank {rank} epoch {epoch} micro-batch {i}: the ranks "
                                     f"count {totals[1].item()} labels, the sampler "
                                     f"{step_labels[sampler.step_of(i)]}")
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= totals[1].item()
            optimizer.step()
            optimizer.zero_grad()
            records.append({"step": step, "epoch": epoch, "lr": lr,
                            "loss": totals[0].item() / totals[1].item(),
                            "ids": batch["index"].tolist(), "lengths": lengths.tolist(),
                            "batch_size": scheduler.batch_size(step)})
            scheduler.step()
            if stop_after is not None and scheduler.last_step == stop_after:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "sampler": sampler.state_dict(), "scheduler": scheduler.state_dict()},
                           f"{checkpoint}.rank{rank}")
                return records
    return records


def main():
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    full = train(rank, world)
    steps_epoch0 = sum(1 for r in full if r["epoch"] == 0)
    stop = steps_epoch0 + 5  # mid-way through the second epoch
    checkpoint = os.path.join(out, "checkpoint")
    first = train(rank, world, stop_after=stop, checkpoint=checkpoint)
    dist.barrier()
    second = train(rank, world, resume=checkpoint)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"full": full, "first": first, "second": second, "stop": stop}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
