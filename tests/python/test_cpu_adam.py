"""ductile.ops.adam.DuctileCPUAdam (the cpu_adam plugin) against
torch.optim.AdamW and torch.optim.Adam: the same parameters and states to
1e-6 relative after several steps, on random data of many sizes (every
vector tail), with and without weight decay; torch's thread count followed,
with the same bits; torch's state_dict layout both ways; the bf16/fp16
copy; a real training loop; errors."""

import copy
import inspect
import os
import threading

import pytest
import torch

import ductile
from ductile.ops.adam import DeepSpeedCPUAdam, DuctileCPUAdam

SIZES = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 100, 1023, 4097, 65537, 200_003]


def random_tensors(sizes, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * scale for n in sizes]


def run(make_optimizer, initial, steps, seed=0):
    """Steps copies of ``initial`` ``steps`` times with fresh random
    gradients; returns the parameters and the optimizer."""
    params = [p.clone().requires_grad_() for p in initial]
    optimizer = make_optimizer(params)
    for step in range(steps):
        for p, g in zip(params, random_tensors([p.numel() for p in params], seed + step, 0.1)):
            p.grad = g
        optimizer.step()
    return params, optimizer


def assert_same(ours, theirs, opt_ours, opt_theirs, lr=1e-3):
    """1e-6 relative. A parameter near zero is held to 1e-6 of the step size
    (lr) instead: the moments agree bit for bit on this machine, but torch's
    CPU sqrt is not correctly rounded (it differs from the exact one in the
    last bit for about 1 element in 6), so an update can differ from torch's
    in its last bit, which is a large part of a parameter close to zero."""
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * lr)
        sa, sb = opt_ours.state[a], opt_theirs.state[b]
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-6, atol=0)
        assert float(sa["step"]) == float(sb["step"])


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_equals_torch(adamw_mode, weight_decay):
    initial = random_tensors(SIZES, 1)
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    theirs, opt_theirs = run(lambda ps: torch_class(ps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                                    weight_decay=weight_decay, foreach=False),
                             initial, 5)
    ours, opt_ours = run(lambda ps: DuctileCPUAdam(ps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                                   weight_decay=weight_decay,
                                                   adamw_mode=adamw_mode),
                         initial, 5)
    assert_same(ours, theirs, opt_ours, opt_theirs)


def test_equals_torch_with_other_hyper_parameters_and_groups():
    """Two param groups with their own lr and betas (1 - beta1 >= 0.5 takes
    torch's other form of lerp), changed between steps like a schedule."""
    initial = random_tensors([1000, 77, 4096, 5], 2)

    def groups(params):
        return [{"params": params[:2], "lr": 1e-2, "betas": (0.3, 0.6), "eps": 1e-6},
                {"params": params[2:], "weight_decay": 0.1}]

    results = []
    for make in (lambda ps: torch.optim.AdamW(groups(ps), lr=3e-4, weight_decay=0.0,
                                              foreach=False),
                 lambda ps: DuctileCPUAdam(groups(ps), lr=3e-4, weight_decay=0.0)):
        params = [p.clone().requires_grad_() for p in initial]
        optimizer = make(params)
        for step in range(4):
            for p, g in zip(params, random_tensors([p.numel() for p in params], 10 + step)):
                p.grad = g
            optimizer.step()
            for group in optimizer.param_groups:
                group["lr"] *= 0.5
        results.append((params, optimizer))
    (theirs, opt_theirs), (ours, opt_ours) = results
    assert_same(ours, theirs, opt_ours, opt_theirs, lr=1e-2)


def test_without_bias_correction_steps_with_the_raw_moments():
    """DeepSpeed's bias_correction=False, which torch lacks: the update is
    lr * m / (sqrt(v) + eps), computed here in float64 from the states."""
    (p0,) = random_tensors([5000], 3)
    p = p0.clone().requires_grad_()
    optimizer = DuctileCPUAdam([p], lr=1e-2, bias_correction=False, weight_decay=0.0)
    expected = p0.double()
    m = torch.zeros_like(expected)
    v = torch.zeros_like(expected)
    for step in range(3):
        (g,) = random_tensors([5000], 20 + step)
        p.grad = g
        optimizer.step()
        m = 0.9 * m + 0.1 * g.double()
        v = 0.999 * v + 0.001 * g.double() ** 2
        expected = expected - 1e-2 * m / (v.sqrt() + 1e-8)
    torch.testing.assert_close(p.detach().double(), expected, rtol=1e-6, atol=1e-7)


