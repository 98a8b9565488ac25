"""Optimizer offload (ZeRO-Offload): the offloaded groups' fp32 masters and Adam state live in
host memory and the ``cpu_adam`` plugin steps them; what moves when, and why the host never waits
for the device: docs/zero3.md, "Offload". ``OffloadedOptimizer`` (_optimizer_step.py) shows the
device's and the host's parts as the factory's one optimizer, so LR schedulers and checkpoints
see no difference.

The pipeline (``[zero] offload_pipeline = true``): as soon as an offloaded group's gradient shard
is complete in the backward that syncs gradients, its copy to the host is issued (on cuda on a
copy stream), its cpu_adam step is handed to a worker thread, and the step's copy of the updated
parameters back to the device is issued as soon as it ends, ahead of the next forward, while
backward goes on producing the next groups. ``step()`` then waits for the worker and steps the
rest (the device's groups). ``step_in_backward`` steps on the same worker.

Each group's step is the one the serial path runs (the same plugin call on the same tensors with
the same hyper-parameters and ``grad_scale`` 1), so the pipeline changes when the updates happen,
never their values. What needs every gradient before any update cannot run in the pipeline:
clipping (the global norm is one all-reduce over every group of every rank), fp16 loss scaling
(a step is skipped when any gradient overflowed) and ``measure_grad_norm``; with any of them the
offloaded groups step in ``step()``, after backward, as without the pipeline (their gradients
still go to the host group by group during backward). Likewise the backward that syncs is the
step's: a second one before ``step()`` (accumulation without ``no_sync``), ``clip_grad_norm_()``
after it, or hyper-parameters changed after it would change updates already made, and each is
an IncompatibleError naming the remedy."""

import concurrent.futures
import math
import time
from typing import Any

import torch

from ..._errors import IncompatibleError
from ._gradients import clip_coefficient, global_norm, scale_by

_HYPER = ("lr", "betas", "eps", "weight_decay")


class HostShard:
    """A group's host buffers: the fp32 master (what the optimizer's
    parameters view), the fp32 gradient copy, and under mixed precision the
    rounded copy that goes to the device. The master and the rounded copy
    are made with the group's shards (``attach``)."""

    def __init__(self, group, device, pin):
        pin = bool(pin) and device.type == "cuda"
        self.pinned = pin
        self.master = None
        self.grad = torch.zeros(group.shard_numel, dtype=torch.float32, pin_memory=pin)
        self.grad_views = self.grad.split(group.sizes)
        self.half = None
        self.half_views = None
        self.grad_copied = None   # event: the last gradient copy to the host is done
        self.params_copied = None  # event: the last copy to the device is done
        self.sent = False          # a step's copy to the device was issued, not yet waited on

    def attach(self, group, shard=None):
        """Makes the master (and the rounded copy under mixed precision).
        `shard`: the coordinator's shard when it lives in host memory; it
        serves as the master (fp32) or the rounded copy, so the step writes
        it directly and nothing goes to a device."""
        n = group.shard_numel
        if shard is not None and shard.dtype == torch.float32:
            self.master = shard
        else:
            self.master = torch.zeros(n, dtype=torch.float32, pin_memory=self.pinned)
        if group.dtype != torch.float32:
            self.half = shard if shard is not None else \
                torch.zeros(n, dtype=group.dtype, pin_memory=self.pinned)
            self.half_views = self.half.split(group.sizes)


