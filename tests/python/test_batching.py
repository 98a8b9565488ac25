"""ductile.batching.pack against `ductile pack --json` (a subprocess) on every
reference packing vector, with every option of the CLI; zero-copy input;
bad input raising with the CLI's message; plotting."""

import array
import os
import re

import numpy as np
import pytest

import ductile
from ductile import batching
from conftest import cli_error, data, read_jsonl, run_cli

VECTORS = read_jsonl(data("reference", "pack_vectors.jsonl"))
RULES = ["linear", "sqrt", "none"]


def options_for(i, args):
    """Pack options for vector i: DeepSpeed's arguments, plus the other
    options of `ductile pack` in rotation (sampler, budget, ranks, LR rule
    and schedule)."""
    o = {"max_tokens": args["max_tokens"], "min_batch_size": args["min_batch_size"],
         "max_batch_size": args["max_batch_size"] or 0,
         "effective_batch_size": args["effective_batch_size"],
         "ranks": 1 + i % 3, "lr_rule": RULES[i % 3], "base_batch_size": 4 + i % 5,
         "base_lr": 1e-3 * (1 + i % 4)}
    if args["required_microbatches_of_same_size"]:
        o["same_size_microbatches"] = True
    if i % 4 == 3:
        o["sampler"] = "bfd"
    else:
        o["order"] = args["sequence_picking_order"]
        o["seed"] = args["seed"]
    if i % 5 == 0:
        o["budget"] = "padded"
    if i % 3 == 0:
        o.update(schedule="warmup_cosine", warmup_steps=2, total_steps=7, min_lr=1e-5)
    elif i % 3 == 1:
        o.update(schedule="warmup_linear", warmup_steps=1, total_steps=4)
    return o


def cli_args(lengths_file, o):
    args = ["pack", "--lengths", lengths_file, "--json"]
    for key, value in o.items():
        flag = "--" + key.replace("_", "-")
        if key == "same_size_microbatches":
            args.append("--same-size-microbatches")
        elif key == "lr_rule":
            args += ["--lr-rule", value]
        else:
            args += [flag, value]
    return args


def api_spelling(message):
    return re.sub(r"--([a-z][a-z-]*)", lambda m: m.group(1).replace("-", "_"), message)


def test_pack_equals_the_cli_on_every_reference_vector(tmp_path):
    lengths_file = tmp_path / "lengths.txt"
    compared = errors = deepspeed_checked = 0
    for i, v in enumerate(VECTORS):
        lengths = np.array(v["seqlens"], dtype=np.int64)
        lengths_file.write_text("\n".join(map(str, v["seqlens"])) + "\n")
        o = options_for(i, v["args"])
        code, cli, err = run_cli(*cli_args(lengths_file, o))
        assert code in (0, 2), err
        if code == 2:
            errors += 1
            with pytest.raises(ductile.Error) as info:
                batching.pack(lengths, **o)
            assert type(info.value).__name__ in (cli["error"]["type"],
                                                 cli["error"]["type"] + "Error")
            # Options are spelled as keyword arguments here, as flags there.
            assert str(info.value) == api_spelling(cli["error"]["message"]), f"vector {i}"
            continue
        plan = batching.pack(lengths, **o)
        ours = plan.to_json()
        for key in ("microbatch_ids", "batch_sizes", "batch_max_seqlens", "dropped_ids",
                    "leftover_ids", "ranks"):
            assert ours[key] == cli[key], f"vector {i}: {key}"
        assert ours["lrs"] == pytest.approx(cli["lrs"], rel=1e-15, abs=0), f"vector {i}"
        compared += 1
        # DeepSpeed's own answer (greedy, sum budget: its algorithm): every
        # micro-batch it emits, in order.
        expect = v["expect"]
        if o.get("sampler", "greedy") == "greedy" and "budget" not in o and "error" not in expect:
            n = len(expect["microbatch_ids"])
            assert ours["microbatch_ids"][:n] == expect["microbatch_ids"], f"vector {i}"
            assert ours["batch_sizes"][:len(expect["batch_sizes"])] == expect["batch_sizes"]
            deepspeed_checked += 1
    assert compared + errors == len(VECTORS) == 200
    assert compared > 100 and deepspeed_checked > 50


