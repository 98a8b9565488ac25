"""Where the zero3 engine keeps each group's tensors, and the device
memory it accounts for (``max_device_memory``, ``engine.stats()``).

Per group, on the device unless offloaded:

- ``parameters``: the compute-dtype shard the coordinator gathers from;
- ``master_weights``: the fp32 master shard, when it is not that shard
  itself (mixed precision);
- ``optimizer_state``: Adam's two fp32 moments of the trained members;
- ``gradients``: the fp32 gradient shard, from the group's reduce-scatter
  until the step;
- ``gathered``: the coordinator's gathered copies (one budget for all
  groups: what the coordinator's limits let it hold, see _reserve).

Offloading a group's optimizer moves its state *and* its master to the host:
the host steps them, so the master must be where the state is (moving the
state alone would bring it back to the device every step). Under a budget,
the groups whose optimizer takes the most device memory go first, until the
rest fits; then, as the last resort, the parameter shards of the largest
groups go to host memory (the coordinator's move_shard), whose optimizers
are on the host by then. A host shard costs a device buffer of its size
while its gather is in flight (``staging``: at most the bound the
coordinator reports for its configured gathers in flight and prefetch
bucket). A budget that cannot be met even so is an error naming the
numbers.

The accounting is the engine's own: the bytes of the tensors it keeps, and
the coordinator's pool of gathered copies (the larger of its high-water of
copies in use and what it holds at the step). Activations and the
framework's workspaces are the model's, not counted.
"""

import os
import warnings

import torch

from ..._errors import IncompatibleError, InvalidArgumentError

_FP32 = 4


def budget_bytes(value, device):
    """``max_device_memory`` as bytes: an int (bytes) or a float in (0, 1]
    (that fraction of the device's memory; on the cpu backend, of the
    host's)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(
            f"zero3: max_device_memory = {value!r}; valid: a number of bytes (int >= 1) or a "
            "fraction of the device's memory (float in (0, 1])")
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise InvalidArgumentError(
                f"zero3: max_device_memory = {value!r}; a fraction must lie in (0, 1] (or give "
                "bytes as an int)")
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(value * total)
    if value < 1:
        raise InvalidArgumentError(
            f"zero3: max_device_memory = {value}; valid: a number of bytes >= 1")
    return int(value)


class GroupBytes:
    """A group's device bytes by kind (see the module's docstring)."""

    def __init__(self, group, master_dtype, states):
        trained = sum(zp.shard_numel for zp in group.trained)
        self.group = group
        self.parameters = group.shard_numel * group.element_size
        self.master_weights = group.shard_numel * _FP32 \
            if master_dtype is not None and master_dtype != group.dtype else 0
        self.optimizer_state = states * trained * _FP32
        self.gradients = group.shard_numel * _FP32 if trained else 0

    @property
    def optimizer(self):
        """What offloading the group's optimizer frees on the device."""
        return self.optimizer_state + self.master_weights


