"""ZeRO-3 on a real torch.nn model through ductile's coordinator
(ductile.torch.zero3): a small causal LM with its embedding tied to the
head, trained with Adam on 1 rank by plain torch and on 2 and 3 ranks
through zero3 with the same global batch, under torchrun (torch.distributed
over gloo as the world: no MPI) and under mpirun (the cpu accelerator over
Open MPI); checkpoints re-partitioned 2 -> 3 -> 1 ranks; the coordinator's
counters; bad input. The runs gather by module (groups="module": every
module's parameters a group, the finest units, which these small limits
exercise); test_zero3_groups.py runs the default, by transformer block. The
runs are separate processes (zero3_worker.py)."""

import os
import sys
import warnings

import pytest

import torch

import ductile
import ductile.torch.zero3 as zero3

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zero3_launch import CONFIG, launch, launch_batch  # noqa: E402
from zero3_model import Windows, loss_of, make_model  # noqa: E402

STEPS = 30
DEVIATION = "deviates from the recorded trace"


def run(tmp, name, spec, ranks=None, launcher="torchrun"):
    """zero3_worker.py (one process, or `ranks` under `launcher`), gathering
    by module: (result.json, params.pt, stderr)."""
    return launch(tmp, name, dict(spec, groups="module"), ranks=ranks, launcher=launcher)