def test_input_is_read_in_place_and_outputs_are_numpy():
    lengths = np.array([5, 3, 8, 2, 7, 1, 4, 4, 6, 2], dtype=np.int64)
    plan = batching.pack(lengths, max_tokens=10, effective_batch_size=2, ranks=2)
    for other in (array.array("q", lengths.tolist()), memoryview(lengths), lengths.tolist()):
        assert batching.pack(other, max_tokens=10, effective_batch_size=2,
                             ranks=2).to_json() == plan.to_json()
    assert plan.sample_ids.dtype == np.int64 and plan.lengths is lengths
    for r, mine in enumerate(plan.rank_microbatches):
        assert (plan.microbatch_ranks[mine] == r).all()


def test_torch_tensors_are_accepted_without_copying():
    import torch
    t = torch.tensor([5, 3, 8, 2, 7, 1], dtype=torch.int64)
    plan = batching.pack(t, max_tokens=10)
    assert plan.to_json() == batching.pack(t.numpy(), max_tokens=10).to_json()


def test_bad_input_raises_with_the_cli_message(tmp_path):
    with pytest.raises(ductile.InvalidArgumentError, match="int64.*format 'd'"):
        batching.pack(np.array([1.5, 2.0]), max_tokens=10)
    with pytest.raises(ductile.InvalidArgumentError, match="int64"):
        batching.pack(np.array([1, 2], dtype=np.int32), max_tokens=10)
    with pytest.raises(ductile.InvalidArgumentError, match="1-D"):
        batching.pack(np.ones((2, 2), dtype=np.int64), max_tokens=10)
    with pytest.raises(ductile.InvalidArgumentError, match="contiguous"):
        batching.pack(np.arange(1, 9, dtype=np.int64)[::2], max_tokens=10)
    with pytest.raises(ductile.InvalidArgumentError, match="sample 1 has length -2"):
        batching.pack(np.array([1, -2, 3], dtype=np.int64), max_tokens=10)
    with pytest.raises(ductile.InvalidArgumentError, match="max_tokens"):
        batching.pack(np.array([1, 2], dtype=np.int64))
    # Files: the same message as the CLI.
    bad = tmp_path / "bad.txt"
    bad.write_text("4\n-3\n5\n")
    with pytest.raises(ductile.InvalidArgumentError) as info:
        batching.read_lengths(bad)
    assert cli_error("pack", "--lengths", bad, "--max-tokens", 8, "--json") == (
        "InvalidArgument", str(info.value))
    # Bad options: the same class and message as the CLI for the same input
    # (options spelled as keyword arguments here, as flags there).
    good = tmp_path / "good.txt"
    good.write_text("1\n2\n3\n")
    cases = [
        (dict(lr_rule="cubic", base_batch_size=2), ["--lr-rule", "cubic", "--base-batch-size", 2]),
        (dict(sampler="knapsack"), ["--sampler", "knapsack"]),
        (dict(budget="tight"), ["--budget", "tight"]),
        (dict(order="backwards"), ["--order", "backwards"]),
        (dict(min_batch_size=-1), ["--min-batch-size", -1]),
        (dict(effective_batch_size=0), ["--effective-batch-size", 0]),
        (dict(max_tokens=0), ["--max-tokens", 0]),
        (dict(lr_rule="sqrt", base_batch_size=2, schedule="warmup_cosine", warmup_steps=5,
              total_steps=5),
         ["--lr-rule", "sqrt", "--base-batch-size", 2, "--schedule", "warmup_cosine",
          "--warmup-steps", 5, "--total-steps", 5]),
        (dict(lr_rule="sqrt", base_batch_size=2, schedule="step"),
         ["--lr-rule", "sqrt", "--base-batch-size", 2, "--schedule", "step"]),
    ]
    for kwargs, flags in cases:
        kwargs.setdefault("max_tokens", 8)
        if "--max-tokens" not in flags:
            flags = flags + ["--max-tokens", 8]
        with pytest.raises(ductile.Error) as info:
            batching.pack(np.array([1, 2, 3], dtype=np.int64), **kwargs)
        kind, message = cli_error("pack", "--lengths", good, *flags, "--json")
        assert str(info.value) == api_spelling(message), kwargs
        assert type(info.value) in (ductile._errors.error_class("invalid_argument"),
                                    ductile._errors.error_class("not_found"),
                                    ductile._errors.error_class("config")), kwargs
        assert kind in ("InvalidArgument", "NotFound", "ConfigError"), kwargs
    with pytest.raises(ductile.InvalidArgumentError, match="base_batch_size"):
        batching.pack([1, 2, 3], max_tokens=8, lr_rule="sqrt")
    with pytest.raises(ductile.InvalidArgumentError, match="ranks -2 is out of range"):
        batching.pack([1, 2, 3], max_tokens=8, ranks=-2)


