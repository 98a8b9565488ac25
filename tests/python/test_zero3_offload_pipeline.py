"""zero3's offload pipeline (``[zero] offload_pipeline = true``): the
backward that syncs gradients steps each offloaded group on a worker thread
as soon as its gradient is on the host. Against the serial path (the same
engine without the key):

- the same losses and parameters, bit for bit, on one rank (this process)
  and on 2 ranks over gloo (torchrun jobs of zero3_offload_worker.py), in
  fp32 and bf16, with accumulation under no_sync() and an LR schedule;
- with gradient clipping the offloaded groups step in step(), as without
  the pipeline, with the same losses bit for bit;
- an error of a host step on the worker thread is raised by step() on the
  training thread, the step's own exception and message;
- close() leaves no worker thread behind;
- the key is a boolean of the [zero] section;
- what would change updates already made (a second backward with sync,
  clip_grad_norm_ after backward, a learning rate changed between backward
  and step) is an IncompatibleError naming the remedy."""

import os
import sys
import threading

import pytest

import torch

import ductile
import ductile.torch.zero3 as zero3

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_launch import BLOCKS_CONFIG, CONFIG, launch_batch  # noqa: E402
from zero3_model import Windows, loss_of, make_model  # noqa: E402

WORKER = os.path.join(HERE, "zero3_offload_worker.py")
PIPELINE = "[zero]\noffload_pipeline = true\n"
PIPELINED_BLOCKS = BLOCKS_CONFIG.replace("[zero]\n", PIPELINE)
PIPELINED = CONFIG.replace("[zero]\n", PIPELINE)
assert PIPELINED_BLOCKS != BLOCKS_CONFIG and PIPELINED != CONFIG
STEPS = 5
TRAINING = {"steps": STEPS, "accumulate": 2, "no_sync": True, "offload": "cpu"}
THREAD = "ductile-zero3-offload"


def assert_identical(result, reference):
    (a, params_a, _), (b, params_b, _) = result, reference
    assert a["losses"] == b["losses"]
    assert params_a.keys() == params_b.keys()
    for key, ref in params_b.items():
        assert torch.equal(params_a[key], ref), key


def test_two_ranks_train_bit_for_bit_as_the_serial_path(tmp_path):
    bf16 = dict(TRAINING, precision="bf16", optimizer="adamw")
    r = launch_batch(tmp_path, [("serial", TRAINING, BLOCKS_CONFIG),
                                ("pipelined", TRAINING, PIPELINED_BLOCKS),
                                ("bf16_serial", bf16, BLOCKS_CONFIG),
                                ("bf16_pipelined", bf16, PIPELINED_BLOCKS)],
                     ranks=2, launcher="torchrun", worker=WORKER, timeout=400)
    for name in ("", "bf16_"):
        serial, pipelined = r[name + "serial"], r[name + "pipelined"]
        assert_identical(pipelined, serial)
        stats, serial_stats = pipelined[0]["stats"], serial[0]["stats"]
        groups = stats["groups"]
        assert len(stats["offloaded_groups"]) == groups
        # Every group of every step stepped during its backward; the serial
        # path stepped them all in step().
        assert stats["offload_pipelined_steps"] == groups * STEPS
        assert serial_stats["offload_pipelined_steps"] == 0
        assert stats["offload_steps"] == serial_stats["offload_steps"] == groups * STEPS


# --- in this process: one rank, no launcher ------------------------------------------------


def engine_of(config, layers=2, lr=2e-3, **kwargs):
    return zero3.initialize(make_model(layers=layers), lambda ps: torch.optim.Adam(ps, lr=lr),
                            config, offload_optimizer="cpu", **kwargs)


