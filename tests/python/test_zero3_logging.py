"""The zero3 engine's progress lines: [zero] log_interval (or a DeepSpeed
config's steps_per_print) prints one line every log_interval optimizer steps
through the ``ductile.zero3`` logger, on rank 0 only, with the documented
fields; the key is checked by the schema. A step's line is written at a
later step (or by flush_log, close, the process' exit) with that step's
values, and no step reads a tensor's value on the host for it.

Run as a script (under torchrun), this file is the 2-rank job's worker: it
trains the test LM and writes every record of ``ductile.zero3`` of its rank
to a JSON file."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import ductile
from ductile.torch import zero3
from ductile.torch.zero3 import _progress

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero3_launch import CONFIG, command, environment  # noqa: E402
from zero3_model import Windows, loss_of, make_model  # noqa: E402

FIELDS = ["step", "loss_scale", "lr", "step_time_s", "samples_per_second", "tokens_per_second",
          "peak_memory_bytes", "peak_memory", "gather_wait_ms", "grad_wait_ms"]


def train(engine, steps, rank=0, world=1, windows=None):
    windows = windows or Windows(batch=4, context=16)
    for s in range(steps):
        x, y = windows.step(s, rank, world)
        engine.backward(loss_of(engine(x), y))
        engine.count_batch(x.shape[0], x.numel())
        engine.step()


def model():
    return make_model(d=32, layers=2, context=16)


def adam(shards):
    return torch.optim.AdamW(shards, lr=1e-3)


def records_of(caplog):
    return [r for r in caplog.records if r.name == "ductile.zero3"]


def test_a_line_every_log_interval_steps_with_the_documented_fields(caplog):
    caplog.set_level(logging.INFO, logger="ductile.zero3")
    engine = zero3.initialize(model(), adam, CONFIG + "log_interval = 3\n")
    assert engine.log_interval == 3
    train(engine, 6)
    # Step 6's line waits for the next step, which finds its values there.
    assert [r.zero3_step["step"] for r in records_of(caplog)] == [3]
    train(engine, 1)
    records = records_of(caplog)
    assert [r.zero3_step["step"] for r in records] == [3, 6]
    for record in records:
        fields = record.zero3_step
        assert list(fields) == FIELDS
        assert record.getMessage() == " ".join(
            f"{k}={f'{v:.6g}' if isinstance(v, float) else v}" for k, v in fields.items())
        assert fields["loss_scale"] == 1.0
        assert fields["lr"] == 1e-3
        assert fields["peak_memory"] == "host_rss" and fields["peak_memory_bytes"] > 0
        assert fields["step_time_s"] > 0
        assert fields["gather_wait_ms"] >= 0 and fields["grad_wait_ms"] >= 0
        # 4 windows of 16 tokens a step, over the same wall time.
        assert fields["tokens_per_second"] == pytest.approx(16 * fields["samples_per_second"])
        assert fields["samples_per_second"] == pytest.approx(4 / fields["step_time_s"])


def test_off_by_default_and_set_on_the_engine(caplog):
    caplog.set_level(logging.INFO, logger="ductile.zero3")
    engine = zero3.initialize(model(), adam, CONFIG)
    assert engine.log_interval == 0
    train(engine, 3)
    assert records_of(caplog) == []
    engine.log_interval = 2
    train(engine, 3)  # global steps 4, 5, 6
    assert [r.zero3_step["step"] for r in records_of(caplog)] == [4]
    engine.flush_log()
    assert [r.zero3_step["step"] for r in records_of(caplog)] == [4, 6]
    for bad in (1.5, "2", True, float("nan")):
        with pytest.raises(ductile.InvalidArgumentError) as error:
            engine.log_interval = bad
        assert str(error.value) == (f"zero3: log_interval = {bad!r} is not an integer "
                                    f"({type(bad).__name__}); give an int from 0 to 1000000000")
    # The bound of [zero] log_interval and steps_per_print, where TOML and
    # JSON refuse 2^63 too.
    for bad in (-1, 2 ** 63, 1_000_000_001):
        with pytest.raises(ductile.InvalidArgumentError) as error:
            engine.log_interval = bad
        assert str(error.value) == (f"zero3: log_interval = {bad} is out of range; must be "
                                    "between 0 and 1000000000")
    assert engine.log_interval == 2
    engine.log_interval = 1_000_000_000
    assert engine.log_interval == 1_000_000_000


def test_without_counted_batches_no_rates(caplog):
    caplog.set_level(logging.INFO, logger="ductile.zero3")
    engine = zero3.initialize(model(), adam, CONFIG + "log_interval = 1\n")
    windows = Windows(batch=4, context=16)
    x, y = windows.step(0)
    engine.backward(loss_of(engine(x), y))
    engine.step()
    assert records_of(caplog) == []
    engine.close()  # writes the last step's line
    (record,) = records_of(caplog)
    assert "samples_per_second" not in record.zero3_step
    assert "tokens_per_second" not in record.zero3_step


def test_offload_traffic_is_reported(caplog):
    caplog.set_level(logging.INFO, logger="ductile.zero3")
    engine = zero3.initialize(model(), adam, CONFIG + "log_interval = 2\n",
                              offload_optimizer=True)
    train(engine, 2)
    engine.flush_log()
    (record,) = records_of(caplog)
    fields = record.zero3_step
    stats = engine.stats()
    # Each step copies every offloaded group's gradient shard to the host and
    # its updated parameters back, both fp32 here: as many bytes each way
    # (the counters' totals also hold the parameters' copy at initialize).
    assert fields["offload_to_host_bytes"] == stats["offload_grad_bytes"] // 2 > 0
    assert fields["offload_to_device_bytes"] == fields["offload_to_host_bytes"]
    assert stats["offload_param_bytes"] == 3 * fields["offload_to_device_bytes"]


def test_deepspeed_steps_per_print_is_the_interval(caplog):
    caplog.set_level(logging.INFO, logger="ductile.zero3")
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 2,
              "zero_optimization": {"stage": 3}}
    engine = zero3.initialize(model(), adam, config)
    assert engine.log_interval == 2
    train(engine, 4)
    engine.flush_log()
    assert [r.zero3_step["step"] for r in records_of(caplog)] == [2, 4]


def test_the_deepspeed_engine_logs_every_steps_per_print(caplog):
    import ductile.deepspeed as ds
    caplog.set_level(logging.INFO, logger="ductile.zero3")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "steps_per_print": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}
    engine, *_ = ds.initialize(model=model(), config=config)
    assert engine.zero3.log_interval == 2
    windows = Windows(batch=2, context=16)
    for s in range(4 * 2):  # 4 optimizer steps of 2 micro-batches
        x, y = windows.step(s)
        engine.backward(loss_of(engine(x), y))
        engine.step()
    assert [r.zero3_step["step"] for r in records_of(caplog)] == [2]
    engine.destroy()  # writes the last step's lines
    records = records_of(caplog)
    assert [r.zero3_step["step"] for r in records] == [2, 4]
    for record in records:
        fields = record.zero3_step
        assert list(fields) == FIELDS
        # train_batch_size 4 samples a step, of 16 tokens each (the input ids).
        assert fields["samples_per_second"] == pytest.approx(4 / fields["step_time_s"])
        assert fields["tokens_per_second"] == pytest.approx(16 * fields["samples_per_second"])


def test_each_line_has_the_values_of_its_own_step(caplog):
    """Step N's line, written at step N + 1, holds step N's learning rate (a
    tensor the scheduler fills in place) and counts (tensors), not those of
    the step that writes it."""
    caplog.set_level(logging.INFO, logger="ductile.zero3")
    engine = zero3.initialize(model(), lambda s: torch.optim.AdamW(s, lr=torch.tensor(1e-3)),
                              CONFIG + "log_interval = 1\n")
    engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer,
                                                            lambda step: 1.0 / (step + 1))
    windows = Windows(batch=4, context=16)
    lrs = []
    for s in range(4):
        x, y = windows.step(s)
        engine.backward(loss_of(engine(x), y))
        engine.count_batch(torch.tensor(s + 1), torch.tensor(10 * (s + 1)))
        lrs.append(float(engine.optimizer.param_groups[0]["lr"]))
        engine.step()
        assert [r.zero3_step["step"] for r in records_of(caplog)] == list(range(1, s + 1))
    engine.close()
    records = [r.zero3_step for r in records_of(caplog)]
    assert [f["step"] for f in records] == [1, 2, 3, 4]
    assert [f["lr"] for f in records] == pytest.approx(lrs) == [1e-3, 5e-4, 1e-3 / 3, 2.5e-4]
    for s, fields in enumerate(records):
        assert fields["samples_per_second"] * fields["step_time_s"] == pytest.approx(s + 1)
        assert fields["tokens_per_second"] * fields["step_time_s"] == pytest.approx(10 * (s + 1))


def test_a_line_whose_values_are_on_their_way_waits_for_a_later_step(caplog, monkeypatch):
    """On cuda a line's values come to the host behind an event: a step that
    finds it incomplete leaves the line for a later step (here the event is
    played by ready()); flush_log waits for them."""
    caplog.set_level(logging.INFO, logger="ductile.zero3")
    engine = zero3.initialize(model(), adam, CONFIG + "log_interval = 1\n")
    arrived = [False]
    monkeypatch.setattr(_progress.Deferred, "ready", lambda self: arrived[0])
    train(engine, 3)
    assert records_of(caplog) == []
    arrived[0] = True
    train(engine, 1)
    assert [r.zero3_step["step"] for r in records_of(caplog)] == [1, 2, 3]
    arrived[0] = False
    engine.flush_log()
    assert [r.zero3_step["step"] for r in records_of(caplog)] == [1, 2, 3, 4]


def test_no_step_reads_a_tensor_on_the_host_for_the_lines(caplog, capsys, monkeypatch):
    """Neither engine's steps (forward, backward, step) call item, cpu,
    tolist or float on a tensor (the loss, the gradient norm, a value of a
    line; only torch's optimizer does, on its cpu step counters), with every
    line on (the DeepSpeed drop-in's with its clipping
    norm, the zero3 engine's with a tensor learning rate and tensor counts):
    on cuda each of them would wait for the device."""
    import ductile.deepspeed as ds
    caplog.set_level(logging.INFO, logger="ductile.zero3")
    watched, read = [True], []

    def spy(original):
        def read_on_host(self, *args, **kwargs):
            if watched[0]:
                read.append(self)
            return original(self, *args, **kwargs)
        return read_on_host

    for name in ("item", "cpu", "tolist", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, spy(getattr(torch.Tensor, name)))

    deepspeed, *_ = ds.initialize(model=model(), config={
        "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1, "log_level": "info",
        "wall_clock_breakdown": True, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3}})
    engine = zero3.initialize(model(), lambda s: torch.optim.AdamW(s, lr=torch.tensor(1e-3)),
                              CONFIG + "log_interval = 1\n")
    windows = Windows(batch=4, context=16)
    losses, norms = [], []
    for s in range(3):
        watched[0] = False  # the test's batch
        x, y = windows.step(s)
        watched[0] = True
        loss = loss_of(deepspeed(x), y)
        deepspeed.backward(loss)
        deepspeed.step()
        losses.append(loss)
        norms.append(deepspeed.zero3.grad_norm)
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.count_batch(torch.tensor(4), torch.tensor(64))
        engine.step()
        losses.append(loss)
    watched[0] = False
    assert len(norms) == 3 and all(isinstance(n, torch.Tensor) for n in norms)
    # Only torch's AdamW reads tensors: its step counters (cpu tensors).
    counters = {state["step"].data_ptr() for optimizer in (deepspeed.optimizer, engine.optimizer)
                for state in optimizer.state.values()}
    assert read and {t.data_ptr() for t in read} <= counters
    # The lines of both engines' first two steps were written meanwhile.
    assert [r.zero3_step["step"] for r in records_of(caplog)] == [1, 1, 2, 2]
    assert capsys.readouterr().out.count("skipped=") == 2
    deepspeed.destroy()
    engine.close()
    assert [r.zero3_step["step"] for r in records_of(caplog)] == [1, 1, 2, 2, 3, 3]
    assert capsys.readouterr().out.count("skipped=") == 1
    logging.getLogger("ductile.deepspeed").setLevel(logging.WARNING)


@pytest.mark.parametrize("value, message", [
    ("-1", "[zero] log_interval = -1 is out of range: must be between 0 and 1000000000"),
    ("1000000001",
     "[zero] log_interval = 1000000001 is out of range: must be between 0 and 1000000000"),
    ("2.5", "[zero] log_interval must be an integer, got float 2.5"),
    ('"often"', "[zero] log_interval must be an integer"),
])
def test_log_interval_is_checked_by_the_schema(value, message):
    with pytest.raises(ductile.ConfigError) as error:
        zero3.initialize(model(), adam, CONFIG + f"log_interval = {value}\n")
    assert message in str(error.value)


def test_steps_per_print_has_the_bound_of_log_interval():
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}
    engine = zero3.initialize(model(), adam, dict(config, steps_per_print=1_000_000_000))
    assert engine.log_interval == 1_000_000_000
    for bad in (1_000_000_001, 2 ** 63):
        with pytest.raises(ductile.ConfigError) as error:
            zero3.initialize(model(), adam, dict(config, steps_per_print=bad))
        assert str(error.value) == (f"<dict>: steps_per_print = {bad}; valid: an integer from 1 "
                                    "to 1000000000")


def test_two_ranks_log_on_rank_0_only(tmp_path):
    proc = subprocess.run(command(2, "torchrun", os.path.abspath(__file__), str(tmp_path)),
                          capture_output=True, text=True, timeout=200, env=environment())
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((tmp_path / f"records-rank{r}.json").read_text()) for r in range(2)]
    assert ranks[1] == []
    assert [fields["step"] for fields in ranks[0]] == [2, 4, 6]
    for fields in ranks[0]:
        assert list(fields) == FIELDS
        # Both ranks' windows: 4 a step in all, 16 tokens each.
        assert fields["samples_per_second"] == pytest.approx(4 / fields["step_time_s"])
        assert fields["tokens_per_second"] == pytest.approx(16 * fields["samples_per_second"])


def _worker(out):
    """One rank of the 2-rank job: every record of ductile.zero3 into
    records-rank<r>.json."""
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.zero3_step)

    logger = logging.getLogger("ductile.zero3")
    logger.addHandler(Keep())
    engine = zero3.initialize(model(), adam, CONFIG + "log_interval = 2\n")
    train(engine, 6, rank, world)
    engine.flush_log()
    with open(os.path.join(out, f"records-rank{rank}.json"), "w") as f:
        json.dump(records, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
