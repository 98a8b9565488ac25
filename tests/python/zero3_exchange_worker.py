"""One rank of test_zero3_direct_exchange.py under torchrun (gloo): the
gathers and reduce-scatters of TorchWorld by direct exchange
(_world.py) against torch's own collectives on the same inputs.
Writes what it saw to <out>.rank<r> (JSON)."""

import gc
import json
import sys

import torch
import torch.distributed as dist

from ductile.torch.zero3 import _world
from ductile.torch.zero3._world import TorchWorld


def values(count, rank, dtype, salt):
    # Different on every rank and element, exact in bfloat16 for small counts.
    return (torch.arange(count, dtype=torch.float64) % 61 + 100 * rank + salt).to(dtype)


def engine_holds_the_group(world_group):
    """References to the default group that a zero3 engine over it (its C++
    host world, after a step of planned gathers) keeps: one kept would
    outlive destroy_process_group(). Counted over a second engine, once
    torch has filled its own caches of the group with the first."""
    import ductile.torch.zero3 as zero3
    from zero3_launch import BLOCKS_CONFIG
    from zero3_model import Windows, loss_of, make_model

    def engine_and_step():
        engine = zero3.initialize(make_model(layers=2), lambda ps: torch.optim.Adam(ps, lr=1e-3),
                                  BLOCKS_CONFIG)
        x, y = Windows().step(0, engine.rank, engine.world_size)
        engine.backward(loss_of(engine(x), y))
        engine.step()
        return engine

    engines = [engine_and_step()]
    gc.collect()
    before = sys.getrefcount(world_group)
    engines.append(engine_and_step())
    gc.collect()
    return sys.getrefcount(world_group) - before


def main(out_path):
    dist.init_process_group("gloo")
    report_held = engine_holds_the_group(dist.group.WORLD)
    world = TorchWorld()
    rank, size = world.rank, world.size
    report = {"rank": rank, "size": size, "direct": world.direct_exchange,
              "group_references_an_engine_holds": report_held,
              "checks": {}}
    checks = report["checks"]

    # Gathers of several sizes and dtypes, all issued before any is waited
    # for, waited in reverse: the messages of one tag match in posting order.
    cases = [(5, torch.float32), (100_003, torch.float32), (1, torch.bfloat16),
             (4_096, torch.float64), (0, torch.float32)]
    issued = []
    for i, (count, dtype) in enumerate(cases):
        inp = values(count, rank, dtype, i)
        out = torch.full((size * count,), -1.0, dtype=dtype)
        issued.append((count, dtype, inp, out, world.all_gather(out, inp)))
    polled = [entry[4].query() for entry in issued if entry[0] > 0]
    for count, dtype, inp, out, work in reversed(issued):
        work.wait()
        expected = torch.empty(size * count, dtype=dtype)
        dist.all_gather_into_tensor(expected, inp)
        checks[f"gather {count} {dtype}"] = torch.equal(out, expected)
    report["query_before_wait"] = polled
    report["query_after_wait"] = all(work.query() for *_, work in issued)

    # In place: the input is this rank's slot of the output.
    count = 777
    out = torch.zeros(size * count)
    out[rank * count:(rank + 1) * count] = values(count, rank, torch.float32, 9)
    world.all_gather(out, out[rank * count:(rank + 1) * count]).wait()
    expected = torch.cat([values(count, r, torch.float32, 9) for r in range(size)])
    checks["gather in place"] = torch.equal(out, expected)

    # Reduce-scatters (sum: by exchange; max: torch's collective), with a
    # gather in flight between them.
    for count, op in ((3, "sum"), (50_001, "sum"), (1_000, "max")):
        inp = values(size * count, rank, torch.float32, count) * (rank + 1)
        out = torch.full((count,), -1.0)
        work = world.reduce_scatter(out, inp, op)
        side_in = values(count, rank, torch.float32, 5)
        side_out = torch.empty(size * count)
        side = world.all_gather(side_out, side_in)
        side.wait()
        work.wait()
        expected = torch.empty(count)
        dist.reduce_scatter_tensor(expected, inp.clone(),
                                   op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        checks[f"reduce_scatter {op} {count}"] = torch.equal(out, expected)
        checks[f"gather between reduce_scatters {count}"] = torch.equal(
            side_out, torch.cat([values(count, r, torch.float32, 5) for r in range(size)]))
    # Without an exchange (NCCL, more than MAX_RANKS ranks: here a world
    # made while the limit is 1): torch's collectives, the same values.
    limit = _world.MAX_RANKS
    _world.MAX_RANKS = 1
    try:
        collectives = TorchWorld()
    finally:
        _world.MAX_RANKS = limit
    report["collectives_direct"] = collectives.direct_exchange
    count = 1_001
    inp = values(count, rank, torch.float32, 3)
    out = torch.empty(size * count)
    collectives.all_gather(out, inp).wait()
    checks["gather by torch's collective"] = torch.equal(
        out, torch.cat([values(count, r, torch.float32, 3) for r in range(size)]))
    # A group of the last two ranks: group ranks, not global ones, address
    # the messages (on 2 ranks, the whole world again).
    members = [size - 2, size - 1]
    sub = dist.new_group(members)
    if rank in members:
        sub_world = TorchWorld(sub)
        count = 333
        inp = values(count, rank, torch.float32, 7)
        out = torch.empty(2 * count)
        sub_world.all_gather(out, inp).wait()
        checks["gather in a group of 2"] = sub_world.direct_exchange and torch.equal(
            out, torch.cat([values(count, r, torch.float32, 7) for r in members]))
        reduced = torch.empty(count)
        layout = values(2 * count, rank, torch.float32, 1)
        sub_world.reduce_scatter(reduced, layout).wait()
        mine = members.index(rank)
        checks["reduce_scatter in a group of 2"] = torch.equal(
            reduced, sum(values(2 * count, r, torch.float32, 1)[mine * count:(mine + 1) * count]
                         for r in members))
    report["exchanges"] = world.exchanges
    report["collective_exchanges"] = collectives.exchanges
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