class Placement:
    """Which groups' optimizers are on the host, and the device bytes."""

    def __init__(self, groups, master_dtype, states, gather_reserve, staging_cap):
        self.master_dtype = master_dtype  # of the optimizer's shards; None: the shards' own
        self.bytes = [GroupBytes(g, master_dtype, states) for g in groups]
        self.gather_reserve = gather_reserve
        self.staging_cap = staging_cap
        self.world = groups[0].world if groups else 1
        self.offloaded = set()  # group ids whose optimizer is on the host
        self.shards_on_host = set()  # group ids whose parameter shard is in host memory
        self.budget = None
        self.warned = False

    def staging(self):
        """Device bytes of host shards copied for gathers in flight: at most
        all of them, the staging cap, and the gathered copies' reserve over
        the world size (a shard is 1/world of its gathered copy)."""
        on_host = sum(b.parameters for b in self.bytes if b.group.id in self.shards_on_host)
        return min(on_host, self.staging_cap, -(-self.gather_reserve // self.world))

    def device_need(self):
        total = self.gather_reserve + self.staging()
        for b in self.bytes:
            total += b.gradients
            if b.group.id not in self.shards_on_host:
                total += b.parameters
            if b.group.id not in self.offloaded:
                total += b.optimizer
        return total

    def choose(self, budget, all_optimizers, ratio=None, all_shards=False):
        """Offloads every group's optimizer (`all_optimizers`; with
        `ratio`, the largest ones until that share of the optimizer bytes)
        and every parameter shard with its optimizer (`all_shards`); then,
        under `budget`, the largest of the other optimizers until the need
        fits, and then the largest shards. IncompatibleError naming the
        numbers when it cannot."""
        candidates = sorted((b for b in self.bytes if b.optimizer_state),
                            key=lambda b: (-b.optimizer, b.group.id))
        if all_shards:
            for b in self.bytes:
                self.shards_on_host.add(b.group.id)
                if b.optimizer_state:
                    self.offloaded.add(b.group.id)
        if all_optimizers:
            total = sum(b.optimizer for b in candidates)
            moved = 0
            for b in candidates:
                if ratio is not None and total and moved >= ratio * total:
                    break
                self.offloaded.add(b.group.id)
                moved += b.optimizer
        self.budget = budget
        if budget is None:
            return self.offloaded
        for b in candidates:
            if self.device_need() <= budget:
                break
            self.offloaded.add(b.group.id)
        # The last resort: parameter shards, the largest first (their
        # optimizers are all on the host by now).
        for b in sorted(self.bytes, key=lambda b: (-b.parameters, b.group.id)):
            if self.device_need() <= budget:
                break
            self.shards_on_host.add(b.group.id)
        need = self.device_need()
        if need > budget:
            raise IncompatibleError(
                f"zero3: max_device_memory = {budget} bytes cannot be met: with the optimizer "
                f"state, master weights and parameter shards of every group on the host, the "
                f"device still needs {need} bytes (gradient shards {self.total('gradients')}, "
                f"gathered copies up to {self.gather_reserve}, host shards copied for them up "
                f"to {self.staging()}); valid: max_device_memory >= {need} (or lower [zero] "
                "max_live_parameters or prefetch_bucket_size to gather less at once)")
        return self.offloaded

    def check(self, high_water, step):
        """Warns once when a step's accounted bytes passed the budget: the
        coordinator gathered more than its limits promised."""
        if self.budget is not None and high_water > self.budget and not self.warned:
            self.warned = True
            warnings.warn(
                f"zero3: step {step} held {high_water} bytes on the device by the engine's "
                f"accounting, over max_device_memory = {self.budget}; the gathered copies took "
                f"more than the {self.gather_reserve} bytes planned for them", UserWarning,
                stacklevel=1)

    def total(self, kind, where="device"):
        out = 0
        for b in self.bytes:
            if kind == "parameters":
                on_host = b.group.id in self.shards_on_host
            else:
                on_host = b.group.id in self.offloaded and kind in ("optimizer_state",
                                                                     "master_weights")
            if on_host == (where == "host"):
                out += getattr(b, kind)
        return out

    def report(self):
        """{kind: {"device": bytes, "host": bytes}} of the plan."""
        return {kind: {"device": self.total(kind), "host": self.total(kind, "host")}
                for kind in ("parameters", "master_weights", "optimizer_state", "gradients")}


def gather_reserve(session, groups):
    """The most the coordinator's gathered copies may take: its live limit
    (max_live_parameters) plus the largest group, which a unit may gather
    beyond it, or every group at once without a limit; plus the root's
    group, open from the forward to the end of the backward."""
    stats = session.stats()
    limit = int(stats.get("max_live_numel") or 0)
    size = max(g.element_size for g in groups)
    everything = sum(g.world * g.shard_numel for g in groups)
    largest = max(g.world * g.shard_numel for g in groups)
    if limit <= 0 or limit >= everything:
        return everything * size
    return min(everything, limit + 2 * largest) * size


def staging_cap(session, groups):
    """The most bytes of host shards the coordinator copies to the device at
    once, as it bounds them for `groups` (its gathers in flight and its
    prefetch bucket are its own configuration)."""
    return session.staging_bytes_bound(max(g.shard_numel for g in groups),
                                       max(g.element_size for g in groups))


def account(resident, session, gradient_bytes):
    """A step's device bytes by the engine's accounting: `resident` (the
    shards, the masters and optimizer state on the device:
    resident_bytes()), the gradient shards at the step (`gradient_bytes`),
    the gathered copies."""
    return resident + gradient_bytes + gathered_bytes(session)


def resident_bytes(groups, optimizer):
    """The shards, and the masters and optimizer state on the device. It
    walks every parameter's state: the engine calls it again only when the
    optimizer's state changed in size (its first steps, a load)."""
    total = 0
    state = optimizer.state if optimizer is not None else {}
    for group in groups:
        if not group.shard_on_host:
            total += group.shard_numel * group.element_size
        if group.host is None:
            if group.master is not group.store:
                total += group.master.numel() * group.master.element_size()
            for zp in group.members:
                for value in state.get(zp.shard, {}).values():
                    if isinstance(value, torch.Tensor) and value.numel() == zp.shard_numel:
                        total += value.numel() * value.element_size()
    return total


def gathered_bytes(session):
    """The coordinator's pool of gathered copies at this point: the larger
    of its high-water of copies in use and what it holds now."""
    memory = session.gather_memory()
    return max(memory["high_water_bytes"], memory["in_use_bytes"] + memory["idle_bytes"])