FEATURES = {"steps": 8, "model": {"reuse_first_block": True}, "external": True,
            "frozen": ["lm.pos.weight"]}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank torchrun runs of the fixtures below, one after another in
    one job:
    - np2: the reference run, its step-10 checkpoint resumed on 3 ranks;
    - features: a module called twice per pass (blocks[0]), a parameter
      used by the root's forward (declared external), a frozen parameter,
      and one no_grad evaluation pass after 8 steps;
    - checkpoint, keyword_calls: 8 steps of the model whose blocks run under
      non-reentrant activation checkpointing, and of the one whose layers
      get their input by keyword.
    Returns (their folder, {name: (result.json, params.pt, stderr)})."""
    tmp = tmp_path_factory.mktemp("zero3_two_ranks")
    specs = {"np2": {"steps": STEPS, "save_at": [10]},
             "features": dict(FEATURES, eval_after=8),
             "checkpoint": {"steps": 8, "model": {"checkpoint": True}},
             "keyword_calls": {"steps": 8, "model": {"keyword_calls": True}}}
    return tmp, launch_batch(tmp, [(name, dict(spec, mode="zero3", groups="module"), CONFIG)
                                   for name, spec in specs.items()], ranks=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, two_ranks):
    tmp = tmp_path_factory.mktemp("zero3")
    r = {}
    r["plain"] = run(tmp, "plain", {"mode": "plain", "steps": STEPS})
    folder, by_name = two_ranks
    r["np2"] = by_name["np2"]
    r["np2_mpirun"] = run(tmp, "np2_mpirun", {"mode": "zero3", "steps": STEPS}, ranks=2,
                          launcher="mpirun")
    r["np3"] = run(tmp, "np3", {"mode": "zero3", "steps": STEPS}, ranks=3)
    # 2 -> 3 -> 1 ranks: resume the 2-rank run's step-10 checkpoint on 3
    # ranks, save at 20, resume that on 1 rank to the end.
    r["np3_resumed"] = run(tmp, "np3_resumed", {
        "mode": "zero3", "start": 10, "steps": 20, "save_at": [20],
        "load": str(folder / "np2" / "step10")}, ranks=3)
    r["np1_resumed"] = run(tmp, "np1_resumed", {
        "mode": "zero3", "start": 20, "steps": STEPS,
        "load": str(tmp / "np3_resumed" / "step20")})
    return r


@pytest.fixture(scope="module")
def features(tmp_path_factory, two_ranks):
    """FEATURES (two_ranks' "features") against plain torch on the same model."""
    _, by_name = two_ranks
    plain = run(tmp_path_factory.mktemp("zero3_features"), "plain", dict(FEATURES, mode="plain"))
    return plain, by_name["features"]


@pytest.fixture(scope="module")
def backward_variants(two_ranks):
    _, by_name = two_ranks
    return {option: by_name[option] for option in ("checkpoint", "keyword_calls")}


def relative(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def assert_losses_match(losses, reference, steps):
    for s in steps:
        a, b = losses[str(s)], reference[str(s)]
        assert relative(a, b) <= 1e-5, f"step {s}: loss {a} vs {b}"


def assert_params_match(params, reference):
    assert params.keys() == reference.keys()
    for name, ref in reference.items():
        diff = (params[name] - ref).abs().max().item()
        assert diff <= 1e-5 * ref.abs().max().item(), f"{name}: max difference {diff}"


@pytest.mark.parametrize("name", ["np2", "np2_mpirun", "np3"])
def test_losses_and_final_parameters_equal_one_rank_without_ductile(runs, name):
    plain, _, _ = runs["plain"]
    result, params, _ = runs[name]
    assert result["world"] == int(name[2])
    assert result["stats"]["world"] == ("accelerator" if "mpirun" in name else
                                         "torch.distributed (gloo)"), result["stats"]["world"]
    assert_losses_match(result["losses"], plain["losses"], range(STEPS))
    assert_params_match(params, runs["plain"][1])
    # The loss fell: the model learned.
    assert result["losses"][str(STEPS - 1)] < 0.8 * result["losses"]["0"]


@pytest.mark.parametrize("name", ["np2", "np3"])
def test_each_rank_holds_its_shard_only(runs, name):
    result = runs[name][0]
    world = result["world"]
    memory = result["memory"]
    params = runs["plain"][1]
    assert memory["placeholder_numel"] == 0  # param.data is empty outside a fetch
    expected = sum(-(-p.numel() // world) for p in params.values())
    assert memory["shard_numel"] == expected
    total = sum(p.numel() for p in params.values()) * 4
    assert memory["parameter_bytes"] == total
    assert total / world <= memory["shard_bytes"] < total / world + 4 * len(params) * world


@pytest.mark.parametrize("name", ["np2", "np3"])
def test_gathered_elements_stay_within_the_live_limit(runs, name):
    bound = runs[name][0]["bound"]
    assert bound["checks"] > STEPS * 20  # read after every fetch and release
    assert bound["worst"] <= 0, f"live elements exceeded the bound by {bound['worst']}"


@pytest.mark.parametrize("name", ["np2", "np3"])
def test_trace_complete_after_the_first_step_then_prefetch(runs, name):
    result = runs[name][0]
    steps = result["per_step"]
    assert steps[0]["trace_mode"] == "complete"
    assert len(result["trace"]) > 0
    for s, counts in enumerate(steps[1:], start=2):
        assert counts["prefetched_params"] > counts["demand_gathered_params"], (s, counts)
        assert counts["trace_invalidations"] == 0
    # The gathered copies come from the pool: once the trace runs with
    # prefetch (from the third pass), no gather allocates.
    assert all(counts["gather_allocations"] == 0 for counts in steps[2:]), \
        [counts["gather_allocations"] for counts in steps]
    # Every parameter that gets a gradient is reduce-scattered once per step
    # (the tied embedding/head weight once, not twice), with its module's
    # others in one collective.
    n_params = len(runs["plain"][1])
    assert all(counts["reduced_params"] == n_params for counts in steps)
    groups = sum(1 for members in result["units"].values() if members)
    assert all(counts["reduced_groups"] == groups for counts in steps)
    assert all(1 <= counts["reduce_scatters"] <= groups for counts in steps)


def test_checkpoint_resumes_at_another_world_size(runs):
    np2 = runs["np2"][0]
    np3r = runs["np3_resumed"][0]
    np1r = runs["np1_resumed"][0]
    assert np3r["client_state"] == {"step": 10}
    assert np1r["client_state"] == {"step": 20}
    assert np3r["world"] == 3 and np1r["world"] == 1
    assert_losses_match(np3r["losses"], np2["losses"], range(10, 20))
    assert_losses_match(np1r["losses"], np2["losses"], range(20, STEPS))
    assert_params_match(runs["np1_resumed"][1], runs["np2"][1])


def test_shared_modules_external_and_frozen_parameters_match_plain_torch(features):
    (plain, plain_params, _), (zero, zero_params, _) = features
    assert_losses_match(zero["losses"], plain["losses"], range(8))
    assert torch.equal(zero_params["lm.pos.weight"], plain_params["lm.pos.weight"])
    assert_params_match(zero_params, plain_params)


def test_activation_checkpointing_trains_as_plain_torch(runs, backward_variants):
    """Blocks under torch.utils.checkpoint(use_reentrant=False): their forward
    runs again inside backward, over parameters the engine keeps gathered
    until each module's backward is done."""
    result = backward_variants["checkpoint"][0]
    assert_losses_match(result["losses"], runs["plain"][0]["losses"], range(8))
    for counts in result["per_step"][1:]:
        assert counts["trace_invalidations"] == 0
        assert counts["prefetched_params"] > counts["demand_gathered_params"]


def test_a_module_is_released_when_its_backward_is_done(runs, backward_variants):
    """The release after a module's backward waits for the gradients of its
    inputs, positional or keyword; a module whose inputs need no gradient
    (the embeddings: token ids) is released at the end of backward."""
    layers = [f"blocks.{i}.{m}" for i in range(4) for m in ("ln1", "qkv", "proj", "ln2", "up",
                                                            "down")]
    baseline = set(runs["np2"][0]["released_in_backward"])
    assert set(layers + ["ln_f", "head"]) <= baseline
    assert not {"embed", "pos"} & baseline
    keywords = backward_variants["keyword_calls"][0]
    assert set(keywords["released_in_backward"]) == baseline
    assert_losses_match(keywords["losses"], runs["plain"][0]["losses"], range(8))


def test_an_eval_pass_invalidates_the_trace_once_and_training_goes_on(features):
    zero, _, stderr = features[1]
    ev = zero["evaluation"]
    assert ev["invalidations"] == 1
    assert ev["warnings"] == 1
    assert stderr.count(DEVIATION) == 1, stderr
    assert ev["live_after_eval"] == 0
    assert ev["mode_at_end"] == "complete"
    assert ev["finite"]


# --- in this process: one rank, no launcher ----------------------------------

def local_engine(model=None, optimizer=True, tmp=None):
    model = model or make_model(layers=1)
    factory = (lambda ps: torch.optim.Adam(ps, lr=1e-3)) if optimizer else None
    return zero3.initialize(model, factory, CONFIG)


def train(engine, steps, start=0):
    windows = Windows(batch=2)
    for s in range(start, start + steps):
        x, y = windows.step(s)
        engine.backward(loss_of(engine(x), y))
        engine.step()


def test_config_errors_name_what_is_missing():
    with pytest.raises(ductile.ConfigError, match=r"no \[zero\] section"):
        zero3.initialize(make_model(layers=1), None, '[accelerator]\nbackend = "cpu"\n')
    with pytest.raises(ductile.ConfigError, match=r"zero_optimization.stage = 0; .* set it to 3"):
        zero3.initialize(make_model(layers=1), None, '{"train_batch_size": 8}')
    with pytest.raises(ductile.InvalidArgumentError, match="config is required"):
        zero3.initialize(make_model(layers=1), None, None)
    with pytest.raises(ductile.InvalidArgumentError, match="torch.nn.Module"):
        zero3.initialize("model", None, CONFIG)


def test_a_dict_is_a_deepspeed_config_here_as_for_load_config():
    """zero3.initialize reads a dict as deepspeed.initialize and
    ductile.load_config do; its precision, clipping and optimizer come
    typed from the pipeline's one pass over the config."""
    ds = {"train_batch_size": 2, "gradient_clipping": 0.5,
          "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000},
          "fp16": {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 7},
          "optimizer": {"type": "Adam", "params": {"lr": 5e-3, "adam_w_mode": False,
                                                   "betas": [0.8, 0.9]}}}
    assert ductile.load_config(ds).format == "deepspeed"
    engine = zero3.initialize(make_model(layers=1), None, ds)
    try:
        assert engine.config.format == "deepspeed"
        assert engine.config.runtime.section("zero")["params"]["prefetch_bucket_size"] == 1000
        assert engine.mixed_precision.param_dtype == torch.float16
        assert engine.mixed_precision.loss_scaler.scale == 2.0 ** 10
        assert engine.gradient_clipping == 0.5
        assert type(engine.optimizer).__name__ == "Adam"
        group = engine.optimizer.param_groups[0]
        assert group["lr"] == 5e-3 and group["betas"] == (0.8, 0.9)
    finally:
        engine.close()
    with pytest.raises(ductile.ConfigError,
                       match=r"<dict>: fp16.hysteresis = 0; valid: an integer >= 1"):
        zero3.initialize(make_model(layers=1), None,
                         dict(ds, fp16={"enabled": True, "hysteresis": 0}))
    with pytest.raises(ductile.ConfigError,
                       match=r'optimizer.type = "SGD"; valid: "Adam", "AdamW"'):
        zero3.initialize(make_model(layers=1), None, dict(ds, optimizer={"type": "SGD"}))
    # ductile's sections as a dict: said so, with the way to pass them.
    sections = {"accelerator": {"backend": "cpu"}, "zero": {"coordinator": "partitioned"}}
    with pytest.raises(ductile.ConfigError, match=r'<dict>: zero is a ductile section, not a '
                                                  r'DeepSpeed key .*format="toml"'):
        zero3.initialize(make_model(layers=1), None, sections)
    engine = zero3.initialize(make_model(layers=1), None,
                              ductile.load_config(sections, format="toml"))
    engine.close()


def test_an_argument_wins_over_the_config_key_and_a_warning_names_the_key():
    """initialize's arguments that say what a config key says replace it,
    each with a UserWarning (from the caller's line) naming the key; an
    argument the config leaves unset warns of nothing."""
    ds = {"train_batch_size": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
          "optimizer": {"type": "Adam", "params": {"lr": 5e-3}}}
    with pytest.warns(UserWarning) as caught:
        engine = zero3.initialize(make_model(layers=1), lambda ps: torch.optim.SGD(ps, lr=0.1),
                                  ds, mixed_precision="fp16")
    try:
        assert engine.mixed_precision.param_dtype == torch.float16
        assert type(engine.optimizer).__name__ == "SGD"
    finally:
        engine.close()
    messages = sorted(str(w.message) for w in caught)
    assert messages == [
        "zero3.initialize: the mixed_precision argument replaces <dict>'s bf16/fp16 section "
        "(an argument given to initialize wins over the config)",
        "zero3.initialize: the optimizer_factory argument replaces <dict>'s optimizer section "
        "(an argument given to initialize wins over the config)"], messages
    assert {w.filename for w in caught} == {__file__}
    offloaded = CONFIG + 'offload_optimizer = "cpu"\n'
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
    with pytest.warns(UserWarning, match=r"the offload_optimizer argument replaces "
                                         r"<string>'s \[zero\] offload_optimizer"):
        engine = zero3.initialize(make_model(layers=1), adam, offloaded, offload_optimizer=False)
    try:
        assert engine.stats()["offloaded_groups"] == []
    finally:
        engine.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero3.initialize(make_model(layers=1), adam, CONFIG, mixed_precision="bf16",
                         offload_optimizer="cpu").close()


def test_unsupported_dtype_names_the_parameter():
    model = make_model(layers=1)
    model.counter = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ductile.InvalidArgumentError, match="parameter 'counter' has dtype"):
        zero3.initialize(model, None, CONFIG)


def test_undeclared_external_parameter_is_a_clear_error():
    import zero3_worker
    model = zero3_worker.ExternalUse(make_model(layers=1))
    engine = zero3.initialize(model, None, CONFIG)
    x, _ = Windows(batch=2).step(0)
    with pytest.raises(ductile.IncompatibleError,
                       match=r"uses parameter 'lm.blocks.0.up.weight'.*register_external"):
        engine(x)
    with pytest.raises(ductile.IncompatibleError, match="before initialize"):
        zero3.register_external_parameter(model, model.lm.blocks[0].up.weight)


def test_one_rank_trains_and_close_gives_the_parameters_back():
    engine = local_engine()
    model = engine.module
    train(engine, 3)
    assert engine.stats()["trace_mode"] == "complete"
    assert all(p.numel() == 0 for p in model.parameters())
    full = engine.full_parameters()
    engine.close()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), full[name])
    assert model.head.weight is model.embed.weight  # still tied
    x, y = Windows(batch=2).step(99)
    loss_of(model(x), y).backward()  # a plain model again


def test_close_gives_back_a_forward_the_model_had_of_its_own():
    """A forward a library set on the model instance before the engine (as
    TRL's fused LM head does) runs under the engine and is the model's again
    after close()."""
    model = make_model(seed=0)
    plain = model.forward
    calls = []

    def patched(*args, **kwargs):
        calls.append(len(args))
        return plain(*args, **kwargs)
    model.forward = patched
    engine = zero3.initialize(model, lambda ps: torch.optim.Adam(ps, lr=1e-3), CONFIG)
    x, y = Windows(batch=2).step(0)
    loss_of(engine(x), y)
    assert calls == [1]
    engine.close()
    assert model.__dict__["forward"] is patched
    model(x)
    assert calls == [1, 1]


def test_the_step_path_says_where_the_pass_is_and_keeps_the_group_state():
    """Where the pass is (TrainingState) and a group's materialisation, as
    the C++ step path keeps them, read from Python inside a block's forward,
    inside its backward and between them."""
    from ductile.torch.zero3._passes import TrainingState
    engine = local_engine()
    passes, block = engine._passes, engine.module.blocks[0]
    (group,) = [g for g in engine._groups if g.name == "blocks.0"]
    assert isinstance(group, ductile._ductile.zero.GroupState)
    seen = []

    def look(where):
        seen.append((where, passes.state, group.users, group.full_address != 0,
                     group.params[0].numel() > 0))

    def after_our_pre_hook(module, args):
        look("forward")

    def after_our_hook(module, args, output):
        look("after forward")
        output.register_hook(lambda grad: look("backward"))  # after the step path's own

    handles = [block.register_forward_pre_hook(after_our_pre_hook),
               block.register_forward_hook(after_our_hook)]
    x, y = Windows(batch=2).step(0)
    assert passes.state == TrainingState.IDLE
    for _ in range(2):
        loss = loss_of(engine(x), y)
        look("between")
        engine.backward(loss)
        look("after backward")
        # The reduced gradient shard is the group's (C++), the members' views of it.
        assert ductile._ductile.zero.grads_attached(group), group.grad_flat
        engine.step()
    for handle in handles:
        handle.remove()
    step = [("forward", TrainingState.FORWARD, 1, True, True),
            ("after forward", TrainingState.FORWARD, 0, False, False),
            ("between", TrainingState.FORWARD, 0, False, False),
            ("backward", TrainingState.BACKWARD, 1, True, True),
            ("after backward", TrainingState.IDLE, 0, False, False)]
    assert seen == step + step
    assert group.full is None and len(passes.live) == 0


def test_a_dropped_engine_frees_its_groups():
    """A group and its members refer to each other through the group's C++
    state; the garbage collector sees that cycle and frees them."""
    import gc
    import weakref
    engine = local_engine()
    train(engine, 1)
    groups = [weakref.ref(g) for g in engine._groups]
    members = [weakref.ref(zp) for g in engine._groups for zp in g.members]
    engine.close()
    del engine
    gc.collect()
    assert [r() for r in groups + members] == [None] * len(groups + members)


def test_module_outputs_reach_the_caller_untouched():
    """A Hugging Face ModelOutput returned by a hooked module is the object
    the module made, and in-place changes of its tensors train as in plain
    torch."""
    from transformers.modeling_outputs import CausalLMOutput

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 3)

        def forward(self, x):
            self.made = CausalLMOutput(logits=self.proj(x))
            return self.made

    torch.manual_seed(0)
    model, plain = Head(), Head()
    plain.load_state_dict(model.state_dict())
    engine = zero3.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.5), CONFIG)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    x = torch.randn(5, 4)
    for _ in range(3):
        out = engine(x)
        assert out is model.made and type(out) is CausalLMOutput
        out.logits.mul_(2)
        engine.backward(out.logits.square().mean())
        engine.step()
        ref = plain(x)
        ref.logits.mul_(2)
        ref.logits.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in engine.full_parameters().items():
        assert torch.allclose(value, dict(plain.named_parameters())[name], rtol=1e-6, atol=1e-7)


