"""Gradients: their reduce-scatter into flat gradient shards after each unit's backward,
clipping, overflow checks, mixed precision and loss scaling."""

import math
import time

import torch

from ... import _ductile
from ..._errors import InvalidArgumentError
from ._world import Done

# Mixed precision (docs/zero3.md, "Mixed precision"): ``MixedPrecision(param_dtype, reduce_dtype,
# master_dtype)`` are the dtypes parameters are gathered and computed in (None: the model's own),
# gradients are reduced in, and the optimizer's shards, its state and the gradient shards are kept
# in (a master copy when it differs from param_dtype). fp16 needs loss scaling:
# ``DynamicLossScaler`` follows DeepSpeed's and torch.amp.GradScaler's rule.

_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def as_dtype(value, what):
    if value is None or isinstance(value, torch.dtype):
        if value not in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise InvalidArgumentError(f"zero3: {what} = {value} is not a floating dtype; valid: "
                                       "torch.float32, torch.bfloat16, torch.float16")
        return value
    dtype = _NAMES.get(str(value).lower())
    if dtype is None:
        raise InvalidArgumentError(f"zero3: {what} = {value!r} is not valid; valid: 'fp32', "
                                   "'bf16', 'fp16' or a torch dtype")
    return dtype


class MixedPrecision:
    """See the module's docstring. ``loss_scale``: None (fp32/bf16: none;
    fp16: a DynamicLossScaler with its defaults), a number (static), or a
    DynamicLossScaler."""

    def __init__(self, param_dtype=None, reduce_dtype=torch.float32,
                 master_dtype=torch.float32, loss_scale=None):
        self.param_dtype = as_dtype(param_dtype, "param_dtype")
        self.reduce_dtype = as_dtype(reduce_dtype, "reduce_dtype")
        self.master_dtype = as_dtype(master_dtype, "master_dtype")
        if loss_scale is None and self.param_dtype == torch.float16:
            loss_scale = DynamicLossScaler()
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            if not math.isfinite(loss_scale) or loss_scale <= 0:
                raise InvalidArgumentError(
                    f"zero3: loss_scale = {loss_scale} must be a positive finite number")
            loss_scale = StaticLossScaler(float(loss_scale))
        self.loss_scaler = loss_scale

    def __repr__(self):
        return (f"MixedPrecision(param_dtype={self.param_dtype}, reduce_dtype="
                f"{self.reduce_dtype}, master_dtype={self.master_dtype}, "
                f"loss_scaler={self.loss_scaler!r})")


class StaticLossScaler:
    dynamic = False

    def __init__(self, scale):
        self.scale = scale
        self.skipped_steps = 0

    def update(self, overflow):
        if overflow:
            self.skipped_steps += 1

    def state_dict(self):
        return {"scale": self.scale, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self):
        return f"StaticLossScaler({self.scale})"


class DynamicLossScaler:
    """DeepSpeed's defaults: 2^16, window 1000, hysteresis 2, minimum 1."""

    dynamic = True

    def __init__(self, initial_scale=2.0 ** 16, growth_interval=1000, hysteresis=2,
                 min_scale=1.0, factor=2.0):
        for name, v in (("initial_scale", initial_scale), ("min_scale", min_scale),
                        ("factor", factor)):
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise InvalidArgumentError(f"zero3: loss scaler {name} = {v!r} must be positive")
        if int(growth_interval) < 1 or int(hysteresis) < 1:
            raise InvalidArgumentError("zero3: loss scaler growth_interval and hysteresis must "
                                       "be at least 1")
        self.scale = float(initial_scale)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.factor = float(factor)
        self._good_steps = 0
        self._hysteresis_left = self.hysteresis
        self.skipped_steps = 0

    def update(self, overflow):
        if overflow:
            self.skipped_steps += 1
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / self.factor, self.min_scale)
                self._hysteresis_left = self.hysteresis
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= self.factor
            self._hysteresis_left = self.hysteresis

    def state_dict(self):
        return {"scale": self.scale, "good_steps": self._good_steps,
                "hysteresis_left": self._hysteresis_left, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self):
        return f"DynamicLossScaler(scale={self.scale})"


def from_training(training):
    """A MixedPrecision from a DeepSpeed config's precision settings, as the
    pipeline read and checked them (``_ductile.Runtime.from_deepspeed``'s
    training dict), or None (fp32)."""
    if training["precision"] == "bf16":
        return MixedPrecision(torch.bfloat16)
    if training["precision"] != "fp16":
        return None
    if training["loss_scale"]:
        return MixedPrecision(torch.float16, loss_scale=training["loss_scale"])
    scaler = DynamicLossScaler(initial_scale=2.0 ** training["initial_scale_power"],
                               growth_interval=training["loss_scale_window"],
                               hysteresis=training["hysteresis"],
                               min_scale=training["min_loss_scale"])
    return MixedPrecision(torch.float16, loss_scale=scaler)


# Unscaling, the overflow check and clipping work on the groups' flat gradient shards (a handful
# of big tensors, torch's foreach kernels) and never wait on the host, except for fp16's overflow
# decision, as torch.amp.GradScaler does.


