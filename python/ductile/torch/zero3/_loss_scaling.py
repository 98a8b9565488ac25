"""fp16 loss scaling of the zero3 engine (torch.amp.GradScaler's part):
the engine multiplies the loss by the scale before backward; before a step
the gradient shards are divided by it (once a step, whether clipping or the
step asks first), every rank learns whether any rank's gradient overflowed,
and the scaler (_precision.py: static or dynamic) updates the scale, the
step being skipped on an overflow.

With optimizer offload the offloaded groups' host gradients are never
rewritten: their unscaling is folded into the cpu_adam plugin's
``grad_scale`` (_offload.py), and only the device's shards are divided.
"""

from . import _grad_shards


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
            self.offload.unscale(_grad_shards.gradient_tensors(self.device_groups),
                                 1.0 / self.scaler.scale)
        else:
            _grad_shards.unscale(_grad_shards.gradient_tensors(self.groups), self.scaler.scale)
        self.unscaled = True

    def update(self):
        """Before a step: unscales, checks every rank's gradient shards for
        inf or NaN (collective) and updates the scale; True when the step
        must be skipped."""
        self.unscale()
        skip = _grad_shards.overflow(_grad_shards.gradient_tensors(self.groups), self.comm,
                                     self.device)
        self.scaler.update(skip)
        return skip
