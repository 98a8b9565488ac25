"""What a zero3 step does to the gradient shards before the optimizer:
unscaling (fp16 loss scaling), the overflow check and clipping by the
global norm. They work on the groups' flat gradient shards (a handful of
big tensors, torch's foreach kernels) and never wait on the host, except
for fp16's overflow decision (whether to skip the step is the host's), as
torch.amp.GradScaler does.
"""

import math

import torch

from ... import _ductile


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
    coefficient = clip_coefficient(total, max_norm)
    if grads:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, same in by_dtype.items():
            torch._foreach_mul_(same, coefficient.to(dtype))
    return total