def train(engine, steps=4, accumulate=2, schedule=True):
    """Losses of `steps` steps of `accumulate` micro-batches (all but the
    last under no_sync()), with an LR schedule stepped after each step."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer,
                                                  lambda s: 1.0 / (1 + 0.2 * s)) \
        if schedule else None
    windows = Windows(batch=2 * accumulate)
    losses = []
    for s in range(steps):
        x, y = windows.step(s)
        for k in range(accumulate):
            xs, ys = x[2 * k:2 * k + 2], y[2 * k:2 * k + 2]
            if k < accumulate - 1:
                with engine.no_sync():
                    engine.backward(loss_of(engine(xs), ys) / accumulate)
            else:
                loss = loss_of(engine(xs), ys) / accumulate
                engine.backward(loss)
        engine.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def run(config, clipping=None, **kwargs):
    engine = engine_of(config, **kwargs)
    try:
        if clipping is not None:
            engine.gradient_clipping = clipping
        losses = train(engine)
        full = engine.full_parameters()
        stats = engine.stats()
    finally:
        engine.close()
    return losses, full, stats


def test_one_rank_trains_bit_for_bit_as_the_serial_path():
    losses, full, stats = run(PIPELINED)
    serial_losses, serial_full, serial_stats = run(CONFIG)
    assert losses == serial_losses
    for key, ref in serial_full.items():
        assert torch.equal(full[key], ref), key
    assert stats["offload_pipelined_steps"] == stats["groups"] * 4
    assert serial_stats["offload_pipelined_steps"] == 0


def test_with_clipping_the_offloaded_groups_step_in_step():
    """The clipping coefficient needs the global norm, which needs every
    gradient: nothing is stepped during backward, and the updates are the
    serial path's, clipped."""
    losses, full, stats = run(PIPELINED, clipping=1e-3)
    serial_losses, serial_full, _ = run(CONFIG, clipping=1e-3)
    assert stats["offload_pipelined_steps"] == 0
    assert losses == serial_losses
    for key, ref in serial_full.items():
        assert torch.equal(full[key], ref), key
    unclipped, _, _ = run(CONFIG)
    assert unclipped[1:] != losses[1:], "the clipping must bind"


def workers():
    return [t for t in threading.enumerate() if t.name.startswith(THREAD)]


def test_a_host_step_error_is_raised_by_step_on_the_training_thread():
    engine = engine_of(PIPELINED)
    seen = []

    def failing(params, grads, copy_out=None, grad_scale=1.0):
        seen.append(threading.current_thread().name)
        raise ValueError("the host step failed: 3 of 7 parameters")
    try:
        engine._offload.optimizer.step_parameters = failing
        x, y = Windows(batch=2).step(0)
        engine.backward(loss_of(engine(x), y))
        with pytest.raises(ValueError, match=r"^the host step failed: 3 of 7 parameters$"):
            engine.step()
        assert seen and all(name.startswith(THREAD) for name in seen), seen
        assert threading.current_thread().name == "MainThread"
    finally:
        engine.close()


def test_close_leaves_no_worker_thread():
    before = workers()
    engine = engine_of(PIPELINED)
    train(engine, steps=2, accumulate=1, schedule=False)
    assert len(workers()) == len(before) + 1
    engine.close()
    assert workers() == before


def test_what_would_change_updates_already_made_is_refused():
    engine = engine_of(PIPELINED)
    windows = Windows(batch=2)
    try:
        x, y = windows.step(0)
        engine.backward(loss_of(engine(x), y))
        with pytest.raises(ductile.IncompatibleError,
                           match=r"clip_grad_norm_\(\) after a backward whose gradients already "
                                 r"stepped the offloaded groups .*offload_pipeline = true.*valid: "
                                 r"gradient_clipping"):
            engine.clip_grad_norm_(1.0)
        with pytest.raises(ductile.IncompatibleError,
                           match=r"a second backward with gradient sync before step\(\).*valid: "
                                 r"accumulate micro-batches under engine.no_sync\(\)"):
            engine.backward(loss_of(engine(x), y))
    finally:
        engine.close()
    engine = engine_of(PIPELINED, lr=2e-3)
    try:
        x, y = windows.step(0)
        engine.backward(loss_of(engine(x), y))
        engine.optimizer.param_groups[0]["lr"] = 1e-3
        with pytest.raises(ductile.IncompatibleError,
                           match=r"param group 0's lr changed from 0.002 to 0.001 between "
                                 r"backward and step\(\).*valid: set hyper-parameters before "
                                 r"backward"):
            engine.step()
        # The failed step is over: the next ones run.
        train(engine, steps=2, accumulate=1, schedule=False)
    finally:
        engine.close()


def test_the_key_is_a_boolean_of_the_zero_section():
    from ductile.torch.zero3 import _settings
    toml = '[accelerator]\nbackend = "cpu"\n[zero]\noffload_optimizer = "cpu"\n'
    assert _settings.resolve(toml + "offload_pipeline = true\n", None, None, None).offload.pipeline
    assert not _settings.resolve(toml, None, None, None).offload.pipeline
    with pytest.raises(ductile.ConfigError,
                       match=r"\[zero\] offload_pipeline must be a boolean, got string 'yes'"):
        _settings.resolve(toml + 'offload_pipeline = "yes"\n', None, None, None)