def gradient_tensors(groups):
    """The gradient shards of `groups`: each group's flat shard while its
    members still hold views of it, else the members' own gradients."""
    out = []
    for group in groups:
        if _ductile.zero.grads_attached(group):
            out.append(group.grad_flat)
        else:
            out.extend(zp.shard.grad for zp in group.members if zp.shard.grad is not None)
    return out


def unscale(grads, scale):
    if grads:
        torch._foreach_mul_(grads, 1.0 / scale)


def overflow(grads, comm, device):
    """True when a gradient shard of any rank holds inf or NaN (collective;
    the host reads the answer)."""
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        finite = torch.stack([torch.isfinite(n) for n in torch._foreach_norm(grads, 1.0)])
        flag = (~finite).any().float().reshape(1)
    comm.all_reduce(flag, "max").wait()
    return bool(flag.item())


def global_norm(grads, comm, device, norm_type, scaled=(), scale=1.0):
    """The norm of `grads` and of `scaled` multiplied by `scale` (gradients
    whose unscaling is deferred: the offloaded groups'), over every rank's
    shards: a 0-d float32 tensor, the same on every rank (collective)."""
    norms = list(torch._foreach_norm(grads, norm_type)) if grads else []
    if scaled:
        norms += [n * scale for n in torch._foreach_norm(scaled, norm_type)]
    if math.isinf(norm_type):
        local = torch.zeros((), dtype=torch.float32, device=device)
        if norms:
            local = torch.stack(norms).float().max()
        local = local.reshape(1)
        comm.all_reduce(local, "max").wait()
        return local.reshape(())
    local = torch.zeros((), dtype=torch.float64, device=device)
    if norms:
        local = torch.stack(norms).double().pow(norm_type).sum()
    local = local.reshape(1)
    comm.all_reduce(local, "sum").wait()
    return local.reshape(()).pow(1.0 / norm_type).float()


def clip_coefficient(total, max_norm):
    """What clipping multiplies the gradients by (a 0-d float64 tensor on
    total's device): max_norm / total when that is below 1; 1 when the norm
    is within max_norm or not finite (nothing is clipped then)."""
    coefficient = max_norm / (total.double() + 1e-6)
    keep = torch.logical_or(coefficient >= 1.0, ~torch.isfinite(total))
    return torch.where(keep, torch.ones_like(coefficient), coefficient)


def clip(grads, comm, device, max_norm, norm_type):
    """Scales `grads` so that the norm over every rank's shards is at most
    max_norm; returns that norm (before clipping) as a 0-d float32 tensor,
    the same on every rank. A non-finite norm clips nothing."""
    total = global_norm(grads, comm, device, norm_type)
    scale_by(grads, clip_coefficient(total, max_norm))
    return total