def test_settings_from_a_toml_and_a_deepspeed_config_match_the_cli(tmp_path):
    lengths_file = data("lengths", "debian_fortunes_word_lengths.txt")
    toml = tmp_path / "job.toml"
    toml.write_text(f'[batching]\nsampler = "greedy"\nmax_tokens = 600\norder = "random"\n'
                    f'seed = 7\neffective_batch_size = 4\nlengths = "{lengths_file}"\n'
                    '[lr]\nrule = "sqrt"\nbase_batch_size = 32\nbase_lr = 0.01\n'
                    'schedule = "warmup_linear"\nwarmup_steps = 10\ntotal_steps = 200\n')
    kwargs, lengths_spec = batching.settings_from_config(toml)
    plan = batching.pack(batching.read_lengths(**lengths_spec), **kwargs)
    code, cli, err = run_cli("pack", "--config", toml, "--json")
    assert code == 0, err
    assert plan.to_json()["microbatch_ids"] == cli["microbatch_ids"]
    assert plan.lrs.tolist() == cli["lrs"]
    # A DeepSpeed config whose metrics_path holds DeepSpeed-written files.
    metrics = tmp_path / "curriculum_output" / "seqlen"
    metrics.mkdir(parents=True)
    for ext in (".bin", ".idx"):
        src = data("lengths", "deepspeed_metric", "azure_conv_seqlen_u16" + ext)
        (metrics / ("seqlen_sample_to_metric" + ext)).write_bytes(open(src, "rb").read())
    ds = {"train_batch_size": 16, "optimizer": {"type": "Adam", "params": {"lr": 3e-4}},
          "data_efficiency": {"enabled": True, "seed": 42, "data_sampling": {"dynamic_batching": {
              "enabled": True, "max_tokens": 4096, "lr_scaling_method": "sqrt",
              "sequence_picking_order": "random", "min_batch_size": 1, "max_batch_size": 10,
              "metrics_path": str(tmp_path / "curriculum_output")}}}}
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(__import__("json").dumps(ds))
    for source in (ds, ds_file):
        kwargs, lengths_spec = batching.settings_from_config(source)
        plan = batching.pack(batching.read_lengths(**lengths_spec), **kwargs)
        code, cli, err = run_cli("pack", "--config", ds_file, "--json")
        assert code == 0, err
        assert plan.to_json()["microbatch_ids"] == cli["microbatch_ids"]
        assert plan.lrs.tolist() == cli["lrs"] and kwargs["lr_rule"] == "sqrt"


def test_plot_writes_a_picture(tmp_path):
    lengths = batching.read_lengths(data("lengths", "debian_fortunes_word_lengths.txt"))
    plan = batching.pack(lengths, max_tokens=400, order="random", effective_batch_size=4,
                         lr_rule="sqrt", base_batch_size=40, schedule="warmup_linear",
                         warmup_steps=5, total_steps=100)
    out = batching.plot(plan, tmp_path / "plan.png", max_steps=20)
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 10_000


def test_step_padding_share_is_the_padding_of_each_steps_padded_micro_batches():
    lengths = batching.read_lengths(data("lengths", "debian_fortunes_word_lengths.txt"))
    plan = batching.pack(lengths, max_tokens=400, order="random", effective_batch_size=4)
    real, positions = [0] * plan.step_count, [0] * plan.step_count
    for i, ids in enumerate(plan.microbatches()):
        step = plan.microbatch_steps[i]
        real[step] += sum(int(lengths[j]) for j in ids)
        positions[step] += len(ids) * max(int(lengths[j]) for j in ids)
    expect = [1 - r / p for r, p in zip(real, positions)]
    assert plan.step_padding_share() == pytest.approx(expect, abs=1e-12)
    assert max(expect) > 0.05  # random order: real padding, not a plan of equal lengths


def test_plot_without_learning_rates_draws_the_padding_panels_too(tmp_path):
    plan = batching.pack([5, 9, 3, 7, 7, 2, 8, 1], max_tokens=16, effective_batch_size=2)
    out = batching.plot(plan, tmp_path / "plan.svg")
    text = open(out).read()
    for label in ("padding share (%)", "positions a micro-batch (all steps)", "batch size"):
        assert label in text