def _record(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


class OptimizerOffload:
    """Moves and steps the offloaded groups (see the module's docstring)."""

    def __init__(self, groups, device, eager, pipeline=False):
        self.groups = [g for g in groups if g.host is not None]
        self.device = device
        # DuctileCPUAdam over the offloaded shards, set with it
        self.optimizer: Any = None
        # The engine's OffloadedOptimizer (its hyper-parameters), set with it
        self.owner: Any = None
        self.cuda = device.type == "cuda"
        # read only when self.cuda
        self.copy_stream: Any = torch.cuda.Stream(device) if self.cuda else None
        self.eager = eager          # step_in_backward: step each group as its gradient lands
        # offload_pipeline: the sync backward steps each group as its gradient lands when
        # nothing needs every gradient first (``early``, set by the engine's OptimizerStep).
        self.pipeline = bool(pipeline) and not eager
        self.early = False
        self.pipelined = PipelinedStep()
        self.worker = HostWorker() if eager or self.pipeline else None
        self.factors = []           # grad_scale factors of this step (floats, 0-d tensors)
        self.counters = {"offload_grad_copies": 0, "offload_param_copies": 0,
                         "offload_grad_bytes": 0, "offload_param_bytes": 0,
                         "offload_steps": 0, "offload_step_ns": 0, "offload_pipelined_steps": 0}

    # --- backward ------------------------------------------------------------------------

    def gradient_ready(self, group):
        """The group's gradient shard on the device is complete (for now:
        accumulation with sync on completes it again): copy it to the host."""
        host = group.host
        if host is None or group.grad_flat is None:
            return
        if self.cuda:
            # After the group's backward on the compute stream: its shard's
            # gathers are consumed, its gradient shard complete.
            ready = _record(torch.cuda.current_stream(self.device))
            self.copy_stream.wait_event(ready)
            with torch.cuda.stream(self.copy_stream):
                host.grad.copy_(group.grad_flat, non_blocking=True)
            group.grad_flat.record_stream(self.copy_stream)
            host.grad_copied = _record(self.copy_stream)
        else:
            host.grad.copy_(group.grad_flat)
        self.counters["offload_grad_copies"] += 1
        self.counters["offload_grad_bytes"] += host.grad.numel() * host.grad.element_size()
        if self.eager or self.early:
            if self.early:
                if not self.pipelined.stepped:
                    self.pipelined.begin(self.owner)
                self.pipelined.claim(group)
            _, params, grads, outs = self._work(group)
            # The device copy may go: the host copy is what the step reads.
            group.grad_flat = None
            group.grad_views = None
            if not params:
                return  # no member of the group has a gradient on this rank
            if self.early:
                self.counters["offload_pipelined_steps"] += 1
            worker = self.worker
            assert worker is not None  # made when eager or pipelined
            worker.submit(self._step, group, params, grads, outs, 1.0,
                          ready if self.cuda else None)

    # --- the step --------------------------------------------------------------------------

    def scale(self, factor):
        """Multiplies the host gradients by `factor` (a float or a 0-d
        tensor) in this step's update, instead of rewriting them."""
        self.factors.append(factor)

    def unscale(self, grads_on_device, inverse_scale):
        if grads_on_device:
            torch._foreach_mul_(grads_on_device, inverse_scale)
        self.scale(inverse_scale)

    def clip(self, all_grads, device_grads, comm, max_norm, norm_type):
        """Clipping by the global norm: the device's gradient shards are
        scaled in place, the offloaded groups' through grad_scale (their
        norms count with the factors deferred so far: fp16's unscaling)."""
        self.pipelined.check_clip()
        on_device = {id(g) for g in device_grads}
        deferred = [g for g in all_grads if id(g) not in on_device]
        total = global_norm(device_grads, comm, self.device, norm_type, deferred,
                            math.prod(self.factors, start=1.0))
        coefficient = clip_coefficient(total, max_norm)
        scale_by(device_grads, coefficient)
        self.scale(coefficient)
        return total

    def _grad_scale(self):
        # A tensor (the clipping coefficient) is read here: the host needs
        # the number to step (DeepSpeed's CPU Adam reads it too).
        return math.prod((float(f) for f in self.factors), start=1.0)

    def step(self, skip=False):
        """Steps every offloaded group with a gradient (waits for those the
        worker steps, and raises the first error of theirs); after it the
        masters are current and their copies to the device issued."""
        try:
            self.settle()
            if not skip and not self.eager:
                scale = self._grad_scale()
                ready = _record(torch.cuda.current_stream(self.device)) if self.cuda else None
                stepped = self.pipelined.stepped
                for group in self.groups:
                    if group.id in stepped:
                        continue
                    _, params, grads, outs = self._work(group)
                    if params:
                        self._step(group, params, grads, outs, scale, ready)
        finally:
            self.pipelined.reset()
            self.factors = []

    def wait(self):
        """The steps on the worker have ended (their errors raised)."""
        if self.worker is not None:
            self.worker.wait()

    def settle(self):
        """Before the rest of a step: the steps of the backward have ended
        and read the hyper-parameters the step would have."""
        self.wait()
        self.pipelined.check_hyper(self.owner)

    def abandon(self):
        """After a failed step or backward: waits for what the worker runs."""
        if self.worker is not None:
            self.worker.abandon()
        self.pipelined.reset()
        self.factors = []

    def _work(self, group):
        """(group, parameters, gradients, copy-outs) of the members that have
        a gradient, read on the calling thread (the engine may clear the
        ``.grad`` attributes before a worker runs)."""
        host = group.host
        params, grads, outs = [], [], []
        for k, zp in enumerate(group.members):
            if zp.requires_grad and zp.shard.grad is not None:
                params.append(zp.shard)
                grads.append(host.grad_views[k])
                if host.half_views is not None:
                    outs.append(host.half_views[k])
        return group, params, grads, outs if host.half_views is not None else None

    def _step(self, group, params, grads, outs, scale, ready):
        """One group's host step, then its copy to the device, issued after
        `ready` (an event of the compute stream after the last pass read the
        device shard; None on the cpu)."""
        start = time.perf_counter_ns()
        host = group.host
        if host.grad_copied is not None:
            host.grad_copied.synchronize()
        if host.params_copied is not None:
            host.params_copied.synchronize()  # the master (or half) is not read by a copy any more
        self.optimizer.step_parameters(params, grads, outs, grad_scale=scale)
        self._send(group, ready)
        self.counters["offload_steps"] += 1
        self.counters["offload_step_ns"] += time.perf_counter_ns() - start

    # --- to the device ---------------------------------------------------------------------

    def _send(self, group, ready=None):
        """Issues the copy of the updated parameters to the device shard,
        after `ready` (else after what the calling thread's current stream
        has queued)."""
        host = group.host
        source = host.half if host.half is not None else host.master
        if source is group.store:  # a shard in host memory, written by the step itself
            host.sent = True
            return
        if self.cuda:
            if ready is not None:
                self.copy_stream.wait_event(ready)
            else:
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                group.store.copy_(source, non_blocking=host.pinned)
            host.params_copied = _record(self.copy_stream)
        else:
            group.store.copy_(source)
        host.sent = True
        self.counters["offload_param_copies"] += 1
        self.counters["offload_param_bytes"] += group.store.numel() * group.store.element_size()

    def to_device(self, group):
        """Before a pass: the device shard holds the master's values. After
        a step the copy is in flight: the compute stream waits for it. After
        anything else that wrote the master (initial values, a load,
        GatheredParameters) it is copied now, rounded first under mixed
        precision."""
        host = group.host
        if not host.sent:
            if host.params_copied is not None:
                host.params_copied.synchronize()
            if host.half is not None:
                host.half.copy_(host.master)
            self._send(group)
        host.sent = False
        if self.cuda and host.params_copied is not None:
            torch.cuda.current_stream(self.device).wait_event(host.params_copied)

    def masters_changed(self):
        """The masters are (about to be) written outside a step: no step nor
        copy of theirs is in flight any more, and the next pass copies them
        again."""
        self.wait()
        for group in self.groups:
            host = group.host
            if host.params_copied is not None:
                host.params_copied.synchronize()
            host.sent = False

    def close(self):
        if self.worker is not None:
            self.abandon()
            self.worker.close()
            self.worker = None


def place(groups, placement, offload, budget, has_optimizer, step_in_backward, device):
    """Chooses the groups whose optimizer lives on the host and those whose
    parameter shard does (all that `offload` asks for, and what does not fit
    under `budget`) and gives the former host buffers, before their shards
    are made; returns the OptimizerOffload, or None when no group's
    optimizer is offloaded."""
    chosen = placement.choose(budget, offload.optimizer and has_optimizer, offload.ratio,
                              offload.param)
    for group in groups:
        group.shard_on_host = group.id in placement.shards_on_host
    if not chosen:
        return None
    if step_in_backward:
        # Each group is stepped on the host as its gradient lands: all of them.
        chosen.update(g.id for g in groups if g.trained)
    for group in groups:
        if group.id not in chosen:
            continue
        dtype = placement.master_dtype or group.dtype
        if dtype != torch.float32:
            raise IncompatibleError(
                f"zero3: optimizer offload steps fp32 masters; the shards of '{group.name}' are "
                f"{dtype}; valid: float32 parameters, or MixedPrecision with "
                "master_dtype=torch.float32")
        group.host = HostShard(group, device, offload.pin)
        group.host_grad_views = group.host.grad_views  # what the members' shard.grad are
    return OptimizerOffload(groups, device, step_in_backward, offload.pipeline)


class HostWorker:
    """One thread that runs the host steps in the order they are handed
    over. ``wait()`` returns when every step handed over has ended and
    raises the first error of them, the exception the step raised (its
    type, message and traceback), on the calling thread."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="ductile-zero3-offload")
        self.pending: list[concurrent.futures.Future] = []

    def submit(self, fn, *args):
        self.pending.append(self._pool.submit(fn, *args))

    def wait(self):
        pending, self.pending = self.pending, []
        error = None
        for future in pending:  # every one, so that none still runs when this raises
            exception = future.exception()
            if exception is not None and error is None:
                error = exception
        if error is not None:
            raise error

    def abandon(self):
        """Waits for what was handed over and drops its errors (after a
        failure already on its way up)."""
        pending, self.pending = self.pending, []
        for future in pending:
            future.exception()

    def close(self):
        self.abandon()
        self._pool.shutdown(wait=True)


def _plain(value):
    """A hyper-parameter as a comparable value (a tensor's number: a
    scheduler may fill a tensor learning rate in place)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value


class PipelinedStep:
    """What the pipeline stepped during this step's backward, and the
    hyper-parameters it read (``offload_pipeline``)."""

    def __init__(self):
        self.stepped: set[int] = set()  # ids of the groups stepped during backward
        self.hyper = None               # per param group: {key: value} the steps read

    def begin(self, optimizer):
        """Before the first group of a backward is stepped: the plugin's
        param groups take the optimizer's hyper-parameters, which are kept
        to be checked at step()."""
        optimizer.sync_hyper_parameters()
        self.hyper = [{k: _plain(g[k]) for k in _HYPER} for g in optimizer.param_groups]

    def claim(self, group):
        """The group's gradient is complete: it is stepped now. A group
        stepped already in this step means a second backward with
        gradient sync before step()."""
        if group.id in self.stepped:
            raise IncompatibleError(
                f"zero3: a second backward with gradient sync before step(): with [zero] "
                f"offload_pipeline = true the first one already stepped the offloaded group "
                f"'{group.name}' on the host; valid: accumulate micro-batches under "
                "engine.no_sync() (all but the last), or offload_pipeline = false")
        self.stepped.add(group.id)

    def check_clip(self):
        if self.stepped:
            raise IncompatibleError(
                "zero3: clip_grad_norm_() after a backward whose gradients already stepped "
                "the offloaded groups on the host ([zero] offload_pipeline = true): the update "
                "cannot be clipped any more; valid: gradient_clipping in the config (the "
                "offloaded groups then step in step()), or offload_pipeline = false")

    def check_hyper(self, optimizer):
        """At step(): the hyper-parameters are those the steps read."""
        if not self.stepped or self.hyper is None:
            return
        for g, (group, seen) in enumerate(zip(optimizer.param_groups, self.hyper)):
            for key, value in seen.items():
                now = _plain(group[key])
                if now != value:
                    raise IncompatibleError(
                        f"zero3: param group {g}'s {key} changed from {value!r} to {now!r} "
                        "between backward and step(): with [zero] offload_pipeline = true the "
                        "offloaded groups were stepped during backward with the old value; "
                        "valid: set hyper-parameters before backward (an LR scheduler after "
                        "step() does), or offload_pipeline = false")

    def reset(self):
        self.stepped = set()
        self.hyper = None