def test_all_reduce_refuses_bad_arguments():
    engine = local_engine(optimizer=False)
    with pytest.raises(ductile.InvalidArgumentError, match="op 'avg' is unknown"):
        engine.all_reduce(torch.ones(3), "avg")
    with pytest.raises(ductile.InvalidArgumentError, match="contiguous"):
        engine.all_reduce(torch.ones(3, 3).t())
    assert engine.all_reduce(torch.full((3,), 2.0), "mean").tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ductile.IncompatibleError, match="needs an optimizer"):
        engine.step()


def test_shards_in_nvme_files_train_like_shards_in_memory(tmp_path):
    """Shards kept in files (nvme_path) are copies the engine writes back
    before each pass; the training is the same as with shards in memory."""
    losses = {}
    for where in ("memory", "nvme"):
        config = CONFIG
        if where == "nvme":
            config = config.replace("[zero]\n", f'[zero]\nnvme_path = "{tmp_path / "nvme"}"\n')
        engine = zero3.initialize(make_model(layers=1), lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                  config)
        windows = Windows(batch=2)
        losses[where] = []
        for s in range(4):
            x, y = windows.step(s)
            loss = loss_of(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses[where].append(loss.item())
        if where == "nvme":
            assert engine.stats()["nvme_reads"] > 0
            assert (tmp_path / "nvme" / "rank0").is_dir()
    assert losses["nvme"] == losses["memory"]