def test_threads_do_not_change_a_bit():
    initial = random_tensors([1_000_003, 129], 4)
    one, _ = run(lambda ps: DuctileCPUAdam(ps, plugin_params={"threads": 1}), initial, 3)
    two, opt = run(lambda ps: DuctileCPUAdam(ps, plugin_params={"threads": 2}), initial, 3)
    assert "2 threads" in opt.implementation
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def cpu_ticks_by_thread():
    """CPU time (user + system, clock ticks) of each thread of this process,
    from /proc/self/task/<tid>/stat."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        ticks[tid] = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


def threads_that_worked(work):
    """How many threads did a real share of `work`'s CPU time: at least a
    quarter of the busiest one's (an idle OpenMP worker that spins a
    moment after a region gets far less)."""
    before = cpu_ticks_by_thread()
    work()
    after = cpu_ticks_by_thread()
    spent = [ticks - before.get(tid, 0) for tid, ticks in after.items()]
    busiest = max(spent)
    assert busiest >= 8, f"the work took {busiest} ticks; too little to tell threads apart"
    return sum(1 for t in spent if t >= busiest / 4)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not os.path.isdir("/proc/self/task"),
                    reason="needs 2 cores and Linux's /proc")
def test_steps_follow_torchs_thread_count_with_the_same_bits():
    """As DeepSpeedCPUAdam: torch.set_num_threads(1) steps on one thread
    (counted from the threads' CPU times, not timed), 2 on two; the plugin
    reads the count at every step, so a change between steps is followed;
    the bits do not depend on it."""
    initial = random_tensors([8_000_037], 12)
    grads = random_tensors([8_000_037], 13, 0.1)
    before = torch.get_num_threads()
    try:
        results, counts = [], []
        for threads in (1, 2):
            p = initial[0].clone().requires_grad_()
            p.grad = grads[0].clone()
            optimizer = DuctileCPUAdam([p], lr=1e-3, weight_decay=0.01)
            torch.set_num_threads(threads)

            def steps():
                for _ in range(40):
                    optimizer.step()
            counts.append(threads_that_worked(steps))
            results.append(p.detach().clone())
        assert counts == [1, 2]
        assert torch.equal(results[0], results[1])
        # The offload engine steps with step_parameters, from a thread of its
        # own under step_in_backward: torch's count holds there too.
        p = initial[0].clone().requires_grad_()
        engine_like = DuctileCPUAdam([p], lr=1e-3, weight_decay=0.01)
        torch.set_num_threads(1)

        counted = []  # counted on the worker, before it ends and its times go
        worker = threading.Thread(target=lambda: counted.append(threads_that_worked(
            lambda: [engine_like.step_parameters([p], grads) for _ in range(40)])))
        worker.start()
        worker.join()
        assert counted == [1]
        assert torch.equal(p.detach(), results[0])
        # A count fixed in plugin_params wins over torch's.
        p = initial[0].clone().requires_grad_()
        p.grad = grads[0].clone()
        fixed = DuctileCPUAdam([p], lr=1e-3, weight_decay=0.01, plugin_params={"threads": 1})
        torch.set_num_threads(2)
        assert threads_that_worked(lambda: [fixed.step() for _ in range(40)]) == 1
    finally:
        torch.set_num_threads(before)


def test_steps_on_torchs_openmp_workers_with_the_pools_bits():
    # torch has loaded its OpenMP runtime: the default steps on its workers
    # (loaded_openmp.hpp says why); "pool" on the plugin's own threads.
    initial = random_tensors([1_000_003, 129], 8)
    shared, opt = run(lambda ps: DuctileCPUAdam(ps, plugin_params={"threads": 2}), initial, 3)
    assert opt.implementation.endswith("2 threads (OpenMP: libgomp.so.1)")
    own, opt = run(lambda ps: DuctileCPUAdam(
        ps, plugin_params={"threads": 2, "threading": "pool"}), initial, 3)
    assert opt.implementation.endswith("2 threads (own pool)")
    for a, b in zip(shared, own):
        assert torch.equal(a, b)


def test_large_moments_lie_in_huge_page_aligned_host_buffers():
    from ductile._ductile.optimizer import HostBuffer
    huge = HostBuffer.huge_page_bytes
    assert huge == 2 << 20
    initial = random_tensors([huge // 4 + 5, 100], 9)  # one above the threshold, one below
    params, opt = run(lambda ps: DuctileCPUAdam(ps), initial, 2)
    big, small = (opt.state[p] for p in params)
    for name in ("exp_avg", "exp_avg_sq"):
        assert big[name].data_ptr() % huge == 0
        assert big[name].shape == params[0].shape and big[name].is_contiguous()
    # torch.frombuffer keeps the buffer alive with the tensor: the moments
    # outlive the optimizer, and a state_dict round trip keeps every bit.
    saved = copy.deepcopy(opt.state_dict())
    moment = big["exp_avg"]
    expected = moment.clone()
    del opt, big, small
    assert torch.equal(moment, expected)
    reloaded = DuctileCPUAdam(params)
    reloaded.load_state_dict(saved)
    state = reloaded.state[params[0]]
    assert state["exp_avg"].data_ptr() % huge == 0  # copied into a buffer of its own
    assert torch.equal(state["exp_avg"], saved["state"][0]["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], saved["state"][0]["exp_avg_sq"])
    # Stepping on from the reloaded state equals stepping on in one run.
    for p, g in zip(params, random_tensors([p.numel() for p in params], 2, 0.1)):
        p.grad = g
    reloaded.step()
    straight, _ = run(lambda ps: DuctileCPUAdam(ps), initial, 3)
    for a, b in zip(params, straight):
        assert torch.equal(a, b)
    buffer = HostBuffer(3)
    assert buffer.nbytes == 3 and bytes(memoryview(buffer)) == b"\0\0\0"
    for bad, message in ((0, "bytes = 0 is out of range"), (1.5, "bytes = 1.5 is not an integer")):
        with pytest.raises(ductile.InvalidArgumentError, match=message):
            HostBuffer(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_of_the_parameters_rounds_as_torch(dtype):
    initial = random_tensors([33, 70_001], 5, 100.0)
    params = [p.clone().requires_grad_() for p in initial]
    optimizer = DuctileCPUAdam(params, lr=1e-2, weight_decay=0.01)
    copies = [torch.zeros(p.numel(), dtype=dtype) for p in params]
    for p, g in zip(params, random_tensors([33, 70_001], 6)):
        p.grad = g
    optimizer.step(fp16_param_groups=[copies])
    for p, copy in zip(params, copies):
        assert torch.equal(copy.view(torch.int16), p.detach().to(dtype).view(torch.int16))


def test_step_parameters_steps_some_with_gradients_given_apart():
    """What zero3's offload calls, a group at a time: the given parameters
    only, with gradients that are not their .grad, scaled by grad_scale (0.5
    on doubled gradients is the step of the gradients), copies rounded."""
    initial = random_tensors([300, 17, 40], 9)
    grads = random_tensors([300, 17, 40], 10)
    whole = [p.clone().requires_grad_() for p in initial]
    reference = DuctileCPUAdam(whole, lr=1e-2, weight_decay=0.01)
    for p, g in zip(whole, grads):
        p.grad = g.clone()
    reference.step()
    params = [p.clone().requires_grad_() for p in initial]
    optimizer = DuctileCPUAdam(params, lr=1e-2, weight_decay=0.01)
    copies = [torch.zeros(p.numel(), dtype=torch.bfloat16) for p in params[1:]]
    optimizer.step_parameters(params[1:], [2 * g for g in grads[1:]], copies, grad_scale=0.5)
    assert torch.equal(params[0].detach(), initial[0]) and len(optimizer.state) == 2
    for p, q, rounded in zip(params[1:], whole[1:], copies):
        assert torch.equal(p.detach(), q.detach())
        expected = p.detach().to(torch.bfloat16)
        assert torch.equal(rounded.view(torch.int16), expected.view(torch.int16))
    with pytest.raises(ductile.InvalidArgumentError, match=r"params\[0\] is not a parameter"):
        optimizer.step_parameters([torch.zeros(3)], [torch.zeros(3)])


def test_state_dict_has_torch_layout_and_loads_both_ways():
    initial = random_tensors([300, 17], 7)
    ours, opt_ours = run(lambda ps: DuctileCPUAdam(ps, lr=1e-3, weight_decay=0.01), initial, 3)
    state = opt_ours.state_dict()
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["state"][0]["step"].dtype == torch.float32  # as torch keeps it
    assert float(state["state"][0]["step"]) == 3

    def continued(make, source_params, source_state, steps):
        params = [p.detach().clone().requires_grad_() for p in source_params]
        optimizer = make(params)
        # A copy, as from a file: load_state_dict keeps the tensors it is given.
        optimizer.load_state_dict(copy.deepcopy(source_state))
        for step in range(steps):
            for p, g in zip(params, random_tensors([p.numel() for p in params], 100 + step, 0.1)):
                p.grad = g
            optimizer.step()
        return params, optimizer

    make_torch = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=False)
    make_ours = lambda ps: DuctileCPUAdam(ps, lr=1e-3, weight_decay=0.01)
    # Ours -> torch and ours -> ours give the same next steps.
    theirs, opt_theirs = continued(make_torch, ours, state, 2)
    again, opt_again = continued(make_ours, ours, state, 2)
    assert_same(again, theirs, opt_again, opt_theirs)
    # Torch -> ours.
    back, opt_back = continued(make_ours, theirs, opt_theirs.state_dict(), 1)
    forward, opt_forward = continued(make_torch, theirs, opt_theirs.state_dict(), 1)
    assert_same(back, forward, opt_back, opt_forward)
    assert float(opt_back.state[back[0]]["step"]) == 6


def test_a_training_loop_gives_torchs_losses():
    def train(make_optimizer):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                    torch.nn.LayerNorm(64), torch.nn.Linear(64, 1))
        optimizer = make_optimizer(model.parameters())
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(256, 32, generator=gen)
        y = torch.randn(256, 1, generator=gen)
        losses = []
        for _ in range(30):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    theirs = train(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=False))
    ours = train(lambda ps: DuctileCPUAdam(ps, lr=1e-2, weight_decay=0.01))
    assert ours[-1] < 0.5 * ours[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)


def test_a_users_optimizer_plugin_steps_torch_tensors():
    """The fixture of docs/writing-a-plugin.md (sign descent on a momentum,
    one state) found on plugin_path, its state kept under its own name."""
    fixture = os.path.join(os.environ["DUCTILE_BINARY_DIR"],
                           "tests/plugins/optimizer/fixture_plugins")
    p = torch.ones(3, requires_grad=True)
    p.grad = torch.tensor([0.5, -2.0, 0.0])
    optimizer = DuctileCPUAdam([p], lr=0.25, betas=(0.5, 0.999), plugin="sign_sgd",
                               plugin_path=[fixture])
    optimizer.step()
    assert torch.equal(p.detach(), torch.tensor([0.75, 1.25, 1.0]))
    assert set(optimizer.state[p]) == {"step", "momentum"}
    assert torch.equal(optimizer.state[p]["momentum"], torch.tensor([0.25, -1.0, 0.0]))


def test_deepspeed_signature_and_name():
    """Swapping the import is the only change: DeepSpeedCPUAdam's
    positional parameters, in its order, with its defaults."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam as Original
    assert DeepSpeedCPUAdam is DuctileCPUAdam
    want = list(inspect.signature(Original.__init__).parameters.values())
    have = list(inspect.signature(DuctileCPUAdam.__init__).parameters.values())
    assert [(p.name, p.default) for p in have[:len(want)]] == [(p.name, p.default) for p in want]
    assert all(p.kind == p.KEYWORD_ONLY for p in have[len(want):])
    assert isinstance(DuctileCPUAdam([torch.zeros(1, requires_grad=True)]), torch.optim.Optimizer)


def test_errors_name_the_argument_and_what_is_valid():
    p = torch.zeros(10, requires_grad=True)
    with pytest.raises(ductile.UnsupportedError, match="amsgrad=True is not supported"):
        DuctileCPUAdam([p], amsgrad=True)
    with pytest.raises(ductile.ConfigError, match="threads"):
        DuctileCPUAdam([p], plugin_params={"threads": -1})
    with pytest.raises(ductile.NotFoundError, match="lamb"):
        DuctileCPUAdam([p], plugin="lamb")

    bad_lr = DuctileCPUAdam([p], lr=-1e-3)
    p.grad = torch.ones(10)
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"lr = -0.001 is invalid; need a finite number >= 0"):
        bad_lr.step()
    assert torch.equal(p.detach(), torch.zeros(10))  # nothing written
    assert len(bad_lr.state[p]) == 0 or float(bad_lr.state[p]["step"]) == 0

    wide = torch.zeros(10, dtype=torch.float64, requires_grad=True)
    wide.grad = torch.ones(10, dtype=torch.float64)
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"param group 0, parameter 0 is a torch.float64 tensor on cpu; "
                             r"valid: a dense, contiguous torch.float32"):
        DuctileCPUAdam([wide]).step()

    q = torch.zeros(10, requires_grad=True)
    q.grad = torch.ones(10)
    with pytest.raises(ductile.InvalidArgumentError, match="fp16_param_groups"):
        DuctileCPUAdam([q]).step(fp16_param_groups=[[torch.zeros(10)]])


