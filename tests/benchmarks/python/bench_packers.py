"""Three best-fit-decreasing packers on the same lengths, in one run (a program
that prints figures, medians; not a test):

  ductile    ductile.batching.pack(sampler="bfd", budget="sum"): the C++ plugin
  trl        TRL's BFD packing, trl.data_utils._pack_bfd: the function that
             trl.pack_dataset(strategy="bfd") maps over a dataset, given the
             whole data set as one pyarrow table (pack_dataset's default maps
             batches of 1,000 rows, which packs each batch on its own and
             fills worse; the one-table call is TRL at its best)
  seqpacker  seqpacker.Packer(strategy="obfd") and ("bfd"), a Rust core;
             pack_flat() returns numpy arrays, its fastest call

Each packer gets the same sample lengths and the same capacity; a pack is
the samples of one micro-batch, at most `capacity` tokens in all. Fill is
tokens / (packs x capacity). Every plan is checked: each sample exactly once,
no pack over capacity. Times are medians, whole calls from Python (TRL also
moves the token ids, which is what its users pay for).

Lengths:
  wikipedia  a draw of SAMPLES sequences from the Wikipedia BERT-512 length
             histogram (16.28 M sequences), capacity 512
  azure-conv the Azure LLM inference trace, conversation (19,366 requests),
             capacity 8,192 (one request of 14,050 tokens cut to 8,192)
  azure-code the same trace, code completion (8,819 requests), capacity 8,192

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_packers.py \
      [SAMPLES [ROUNDS]]

seqpacker has no wheel that pip installs on Linux x86_64 for CPython 3.11;
tools/bench/install_seqpacker.sh puts its stable-ABI module under
build-bench/seqpacker (see there why). Without it that column is skipped.
"""

import csv
import os
import statistics
import sys
import time

import numpy as np

import ductile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
LENGTHS = os.path.join(ROOT, "tests", "data", "lengths")
SEQPACKER = os.path.join(ROOT, "build-bench", "seqpacker")


def wikipedia(samples, seed=1234):
    lengths, counts = [], []
    with open(os.path.join(LENGTHS, "wikipedia_bert512_hist.csv")) as f:
        for row in csv.DictReader(f):
            lengths.append(int(row["length"]))
            counts.append(int(row["count"]))
    counts = np.asarray(counts, np.float64)
    rng = np.random.default_rng(seed)
    return rng.choice(np.asarray(lengths, np.int64), size=samples, p=counts / counts.sum())


def azure(kind, capacity):
    with open(os.path.join(LENGTHS, f"AzureLLMInferenceTrace_{kind}.csv")) as f:
        trace = np.asarray([int(row["ContextTokens"]) for row in csv.DictReader(f)], np.int64)
    return np.minimum(trace, capacity)


def check(name, lengths, capacity, packs):
    """packs: list of id arrays. Returns the fill ratio; exits on a wrong plan."""
    ids = np.concatenate(packs) if packs else np.zeros(0, np.int64)
    if len(ids) != len(lengths) or not np.array_equal(np.sort(ids), np.arange(len(lengths))):
        sys.exit(f"{name}: the plan does not hold each sample exactly once")
    used = np.asarray([lengths[p].sum() for p in packs])
    if used.max() > capacity:
        sys.exit(f"{name}: a pack holds {used.max()} tokens, over the capacity {capacity}")
    return lengths.sum() / (len(packs) * capacity)


def median_time(fn, rounds):
    times, result = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def run_ductile(lengths, capacity):
    plan = ductile.batching.pack(lengths, max_tokens=capacity, sampler="bfd", budget="sum")
    if len(plan.dropped_ids) or len(plan.leftover_ids):
        sys.exit("ductile: samples dropped or left over")
    return plan


def ductile_packs(plan):
    return np.split(plan.sample_ids, plan.microbatch_offsets[1:-1])


def trl_table(lengths):
    import pyarrow as pa

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # Token ids carry each sample's index so that the packed table names its samples.
    values = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    return pa.Table.from_arrays([pa.LargeListArray.from_arrays(offsets, values)],
                                names=["input_ids"])


def trl_packs(table):
    column = table["input_ids"].combine_chunks()
    sizes = table["seq_lengths"].combine_chunks()
    values = column.values.to_numpy()
    offsets = column.offsets.to_numpy()
    packs = []
    for i in range(len(column)):
        row = values[offsets[i]:offsets[i + 1]]
        starts = np.concatenate([[0], np.cumsum(sizes[i].values.to_numpy())[:-1]])
        packs.append(row[starts])
    return packs


def seqpacker_packs(result):
    items, split_points = result  # np.split's indices: where each pack after the first starts
    return np.split(items, split_points)


def race(title, lengths, capacity, rounds, seqpacker):
    from trl.data_utils import _pack_bfd

    print(f"\n{title}: {len(lengths):,} samples, {int(lengths.sum()):,} tokens, "
          f"capacity {capacity:,}")
    rows = []
    seconds, plan = median_time(lambda: run_ductile(lengths, capacity), rounds)
    rows.append(("ductile bfd", check("ductile", lengths, capacity, ductile_packs(plan)),
                 plan.microbatch_count, seconds))

    table = trl_table(lengths)
    seconds, packed = median_time(lambda: _pack_bfd(table, capacity), max(1, rounds // 3))
    packs = trl_packs(packed)
    rows.append(("trl _pack_bfd", check("trl", lengths, capacity, packs), len(packs), seconds))

    if seqpacker is not None:
        for strategy in ("obfd", "bfd"):
            packer = seqpacker.Packer(capacity=capacity, strategy=strategy)
            seconds, result = median_time(lambda: packer.pack_flat(lengths), rounds)
            packs = seqpacker_packs(result)
            rows.append((f"seqpacker {strategy}", check("seqpacker", lengths, capacity, packs),
                         len(packs), seconds))

    ours = rows[0][3]
    print(f"  {'packer':16s} {'fill':>9s} {'packs':>9s} {'median':>11s} {'ductile faster':>15s}")
    for name, fill, count, seconds in rows:
        ratio = "" if name.startswith("ductile") else f"{seconds / ours:14.1f}x"
        print(f"  {name:16s} {fill * 100:8.3f}% {count:9,d} {seconds * 1e3:9.2f}ms {ratio}")


def main():
    samples = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    seqpacker = None
    if os.path.isdir(SEQPACKER):
        sys.path.insert(0, SEQPACKER)
        import seqpacker
        print(f"seqpacker {seqpacker.__version__} from {SEQPACKER}")
    else:
        print(f"seqpacker: not installed under {SEQPACKER} "
              "(tools/bench/install_seqpacker.sh); its column is skipped")
    import trl

    print(f"trl {trl.__version__}, ductile {ductile.__version__}; medians of {rounds} "
          f"(trl: {max(1, rounds // 3)})")
    race(f"Wikipedia BERT-512 (a seeded draw from the histogram)", wikipedia(samples), 512,
         rounds, seqpacker)
    race("Azure conversation trace", azure("conv", 8192), 8192, rounds, seqpacker)
    race("Azure code trace", azure("code", 8192), 8192, rounds, seqpacker)


if __name__ == "__main__":
    main()
