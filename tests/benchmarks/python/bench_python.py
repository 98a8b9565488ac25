"""Python front end costs (a program that prints figures, medians; not a test).

1. ductile.torch's sampler and LR scheduler per optimizer step, against one
   training step of the test model of tests/python/test_training.py (the
   byte-level transformer LM, max_tokens 512, on tests/data/text/gpl-3.0.txt):
   the goal is under 1 % of a step.
2. ductile.elasticity.compute_elastic_config per call, against the figures
   of plugins/elasticity/README.md ("well under 1 ms per call up to 2^40").
3. The rival in the same run: DeepSpeed's own compute_elastic_config and
   batch_by_seqlens (the release of requirements.txt) on the same inputs,
   with the ratio.

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_python.py
"""

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
os.environ.setdefault("DUCTILE_TEST_DATA_DIR", os.path.join(ROOT, "tests", "data"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

import ductile  # noqa: E402
from ductile.elasticity import compute_elastic_config  # noqa: E402


def median_time(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_sampler_and_scheduler():
    import torch
    import torch.nn as nn
    import ductile.torch as dt
    import train_worker as w

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dataset = w.Lines(w.CORPUS)
    model = w.TinyLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=w.BASE_LR)
    loader, scheduler, sampler = dt.variable_batch_dataloader(
        dataset, length_fn=lambda s: len(s["tokens"]), max_tokens=w.MAX_TOKENS, rank=0,
        world_size=2, order="random", seed=7, optimizer=optimizer, lr_rule="sqrt",
        base_batch_size=16, lr_options=dict(schedule="warmup_linear", warmup_steps=10,
                                            total_steps=200))
    batches = list(loader)

    def train_step(batch):
        tokens, lengths = batch["tokens"], batch["lengths"]
        inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
        valid = torch.arange(targets.shape[1])[None, :] < (lengths - 1)[:, None]
        targets[~valid] = -100
        loss = nn.functional.cross_entropy(model(inputs, ~valid).reshape(-1, 256),
                                           targets.reshape(-1), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step_times = []
    for batch in batches[:30]:
        t0 = time.perf_counter()
        train_step(batch)
        step_times.append(time.perf_counter() - t0)
    step = statistics.median(step_times[5:])

    # Sampler + scheduler alone for whole epochs: a fresh plan each epoch
    # (one C++ pack), every micro-batch's ids handed out, one scheduler step
    # per optimizer step. Per step = epoch time / steps.
    per_step = []
    for epoch in range(1, 21):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        n = 0
        for _ in sampler:
            scheduler.step()
            n += 1
        per_step.append((time.perf_counter() - t0) / n)
    overhead = statistics.median(per_step)
    print("ductile.torch sampler + LR scheduler (2 ranks' packing, rank 0's share, "
          f"{len(batches)} steps an epoch, median of 20 epochs incl. the per-epoch pack):")
    print(f"  per step     {overhead * 1e6:10.1f} us")
    print(f"  model step   {step * 1e3:10.2f} ms  (forward + backward + Adam, 1 thread, "
          "median of 25)")
    print(f"  ratio        {100 * overhead / step:10.3f} %   (goal < 1 %)")


CONFIGS = {
    "v0.1, DeepSpeed unit test basic_10k": {"elasticity": {
        "enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17],
        "min_gpus": 32, "max_gpus": 1500, "min_time": 20, "version": 0.1}},
    "v0.2, 8 GPUs a node, world size 64": {"elasticity": {
        "enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17],
        "min_gpus": 32, "max_gpus": 1500, "num_gpus_per_node": 8, "version": 0.2}},
    "v0.1, cap 2^40, max_gpus 2^40": {"elasticity": {
        "enabled": True, "max_train_batch_size": 2 ** 40, "micro_batch_sizes": [2, 3, 5, 7],
        "min_gpus": 1, "max_gpus": 2 ** 40, "version": 0.1}},
    "v0.1, cap 10^6, 9 micro batches, GPUs 32..4,096": {"elasticity": {
        "enabled": True, "max_train_batch_size": 10 ** 6,
        "micro_batch_sizes": [2, 4, 6, 8, 12, 16, 17, 24, 32], "min_gpus": 32, "max_gpus": 4096,
        "version": 0.1}},
    "v0.1, cap 10^6, 9 micro batches, GPUs 1..100,000": {"elasticity": {
        "enabled": True, "max_train_batch_size": 10 ** 6,
        "micro_batch_sizes": [2, 4, 6, 8, 12, 16, 17, 24, 32], "min_gpus": 1,
        "max_gpus": 100000, "version": 0.1}},
    "optimal, cap 100000": {"elasticity": {
        "enabled": True, "policy": "optimal", "max_train_batch_size": 100000,
        "micro_batch_sizes": [2, 4, 6], "min_gpus": 1, "max_gpus": 10000}},
}


def bench_elasticity():
    print("compute_elastic_config per call (median of 200; plugins/elasticity/README.md: "
          "v0.1/v0.2 well under 1 ms per call up to 2^40):")
    for name, config in CONFIGS.items():
        world = 64 if "world size" in name else 0
        first = median_time(lambda: compute_elastic_config(dict(config), "0.9.0", world), 1)
        repeat = median_time(lambda: compute_elastic_config(config, "0.9.0", world), 200)
        print(f"  {name:50s} {repeat * 1e6:10.1f} us  (first call {first * 1e6:.0f} us)")


def bench_against_deepspeed():
    import logging
    import warnings

    import numpy as np
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import deepspeed
        from deepspeed.elasticity import compute_elastic_config as deepspeed_elastic
        from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import \
            batch_by_seqlens
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    print(f"against DeepSpeed {deepspeed.__version__}, same process, same inputs (medians):")
    for name, config in CONFIGS.items():
        if "policy" in config["elasticity"]:
            continue  # DeepSpeed has no such policy
        world = 64 if "world size" in name else 0
        if config["elasticity"]["max_gpus"] > 10 ** 6:
            print(f"  {name:50s} DeepSpeed not run: its GPU-count scan is linear in max_gpus")
            continue
        ours = median_time(lambda: compute_elastic_config(config, "0.9.0", world), 200)
        theirs = median_time(lambda: deepspeed_elastic(config, "0.9.0", world), 20)
        print(f"  {name:50s} ductile {ours * 1e6:9.1f} us  DeepSpeed {theirs * 1e6:9.1f} us"
              f"  {theirs / ours:7.1f}x")
    path = os.path.join(ROOT, "tests", "data", "lengths", "sharegpt_opt_first_turn_lengths.csv")
    lengths = np.loadtxt(path, delimiter=",", skiprows=1, usecols=0, dtype=np.int64)[:2000]
    kwargs = dict(max_tokens=4096, effective_batch_size=2)
    # The pack drops 10 samples longer than the budget; its warning on every
    # repetition would be timed too.
    ductile.init_logging("error")
    ours = median_time(lambda: ductile.batching.pack(lengths, **kwargs), 50)
    listed = lengths.tolist()
    theirs = median_time(lambda: batch_by_seqlens(listed, **kwargs), 3)
    # The same answer, or the race means nothing (as the parity test checks).
    ids, sizes, _ = batch_by_seqlens(listed, **kwargs)
    plan = ductile.batching.pack(lengths, **kwargs).to_json()
    assert plan["microbatch_ids"][:len(ids)] == [[b, list(m)] for b, m in ids]
    assert plan["batch_sizes"][:len(sizes)] == sizes
    print(f"  {'pack 2,000 ShareGPT lengths, 4,096 tokens':50s} ductile {ours * 1e6:9.1f} us"
          f"  DeepSpeed {theirs * 1e3:9.1f} ms  {theirs / ours:7.0f}x")


if __name__ == "__main__":
    print(f"ductile {ductile.__version__}, Python {sys.version.split()[0]}")
    bench_elasticity()
    bench_against_deepspeed()
    bench_sampler_and_scheduler()
