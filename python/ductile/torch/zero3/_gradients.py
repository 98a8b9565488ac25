"""Gradients of a zero3 engine: each parameter's full gradient, as soon as
autograd has stored it (a post-accumulate-grad hook: one call for a
parameter used several times, autograd sums the uses first), is
reduce-scattered (summed, then divided by the world size) into this rank's
gradient shard, and the full gradient is dropped. The reduce-scatters run
while backward goes on; ``drain()`` waits for the rest at its end.

Reduce dtype: the full gradient is cast to ``reduce_dtype`` (fp32 unless
configured) before the reduce-scatter, and the result is added to the
gradient shard in the master dtype, so bf16 compute still sums in fp32.

With ``on_shard_ready`` set (the engine's step_in_backward), each gradient
shard is handed over as soon as its reduce-scatter completes, so the
optimizer steps that parameter and drops the shard: no rank ever holds all
gradient shards at once.

Gradient accumulation, two ways (``sync``):
- ``sync`` on (the default): every micro-batch's gradients are
  reduce-scattered and added to the gradient shards (fp32 with mixed
  precision): communication every micro-batch, memory of a shard;
- ``sync`` off (``engine.no_sync()``): full gradients are summed locally in
  the reduce dtype and nothing is communicated; the next backward with
  ``sync`` on reduce-scatters the sum once: one reduce-scatter per step,
  memory of the full gradients while accumulating.
"""

import time

import torch


class GradientReducer:
    """`max_inflight_bytes`: the full gradients handed to reduce-scatters
    not yet complete are kept within it (the oldest is waited for first), so
    that a transport slower than backward (gloo's one worker thread) cannot
    pile up every full gradient of the model; one larger gradient may go
    alone."""

    def __init__(self, comm, reduce_dtype=None, max_inflight_bytes=64 << 20):
        self._comm = comm
        self._world = comm.size
        self._reduce_dtype = reduce_dtype
        self._max_inflight = max_inflight_bytes
        self._inflight = 0
        self._pending = []   # (param, send, recv, work) in issue order
        self._handles = []
        self.sync = True
        self.on_shard_ready = None  # called with a parameter whose gradient shard is complete
        self.counters = {"reduce_scatters": 0, "reduced_numel": 0, "grad_wait_ns": 0,
                         "accumulated_grads": 0}

    def install(self, params):
        """Hooks every parameter that requires grad."""
        for zp in params:
            if zp.requires_grad:
                self._handles.append(zp.param.register_post_accumulate_grad_hook(
                    self._hook(zp)))

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, zp):
        def hook(param):
            self._reduce(zp)
        return hook

    def _dtype(self, zp):
        return self._reduce_dtype or zp.dtype

    def _reduce(self, zp):
        grad = zp.param.grad
        if grad is None:
            return
        zp.param.grad = None
        dtype = self._dtype(zp)
        flat = grad.reshape(-1)
        if not self.sync:
            if zp.accumulated is None:
                zp.accumulated = flat.to(dtype, copy=True)
            else:
                zp.accumulated.add_(flat)
            self.counters["accumulated_grads"] += 1
            return
        if zp.accumulated is not None:
            flat = zp.accumulated.add_(flat)
            zp.accumulated = None
        total = self._world * zp.shard_numel
        if total == zp.numel and flat.is_contiguous() and flat.dtype == dtype:
            send = flat
        else:  # the last rank's shard is padded, the dtype differs, or the gradient is strided
            send = torch.empty(total, dtype=dtype, device=flat.device)
            send[:zp.numel].copy_(flat)
            send[zp.numel:].zero_()
        nbytes = send.numel() * send.element_size()
        while self._pending and self._inflight + nbytes > self._max_inflight:
            self._finish(self._pending.pop(0))
        recv = torch.empty(zp.shard_numel, dtype=dtype, device=flat.device)
        work = self._comm.reduce_scatter(recv, send, "sum")
        self._pending.append((zp, send, recv, work))
        self._inflight += nbytes
        self.counters["reduce_scatters"] += 1
        self.counters["reduced_numel"] += total
        # Completed ones give their full gradients back at once.
        while self._pending and self._pending[0][3].query():
            self._finish(self._pending.pop(0))

    def _finish(self, entry):
        zp, send, recv, work = entry
        work.wait()
        self._inflight -= send.numel() * send.element_size()
        if self._world > 1:
            recv.div_(self._world)
        shard = zp.shard
        if shard.grad is None:
            shard.grad = recv if recv.dtype == shard.dtype else recv.to(shard.dtype)
        else:
            shard.grad.add_(recv)
        if self.on_shard_ready is not None:
            self.on_shard_ready(zp)

    def drain(self):
        """Waits for every reduce-scatter in flight and adds it to its shard's gradient."""
        if not self._pending:
            return
        start = time.perf_counter_ns()
        pending, self._pending = self._pending, []
        for entry in pending:
            self._finish(entry)
        self.counters["grad_wait_ns"] += time.perf_counter_ns() - start

    def abandon(self):
        """After a backward that raised: waits for what is in flight (the
        buffers must outlive it) and keeps none of it."""
        pending, self._pending = self._pending, []
        for entry in pending:
            entry[3].wait()
        self._inflight = 0

    def discard_accumulated(self, params):
        for zp in params:
            zp.accumulated = None
