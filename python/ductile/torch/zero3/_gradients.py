"""Gradients of a zero3 engine, by group: when a unit's backward is done
(_passes.py), the full gradients of its group's parameters are laid out
rank-major in one flat buffer (``torch._chunk_cat``: member by member, each
split into the ranks' slices as the shards are; ``_ductile.zero.
take_gradients``, python/src/group_gradients.hpp, one C++ call a group),
reduce-scattered (summed,
then divided by the world size) into this rank's flat gradient shard, and
dropped. Groups smaller than ``bucket_bytes`` share a collective: their
rank-major layouts are joined side by side (rank r's slices of every group
together) and reduce-scattered at once when the bucket is full, or at the
end of the backward, since on a small group the collective's fixed cost
(a gloo round trip, a kernel launch) is larger than its bytes'. A group of
``bucket_bytes`` or more goes alone, as soon as its backward is done. The
reduce-scatters run while backward goes on; ``drain()`` finishes the rest at
its end. Each member's ``shard.grad`` is a view of the group's flat
gradient shard, so clipping, unscaling and the optimizer's foreach kernels
see a handful of big tensors.

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

from ... import _ductile
from ._collectives import Done

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
