"""One rank of a zero3 test run (not a test by itself; test_zero3.py starts
it, under mpirun for more than one rank).

  zero3_worker.py SPEC.json [SPEC.json ...]

(several specs: one run after another, in the same process group.)

SPEC keys: mode ("plain": torch alone, one process; "zero3"), out (folder),
steps, start (first step, after `load`), load (checkpoint folder or null),
save_at (steps after which to save to out/step<k>), zero_config (TOML path),
model (TiedLM keyword arguments), external (declare the root's use of
blocks[-1].up.weight), frozen (parameter names that get no gradient),
eval_after (after this many steps: one no_grad pass, then two more steps),
lr, save_root (save every checkpoint into out/root instead of out/step<k>),
kill_on_save and kill ("RANK:OPERATION:K": at the kill_on_save-th save,
rank RANK sends itself SIGKILL before its K-th OPERATION of the save, see
_checkpoint_files.fs), dump_at (steps after which rank 0 writes the whole
parameters to out/params-step<k>.pt), device ("cpu", the default, or "cuda":
the model and batches on the GPU, torch.distributed over NCCL), groups (zero3.initialize's
groups: "auto", the default, or "module"), compile (each block under torch.compile, in both
modes), profile_calls (after training, rank 0 counts the Python calls of 2 more steps under
cProfile). Rank 0 writes out/result.json
(per-step losses, coordinator counters, the modules released while backward
ran) and out/params.pt (the final parameters, whole).

Mode "load_error": load `load` (or each of `loads`, one after another),
expecting an error; every rank writes out/result-rank<r>.json with the
error's class and message, the seconds the load took and whether the
parameters and optimizer state are unchanged (a list with `loads`).

Started by torchrun (TORCHELASTIC_RUN_ID in the environment) or by
`ductile agent` (MASTER_ADDR), the worker initialises torch.distributed
(gloo) and zero3 runs over its process group; under mpirun, over Open MPI.
"""

import atexit
import json
import os
import re
import signal
import sys
import time

import torch
import torch.nn as nn

from zero3_model import Windows, loss_of, make_model

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)