def test_malformed_arguments_raise_the_packages_error_naming_them():
    """Three betas, a list as plugin_params, a NaN step in a loaded state and
    fp16_param_groups of the wrong length: InvalidArgumentError naming the
    argument, its value and what is valid, before anything is stepped."""
    p = torch.zeros(10, requires_grad=True)
    for betas in [(0.9, 0.99, 0.9), (0.9,), (0.9, 1.0), "ab", None]:
        with pytest.raises(ductile.InvalidArgumentError,
                           match=r"betas = .* is invalid; valid: a pair \(beta1, beta2\) of "
                                 r"numbers in \[0, 1\)"):
            DuctileCPUAdam([p], betas=betas)
    # A group of its own betas is checked when stepped.
    grouped = DuctileCPUAdam([{"params": [p], "betas": [0.9, 0.99, 0.5]}])
    p.grad = torch.ones(10)
    with pytest.raises(ductile.InvalidArgumentError, match=r"param group 0: betas = \[0.9"):
        grouped.step()

    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"plugin_params = \[\('threads', 2\)\] is a list; valid: None or "
                             r"a dict"):
        DuctileCPUAdam([p], plugin_params=[("threads", 2)])

    stepped = DuctileCPUAdam([p])
    stepped.step()
    state = stepped.state_dict()
    state["state"][0]["step"] = torch.tensor(float("nan"))
    loaded = DuctileCPUAdam([p])
    loaded.load_state_dict(state)
    before = p.detach().clone()
    with pytest.raises(ductile.InvalidArgumentError,
                       match=r"the state of param group 0, parameter 0 has step = tensor\(nan\); "
                             r"valid: a whole number of steps taken"):
        loaded.step()
    assert torch.equal(p.detach(), before)

    q = torch.zeros(10, requires_grad=True)
    q.grad = torch.ones(10)
    for groups, name in [([], "fp16_param_groups = \\[\\] is a list of 0"),
                         ([[]], r"fp16_param_groups\[0\] = \[\] is a list of 0"),
                         (torch.zeros(10), "fp16_param_groups = tensor")]:
        with pytest.raises(ductile.InvalidArgumentError, match=name):
            DuctileCPUAdam([q]).step(fp16_param_groups=groups)
    assert torch.equal(q.detach(), torch.zeros(10))