def scale_by(grads, coefficient):
    """Multiplies `grads` in place by the 0-d tensor `coefficient`, one
    foreach call a dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, same in by_dtype.items():
        torch._foreach_mul_(same, coefficient.to(dtype))


# fp16 loss scaling (torch.amp.GradScaler's part). With optimizer offload the offloaded groups'
# host gradients are never rewritten: their unscaling is folded into the cpu_adam plugin's
# ``grad_scale`` (_offload.py), and only the device's shards are divided.


class LossScaling:
    """The loss scaler of one engine, over its gradient shards."""

    def __init__(self, scaler, groups, offload, comm, device):
        self.scaler = scaler
        self.groups = groups
        self.device_groups = [g for g in groups if g.host is None]  # not offloaded
        self.offload = offload
        self.comm = comm
        self.device = device
        self.unscaled = False  # the gradient shards are unscaled for this step

    def unscale(self):
        """Divides the gradient shards by the loss scale (once a step)."""
        if self.unscaled:
            return
        if self.offload is not None:
            self.offload.unscale(gradient_tensors(self.device_groups),
                                 1.0 / self.scaler.scale)
        else:
            unscale(gradient_tensors(self.groups), self.scaler.scale)
        self.unscaled = True

    def update(self):
        """Before a step: unscales, checks every rank's gradient shards for
        inf or NaN (collective) and updates the scale; True when the step
        must be skipped."""
        self.unscale()
        skip = overflow(gradient_tensors(self.groups), self.comm, self.device)
        self.scaler.update(skip)
        return skip


# Gradients by group (docs/zero3.md, "Gradients" and "Gradient accumulation"): a unit's full
# gradients are laid out rank-major in one flat buffer by one C++ call a group
# (``_ductile.zero.take_gradients``, python/src/group_gradients.hpp), cast to the reduce dtype by
# that copy, reduce-scattered (small groups share a bucket) and added to the gradient shard in the
# master dtype, so bf16 compute still sums in fp32. A member without a gradient on this rank adds
# zeros: every rank must issue the same collectives. With ``on_group_ready`` set
# (step_in_backward) each group is handed over as soon as its reduce-scatter completes.

_take_gradients = _ductile.zero.take_gradients
_add_grad_shard = _ductile.zero.add_grad_shard


class GradientReducer:
    """Reduce-scatters of one engine's gradients, group by group, into the
    groups' gradient shards.

    `max_inflight_bytes`: the layout buffers handed to reduce-scatters not
    yet complete are kept within it (the oldest is finished first), so that
    a transport slower than backward (gloo's one worker thread) cannot pile
    up every full gradient of the model; a larger bucket goes alone, once
    those before it are finished. A transport runs its collectives one
    after another, so a deeper queue would not finish them sooner: it
    would only hold more layouts at the backward's peak (GPT-2 of 41.7 M
    parameters on 2 ranks: 170 MB more with twice the largest group, 131 MB,
    allowed in flight than with 16 MiB).
    `bucket_bytes`: the layout bytes (what a rank sends) up to which groups
    wait for others to share a reduce-scatter (0: one a group)."""

    def __init__(self, comm, reduce_dtype=None, max_inflight_bytes=16 << 20,
                 bucket_bytes=4 << 20):
        self._comm = comm
        self._world = comm.size
        self._reduce_dtype = reduce_dtype
        self._max_inflight = max_inflight_bytes
        self._bucket_limit = bucket_bytes
        self._inflight = 0
        self._bucket = []    # (group, send, mask) waiting to share a collective
        self._bucket_bytes = 0
        self._pending = []   # (entries, send, recv, work) in issue order
        self.sync = True
        self.on_group_ready = None  # called with a group whose gradient shard is complete
        self.counters = {"reduce_scatters": 0, "reduced_groups": 0, "reduced_params": 0,
                         "reduced_numel": 0, "grad_wait_ns": 0, "accumulated_grads": 0}

    def reduce(self, group):
        """Reduce-scatters the gradients the group's parameters hold now
        (none: nothing to do) and drops them: at once, or with the next
        groups when it is small (see the module's notes)."""
        if not group.trained:
            return
        dtype = self._reduce_dtype or group.dtype
        taken = _take_gradients(group, self._world, dtype)
        if taken is None:
            return
        send, mask = taken
        if not self.sync:
            if group.accumulated is None:
                group.accumulated = send
                group.accumulated_mask = mask
            else:
                group.accumulated.add_(send)
                group.accumulated_mask = [a or b for a, b in zip(group.accumulated_mask, mask)]
            self.counters["accumulated_grads"] += sum(mask)
            return
        if group.accumulated is not None:
            send.add_(group.accumulated)
            mask = [a or b for a, b in zip(group.accumulated_mask, mask)]
            group.accumulated = None
            group.accumulated_mask = None
        if self._bucket and self._bucket[0][1].dtype != send.dtype:
            self._issue()  # one collective, one dtype
        self._bucket.append((group, send, mask))
        self._bucket_bytes += send.numel() * send.element_size()
        self.counters["reduced_groups"] += 1
        self.counters["reduced_params"] += sum(mask)
        self.counters["reduced_numel"] += send.numel()
        if self._bucket_bytes >= self._bucket_limit:
            self._issue()
        # Completed ones give their layout buffers back at once.
        while self._pending and self._pending[0][3].query():
            self._finish(self._pending.pop(0))

    def _issue(self):
        """Starts the reduce-scatter of the groups in the bucket."""
        entries, self._bucket = self._bucket, []
        self._bucket_bytes = 0
        if not entries:
            return
        if len(entries) == 1:
            send = entries[0][1]
        else:  # side by side: rank r's slices of every group, then rank r + 1's
            send = torch.cat([entry[1] for entry in entries], dim=1)
        nbytes = send.numel() * send.element_size()
        while self._pending and self._inflight + nbytes > self._max_inflight:
            self._finish(self._pending.pop(0))
        if self._world == 1:
            recv, work = send.view(-1), Done
        else:
            recv = torch.empty(send.shape[1], dtype=send.dtype, device=send.device)
            work = self._comm.reduce_scatter(recv, send.view(-1), "sum")
        self._pending.append(([(group, mask) for group, _, mask in entries], send, recv, work))
        self._inflight += nbytes
        self.counters["reduce_scatters"] += 1

    def _finish(self, pending):
        entries, send, recv, work = pending
        work.wait()
        self._inflight -= send.numel() * send.element_size()
        if self._world > 1:
            recv.div_(self._world)
        shards = recv.split([group.shard_numel for group, _ in entries])
        for (group, mask), shard in zip(entries, shards):
            _add_grad_shard(group, shard, mask)
            if self.on_group_ready is not None:
                self.on_group_ready(group)

    def drain(self):
        """Finishes every reduce-scatter in flight: each adds to its group's
        gradient shard."""
        self._issue()
        if not self._pending:
            return
        start = time.perf_counter_ns()
        pending, self._pending = self._pending, []
        for entry in pending:
            self._finish(entry)
        self.counters["grad_wait_ns"] += time.perf_counter_ns() - start

    def abandon(self, groups):
        """After a backward that raised: waits for what is in flight (the
        buffers must outlive it) and keeps none of it, nor the gradients
        the parameters hold."""
        self._bucket = []
        self._bucket_bytes = 0
        pending, self._pending = self._pending, []
        for entry in pending:
            entry[3].wait()
        self._inflight = 0
        for group in groups:
            for p in group.params:
                p.grad = None