class ExternalUse(nn.Module):
    """TiedLM whose root forward also reads blocks[-1].up.weight (a
    parameter of another module)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        logits = self.lm(tokens)
        w = self.lm.blocks[-1].up.weight  # (4 d, d) = (vocab, d) in the tests' sizes
        return logits + 0.01 * (logits[..., :w.shape[1]] @ w.t())


def build(spec):
    model = make_model(seed=0, **spec.get("model", {})).to(spec.get("device", "cpu"))
    if spec.get("compile"):
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    if spec.get("external"):
        model = ExternalUse(model)
    for name, p in model.named_parameters():
        if name in spec.get("frozen", []):
            p.requires_grad_(False)
    return model


def run_plain(spec):
    model = build(spec)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                 lr=spec.get("lr", 3e-3))
    windows = Windows()
    losses = {}
    device = spec.get("device", "cpu")
    for s in range(spec.get("start", 0), spec["steps"]):
        x, y = (t.to(device) for t in windows.step(s))
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[s] = loss.item()
    os.makedirs(spec["out"], exist_ok=True)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
               os.path.join(spec["out"], "params.pt"))
    with open(os.path.join(spec["out"], "result.json"), "w") as f:
        json.dump({"losses": losses}, f)


def init_distributed(device="cpu"):
    """torch.distributed (gloo, NCCL on cuda) when a torch-style launcher
    started us."""
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "MASTER_ADDR" not in os.environ:
        return
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        # Before the interpreter finalises: a gloo thread that drops the last
        # reference to a finished all-gather's tensors after that point needs
        # the GIL, cannot have it, and the process aborts ("terminate called
        # without an active exception"; 2 runs in 6 on a loaded 2-core machine).
        atexit.register(dist.destroy_process_group)


def kill_hook(spec, rank):
    """The _checkpoint test hook of `kill` for this rank, or None."""
    who, operation, k = spec["kill"].split(":")
    if int(who) != rank:
        return None
    seen = [0]

    def hook(op, path):
        if op == operation:
            seen[0] += 1
            if seen[0] == int(k):
                os.kill(os.getpid(), signal.SIGKILL)
    return hook


def run_load_error(spec):
    import ductile.torch.zero3 as zero3

    engine = zero3.initialize(build(spec), lambda ps: torch.optim.Adam(ps, lr=3e-3),
                              spec["zero_config"])
    windows = Windows()
    x, y = windows.step(0, engine.rank, engine.world_size)
    engine.backward(loss_of(engine(x), y))
    engine.step()
    before = engine.full_parameters()
    state = [t.clone() for s in engine.optimizer.state.values() for t in s.values()]
    results = []
    for root in spec.get("loads") or [spec["load"]]:  # one after another, same engine
        start = time.monotonic()
        error = None
        try:
            engine.load(root)
        except Exception as e:  # noqa: BLE001 - reported to the test
            error = e
        seconds = time.monotonic() - start
        after = engine.full_parameters()
        unchanged = all(torch.equal(before[n], after[n]) for n in before) and all(
            torch.equal(a, b) for a, b in zip(state, [t for s in engine.optimizer.state.values()
                                                      for t in s.values()]))
        results.append({"rank": engine.rank, "class": type(error).__name__,
                        "message": str(error), "seconds": seconds, "unchanged": unchanged})
    with open(os.path.join(spec["out"], f"result-rank{engine.rank}.json"), "w") as f:
        json.dump(results if "loads" in spec else results[0], f)


def run_zero3(spec):
    import ductile.torch.zero3 as zero3
    from ductile.torch.zero3 import _checkpoint_files as _checkpoint

    model = build(spec)
    if spec.get("external"):
        zero3.register_external_parameter(model, model.lm.blocks[-1].up.weight)
    engine = zero3.initialize(model, lambda params: torch.optim.Adam(params, lr=spec.get("lr", 3e-3)),
                              spec["zero_config"], groups=spec.get("groups", "auto"))
    rank, world = engine.rank, engine.world_size
    stats = engine.stats()
    memory = {
        "shard_bytes": stats["shard_bytes"], "parameter_bytes": stats["parameter_bytes"],
        "placeholder_numel": sum(p.data.numel() for p in model.parameters()),
        "shard_numel": sum(p.numel() for p in engine.shard_parameters()),
    }
    bound = {"worst": 0, "checks": 0}
    released_in_backward = set()

    def check_live(event, module, s):
        bound["checks"] += 1
        over = s["live_numel"] - (s["max_live_numel"] + s["largest_module_numel"])
        bound["worst"] = max(bound["worst"], over)
        if event == "release" and engine._backward_active:
            released_in_backward.add(module)

    engine.module_callback = check_live
    client = engine.load(spec["load"]) if spec.get("load") else None
    windows = Windows()
    losses, per_step = {}, []
    before = engine.stats()
    saves = 0

    device = spec.get("device", "cpu")

    def train_step(s):
        x, y = (t.to(device) for t in windows.step(s, rank, world))
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        return engine.all_reduce(loss.detach().clone(), "mean").item()

    for s in range(spec.get("start", 0), spec["steps"]):
        losses[s] = train_step(s)
        after = engine.stats()
        per_step.append({k: after[k] - before[k] for k in (
            "gathers", "demand_gathered_params", "prefetched_params", "trace_invalidations",
            "trace_warnings", "reduce_scatters", "reduced_groups", "reduced_params",
            "gather_allocations")})
        per_step[-1]["trace_mode"] = after["trace_mode"]
        before = after
        if s + 1 in spec.get("dump_at", []):
            dumped = engine.full_parameters()
            if rank == 0:
                torch.save(dumped, os.path.join(spec["out"], f"params-step{s + 1}.pt"))
        if s + 1 in spec.get("save_at", []):
            saves += 1
            if spec.get("kill") and saves == spec.get("kill_on_save"):
                _checkpoint._fault_hook = kill_hook(spec, rank)
            where = "root" if spec.get("save_root") else f"step{s + 1}"
            engine.save(os.path.join(spec["out"], where), client_state={"step": s + 1})
        engine.check_invariants()

    full = engine.full_parameters()
    evaluation = None
    if spec.get("eval_after") is not None:
        x, y = (t.to(device) for t in windows.step(10_000, rank, world))
        start = engine.stats()
        with torch.no_grad():
            eval_loss = loss_of(engine(x), y)
        after_eval = engine.stats()
        extra = [train_step(10_001 + i) for i in range(3)]
        end = engine.stats()
        evaluation = {
            "loss": eval_loss.item(), "finite": all(map(lambda v: v == v, extra)),
            "invalidations": end["trace_invalidations"] - start["trace_invalidations"],
            "warnings": end["trace_warnings"] - start["trace_warnings"],
            "mode_after_eval": after_eval["trace_mode"], "mode_at_end": end["trace_mode"],
            "live_after_eval": after_eval["live_numel"],
        }

    def quiet_step(batch):
        """A step as a training loop runs it: nothing read back to the host."""
        x, y = batch
        engine.backward(loss_of(engine(x), y))
        engine.clip_grad_norm_(1.0)
        engine.step()

    calls = None
    if spec.get("profile_calls"):
        engine.module_callback = None  # the test's own Python, not the engine's
        batches = [tuple(t.to(device) for t in windows.step(s, rank, world))
                   for s in (20_000, 20_001)]
        calls = profile_calls(quiet_step, batches, engine)
    sync_debug = None
    if spec.get("sync_debug"):
        sync_debug = steps_without_a_sync(engine, windows, rank, world, device)

    final = engine.stats()
    if rank == 0:
        os.makedirs(spec["out"], exist_ok=True)
        torch.save(full, os.path.join(spec["out"], "params.pt"))
        with open(os.path.join(spec["out"], "result.json"), "w") as f:
            json.dump({"losses": losses, "per_step": per_step, "memory": memory,
                       "bound": bound, "world": world, "client_state": client,
                       "evaluation": evaluation, "trace": engine.trace(),
                       "units": engine.units(), "calls": calls, "sync_debug": sync_debug,
                       "released_in_backward": sorted(released_in_backward),
                       "stats": {k: v for k, v in final.items()}}, f)


def steps_without_a_sync(engine, windows, rank, world, device):
    """3 steps (forward, backward, clipping, optimizer) under torch's sync
    debug mode "error": any call that synchronises the host with the GPU
    raises. Returns the time the coordinator's fetches blocked the host."""
    batches = [tuple(t.to(device) for t in windows.step(s, rank, world))
               for s in range(30_000, 30_003)]
    torch.cuda.synchronize()
    waited = engine.stats()["fetch_wait_ns"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches:
            engine.backward(loss_of(engine(x), y))
            engine.clip_grad_norm_(1.0)
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return {"steps": len(batches), "fetch_wait_ns": engine.stats()["fetch_wait_ns"] - waited}


# Calls that can make the host wait for a device: a collective's wait or a
# completion poll, reading a tensor's value, synchronising a stream.
BLOCKING = re.compile(r"\b(wait|item|tolist|synchronize|is_completed|query|__bool__|__float__)\b")


def profile_calls(train_step, batches, engine):
    """Python function calls per step of the steps on `batches` (by file: ductile's own,
    and all), the calls that can block the host, by name, torch's
    collectives, and the groups the coordinator gathered meanwhile."""
    import cProfile
    import pstats
    before = engine.stats()
    # The engine's gathers and reduce-scatters by direct exchange on gloo
    # (_world.py): collectives too, which cProfile does not see
    # as such.
    exchanges = getattr(engine.comm, "exchanges", None)
    exchanges_before = dict(exchanges) if exchanges is not None else {}
    profiler = cProfile.Profile()
    profiler.enable()
    for batch in batches:
        train_step(batch)
    profiler.disable()
    after = engine.stats()
    gathered = sum(after[k] - before[k] for k in ("demand_gathered_params", "prefetched_params"))
    import ductile
    # The package's own files: a checkout folder may be named "ductile" too,
    # and the test's model code is not the engine's.
    package = os.path.dirname(os.path.abspath(ductile.__file__)) + os.sep
    total = ours = completion = 0
    blocking, by_name, ours_by_function = {}, {}, {}
    optimizer = f"{os.sep}torch{os.sep}optim{os.sep}"
    for (path, _, name), (_, calls, _, _, callers) in pstats.Stats(profiler).stats.items():
        total += calls
        if path.endswith(f"{os.sep}_world.py") and \
                name in ("query", "wait", "<genexpr>"):
            # How often the coordinator polls a collective before it
            # completes is the machine's timing, not the engine's work.
            completion += calls
        elif path.startswith(package):
            ours += calls
            key = f"{os.path.basename(path)}:{name}"
            ours_by_function[key] = ours_by_function.get(key, 0) + calls / 2
        if path == "~" and BLOCKING.search(name):
            # torch's optimizers read their step counters (cpu tensors): not
            # the engine's, and no device wait.
            engine_calls = sum(c[1] for caller, c in callers.items() if optimizer not in caller[0])
            if engine_calls:
                blocking[name] = blocking.get(name, 0) + engine_calls
        if path.endswith("distributed_c10d.py"):
            by_name[name] = by_name.get(name, 0) + calls
    # The collectives issued: torch.distributed's (the older name calls the
    # newer), and the direct exchanges that replace them on gloo.
    collectives = {
        "all_gather": max(by_name.get("all_gather_single", 0),
                          by_name.get("all_gather_into_tensor", 0)),
        "reduce_scatter": max(by_name.get("reduce_scatter_single", 0),
                              by_name.get("reduce_scatter_tensor", 0)),
        "all_reduce": by_name.get("all_reduce", 0)}
    for key, before_count in exchanges_before.items():
        collectives[key] += exchanges[key] - before_count
    collectives["all_gather"] += after["host_world_exchanges"] - before["host_world_exchanges"]
    # The host world's waits in C++ (planned gathers), which cProfile does
    # not see.
    for key, name in (("host_world_waits", "host world (C++): wait"),
                      ("host_world_polls", "host world (C++): is_completed")):
        if after[key] > before[key]:
            blocking[name] = after[key] - before[key]
    return {"all": total / 2, "ductile": ours / 2, "ductile_completion": completion / 2,
            "ductile_by_function": ours_by_function,
            "blocking": {k: v / 2 for k, v in blocking.items()},
            "collectives": {k: v / 2 for k, v in collectives.items()},
            "gathered_groups": gathered / 2,
            "gathers": (after["gathers"] - before["gathers"]) / 2,
            "reduce_scatters": (after["reduce_scatters"] - before["reduce_scatters"]) / 2,
            "reduced_groups": (after["reduced_groups"] - before["reduced_groups"]) / 2}


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            spec = json.load(f)
        if spec.get("device") == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if spec["mode"] != "plain":
            init_distributed(spec.get("device", "cpu"))
        {"plain": run_plain, "zero3": run_zero3, "load_error": run_load_error}[spec["mode"]](spec)
