"""What the zero3 checkpoint tests share (not a test by itself): a small
engine on one rank, training it, snapshots of its parameters and optimizer
state, and the files of a saved checkpoint."""

import os
import shutil
import sys

import torch

import ductile.torch.zero3 as zero3

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_launch import CONFIG  # noqa: E402
from zero3_model import Windows, loss_of, make_model  # noqa: E402


def engine_of(layers=1, optimizer=True, seed=0):
    factory = (lambda ps: torch.optim.Adam(ps, lr=1e-2)) if optimizer else None
    return zero3.initialize(make_model(seed=seed, layers=layers), factory, CONFIG)


def train(engine, steps):
    windows = Windows(batch=2)
    for _ in range(steps):
        x, y = windows.step(engine.global_step)
        engine.backward(loss_of(engine(x), y))
        engine.step()


def snapshot(engine):
    """Parameters and optimizer state, copied."""
    params = {n: t.clone() for n, t in engine.full_parameters().items()}
    state = {}
    for info in engine._params:
        for key, value in engine.optimizer.state.get(info.shard, {}).items():
            state[f"{info.name}.{key}"] = value.clone() if torch.is_tensor(value) else value
    return params, state


def same(a, b):
    pa, sa = a
    pb, sb = b
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa) and \
        sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def saved_checkpoint(folder, steps, client_state):
    """A one-rank checkpoint saved into folder/ckpt after `steps` steps:
    (root, snapshot of what it holds)."""
    engine = engine_of()
    train(engine, steps)
    root = folder / "ckpt"
    engine.save(root, client_state=client_state)
    return root, snapshot(engine)


def copy_of(root, folder):
    """A copy of a checkpoint root in folder/ckpt (links kept as links)."""
    copy = folder / "ckpt"
    shutil.copytree(root, copy, symlinks=True)
    return copy