def test_plot_of_a_long_plan_draws_a_bounded_figure(tmp_path):
    # 10^6 samples in steps of 64 micro-batches: the first 1000 steps hold
    # 64000 micro-batches; the figure draws at most 4000 of them.
    lengths = np.random.default_rng(0).integers(1, 200, 1_000_000, dtype=np.int64)
    plan = batching.pack(lengths, max_tokens=256, effective_batch_size=64)
    assert plan.step_count > batching.MAX_PLOT_STEPS
    out = batching.plot(plan, tmp_path / "plan.svg", max_steps=batching.MAX_PLOT_STEPS)
    text = open(out).read()
    bars = len(re.findall(r'<g id="patch_', text))
    # Two bars per micro-batch drawn, one per step, the histograms' and the
    # axes' own: far below one per micro-batch of the plan.
    assert bars <= 2 * batching.MAX_PLOT_MICROBATCHES + batching.MAX_PLOT_STEPS + 200
    assert f"the first {batching.MAX_PLOT_MICROBATCHES}" in text


@pytest.mark.parametrize("max_steps, message", [
    (10 ** 12, "plot: max_steps = 1000000000000 is out of range; must be between 1 and 1000"),
    (0, "plot: max_steps = 0 is out of range; must be between 1 and 1000"),
    (-5, "plot: max_steps = -5 is out of range; must be between 1 and 1000"),
    (float("nan"), "plot: max_steps = nan is not an integer (float); give an int from 1 to 1000"),
    (2.0, "plot: max_steps = 2.0 is not an integer (float); give an int from 1 to 1000"),
    ("60", "plot: max_steps = '60' is not an integer (str); give an int from 1 to 1000"),
])
def test_plot_refuses_a_bad_max_steps_naming_it(tmp_path, max_steps, message):
    plan = batching.pack([5, 9, 3, 7], max_tokens=16, effective_batch_size=2)
    with pytest.raises(ductile.InvalidArgumentError) as error:
        batching.plot(plan, tmp_path / "plan.png", max_steps=max_steps)
    assert str(error.value) == message
    assert not (tmp_path / "plan.png").exists()


def test_plot_raises_when_the_file_cannot_be_written(tmp_path):
    plan = batching.pack([5, 9, 3, 7], max_tokens=16, effective_batch_size=2)
    with pytest.raises(ductile.IoError) as error:
        batching.plot(plan, "/dev/full")
    assert str(error.value) == "plot: cannot write '/dev/full': No space left on device"
    with pytest.raises(ductile.IoError, match="plot: cannot write '.*/missing/plan.png': No such "
                                              "file or directory"):
        batching.plot(plan, tmp_path / "missing" / "plan.png")
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"plot: path '.*plan.xyz' names the format 'xyz'; valid: a path "
                             r"ending in .*\.png"):
        batching.plot(plan, tmp_path / "plan.xyz")


@pytest.mark.parametrize("option, value, message", [
    ("max_tokens", 2 ** 63, "max_tokens = 9223372036854775808 is out of range; must be between "
                            "-9223372036854775808 and 9223372036854775807"),
    ("max_tokens", True, "max_tokens = True is not an integer \\(bool\\); give an int"),
    ("max_tokens", 8.5, "max_tokens = 8.5 is not an integer \\(float\\); give an int"),
    ("max_tokens", float("nan"), "max_tokens = nan is not an integer \\(float\\)"),
    ("ranks", 0.9, "ranks = 0.9 is not an integer \\(float\\)"),
    ("ranks", 2 ** 62, "ranks 4611686018427387904 is out of range; must be between 0 and "
                       "1048576"),
    ("order", "\udc80", "order = '\\\\udc80' is not valid text: it holds a lone surrogate"),
    ("order", 3, "order = 3 is not a string \\(int\\); give a str"),
    ("same_size_microbatches", 1, "same_size_microbatches = 1 is not a bool \\(int\\)"),
    ("base_lr", "0.1", "base_lr = '0.1' is not a number \\(str\\)"),
])
def test_options_are_converted_strictly_and_named(option, value, message):
    kwargs = {"max_tokens": 8, option: value}
    with pytest.raises(ductile.InvalidArgumentError, match=message):
        batching.pack([3, 4], **kwargs)


def test_numpy_integers_are_integers():
    plan = batching.pack(np.array([3, 4]), max_tokens=np.int64(8), ranks=np.int32(2))
    assert plan.microbatch_count >= 1
