"""Gradients of a zero3 engine, by group: when a unit's backward is done
(_passes.py), the full gradients of its group's parameters are laid out
rank-major in one flat buffer (``torch._chunk_cat``: member by member, each
split into the ranks' slices as the shards are), reduce-scattered (summed,
then divided by the world size) in one collective into this rank's flat
gradient shard, and dropped. The reduce-scatters run while backward goes on;
``drain()`` finishes the rest at its end. Each member's ``shard.grad`` is a
view of the group's flat gradient shard, so clipping, unscaling and the
optimizer's foreach kernels see a handful of big tensors.

A parameter whose gradient arrives after its group was reduced (one used
again by a later unit) is reduced again with the group at the end of the
backward; reduction is linear, so the sum is the same.

Reduce dtype: the full gradients are cast to ``reduce_dtype`` (fp32 unless
configured) by the layout copy, and the result is added to the gradient
shard in the master dtype, so bf16 compute still sums in fp32.

With ``on_group_ready`` set (the engine's step_in_backward), each group is
handed over as soon as its reduce-scatter completes, so the optimizer steps
its parameters and drops their gradient shards: no rank ever holds all
gradient shards at once.

Gradient accumulation, two ways (``sync``):
- ``sync`` on (the default): every micro-batch's gradients are
  reduce-scattered and added to the gradient shards (fp32 with mixed
  precision): communication every micro-batch, memory of a shard;
- ``sync`` off (``engine.no_sync()``): each group's rank-major gradients
  are summed locally in the reduce dtype and nothing is communicated; the
  next backward with ``sync`` on reduce-scatters the sum once: one
  reduce-scatter a group per step, memory of the full gradients while
  accumulating.

Every parameter of a group that gets a gradient on one rank must get one on
every rank (as with per-parameter reduction, the ranks would otherwise
issue different collectives); a member without one adds zeros and keeps no
gradient shard.
"""

import time

import torch

from ._collectives import Done


class GradientReducer:
    """`max_inflight_bytes`: the layout buffers handed to reduce-scatters not
    yet complete are kept within it (the oldest is finished first), so that
    a transport slower than backward (gloo's one worker thread) cannot pile
    up every full gradient of the model; one larger group may go alone."""

    def __init__(self, comm, reduce_dtype=None, max_inflight_bytes=64 << 20):
        self._comm = comm
        self._world = comm.size
        self._reduce_dtype = reduce_dtype
        self._max_inflight = max_inflight_bytes
        self._inflight = 0
        self._pending = []   # (group, send, recv, work, mask) in issue order
        self.sync = True
        self.on_group_ready = None  # called with a group whose gradient shard is complete
        self.counters = {"reduce_scatters": 0, "reduced_params": 0, "reduced_numel": 0,
                         "grad_wait_ns": 0, "accumulated_grads": 0}

    def _layout(self, group, grads, dtype, out=None):
        """The members' gradients rank-major ((world, shard_numel)), in
        `dtype`; a missing one as zeros."""
        flats = []
        for zp, g in zip(group.members, grads):
            if g is None:
                g = torch.zeros(zp.numel, dtype=group.dtype, device=group.store.device)
            flats.append(g.reshape(-1))
        if out is None:
            out = torch.empty(self._world, group.shard_numel, dtype=dtype,
                              device=flats[0].device)
        return torch._chunk_cat(flats, 0, self._world, out=out)

    def reduce(self, group):
        """Reduce-scatters the gradients the group's parameters hold now
        (none: nothing to do) and drops them."""
        if not group.trained:
            return
        grads = [p.grad for p in group.params]
        mask = [g is not None for g in grads]
        if not any(mask):
            return
        for p in group.params:
            p.grad = None
        dtype = self._reduce_dtype or group.dtype
        if not self.sync:
            if group.accumulated is None:
                group.accumulated = self._layout(group, grads, dtype)
                group.accumulated_mask = mask
            else:
                group.accumulated.add_(self._layout(group, grads, grads[mask.index(True)].dtype))
                group.accumulated_mask = [a or b for a, b in zip(group.accumulated_mask, mask)]
            self.counters["accumulated_grads"] += sum(mask)
            return
        send = self._layout(group, grads, dtype)
        if group.accumulated is not None:
            send.add_(group.accumulated)
            mask = [a or b for a, b in zip(group.accumulated_mask, mask)]
            group.accumulated = None
            group.accumulated_mask = None
        nbytes = send.numel() * send.element_size()
        while self._pending and self._inflight + nbytes > self._max_inflight:
            self._finish(self._pending.pop(0))
        if self._world == 1:
            recv, work = send.view(-1), Done
        else:
            recv = torch.empty(group.shard_numel, dtype=dtype, device=send.device)
            work = self._comm.reduce_scatter(recv, send.view(-1), "sum")
        self._pending.append((group, send, recv, work, mask))
        self._inflight += nbytes
        self.counters["reduce_scatters"] += 1
        self.counters["reduced_params"] += sum(mask)
        self.counters["reduced_numel"] += send.numel()
        # Completed ones give their layout buffers back at once.
        while self._pending and self._pending[0][3].query():
            self._finish(self._pending.pop(0))

    def _finish(self, entry):
        group, send, recv, work, mask = entry
        work.wait()
        self._inflight -= send.numel() * send.element_size()
        if self._world > 1:
            recv.div_(self._world)
        if group.grads_attached():
            group.grad_flat.add_(recv)
            for zp, view, had in zip(group.members, group.grad_views, mask):
                if had and zp.shard.grad is None:
                    zp.shard.grad = view
        else:
            master = group.members[0].shard.dtype
            group.attach_grads(recv if recv.dtype == master else recv.to(master), mask)
        if self.on_group_ready is not None:
            self.on_group_ready(group)

    def drain(self):
        """Finishes every reduce-scatter in flight: each adds to its group's
        gradient shard."""
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
        pending, self._pending = self._pending, []
        for entry in pending:
            entry[3].wait()
        self._inflight = 0
        for group in groups:
            for p in group.params:
                p.grad = None

    @staticmethod
    def discard_accumulated(groups):
        for group in groups:
            group.accumulated = None
            group.accumulated_mask = None
