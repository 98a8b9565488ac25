"""The zero3 engine's parameters and their groups (_units.py), registered
with the coordinator, and this rank's shards: filled at set-up
(_sharded_model.py builds it), and brought up to date before each pass
with what the optimizer wrote (``Sharding.changed``).

A group is one coordinator parameter (``register_group``: one collective a
group).
"""

from typing import Any

import torch

from ..._errors import IncompatibleError, InvalidArgumentError
from . import _init, _units
from ._param import ParamGroup, ZeroParam


def replace_parameter(model, old, new):
    """Every module slot holding `old` holds `new` (ties stay ties)."""
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is old:
                module._parameters[key] = new
        listed = module.__dict__.get(_units.EXTERNAL)
        if listed:
            module.__dict__[_units.EXTERNAL] = [new if p is old else p for p in listed]


class Sharding:
    """The engine's parameters, groups and units, and their shards."""

    def __init__(self, session, memory, comm, precision):
        self.session = session
        self.memory = memory
        self.comm = comm
        self.rank = session.rank
        self.world = session.size
        self.precision = precision
        # the engine's OptimizerOffload, when groups are offloaded
        self.offload: Any = None
        self.changed = False  # the optimizer's shards changed since the last sync()
        self.params = []
        self.groups = []
        self.units = []

    # --- what is partitioned ----------------------------------------------------------

    def collect(self, model):
        precision = self.precision
        params: list[ZeroParam] = []
        seen: set[int] = set()
        for name, p in model.named_parameters():
            if id(p) in seen or p.numel() == 0:
                continue  # shared (tied), or nothing to partition
            seen.add(id(p))
            if not p.is_meta and p.device != self.memory.device:
                raise InvalidArgumentError(
                    f"zero3.initialize: parameter '{name}' is on {p.device}, the "
                    f"{self.session.backend} accelerator needs {self.memory.device}; move the "
                    "model first")
            if not p.is_floating_point():
                raise InvalidArgumentError(
                    f"zero3: parameter '{name}' has dtype {p.dtype}, which cannot be "
                    "partitioned; valid: torch.float32, torch.float64, torch.float16, "
                    "torch.bfloat16")
            dtype = precision.param_dtype if precision is not None and \
                precision.param_dtype is not None else p.dtype
            params.append(ZeroParam(len(params), name, p, dtype))
        if not params:
            raise InvalidArgumentError("zero3.initialize: the model has no parameters")
        self.params = params
        return params

    def plan(self, model, policy):
        """The units and groups."""
        param_of = {id(zp.param): zp for zp in self.params}

        def make_group(name, members):
            self.groups.append(ParamGroup(len(self.groups), name, members, self.world))
            return self.groups[-1]

        self.units = _units.plan(model, param_of, policy, make_group)
        return self.units

    # --- partitioning -------------------------------------------------------------------

    def partition(self, model, load_from):
        """Registers every group and fills this rank's shards: from the
        slices zero3.init kept, from safetensors (load_from), or from rank
        0's values (broadcast, as DistributedDataParallel does)."""
        source = _init.SafetensorsSource(load_from) if load_from is not None else None
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        try:
            # One group at a time: its shards are filled (and whatever held
            # their initial values let go) before the next one is allocated.
            for group in self.groups:
                self._register(group)
                self._make_shards(group)
                for zp in group.members:
                    values = self._initial_values(zp, source, aliases[id(zp.param)])
                    if values is not None:
                        zp.store.copy_(values)
                        if zp.shard.data_ptr() != zp.store.data_ptr():
                            zp.shard.data.copy_(values)
                    del values
                    if zp.param.is_meta:
                        real = torch.nn.Parameter(torch.empty(0, dtype=zp.param.dtype,
                                                              device=self.memory.device),
                                                  requires_grad=zp.requires_grad)
                        replace_parameter(model, zp.param, real)
                        zp.param = real
                group.params = [zp.param for zp in group.members]
        finally:
            if source is not None:
                source.close()
        self.sync()

    def _register(self, group):
        session = self.session
        session.register_group(group.id, group.numels, group.type)
        if session.shard_numel(group.id) != group.shard_numel:
            raise IncompatibleError(
                f"zero3: the coordinator partitions '{group.name}' into "
                f"{session.shard_numel(group.id)} elements a rank, the engine expects "
                f"{group.shard_numel} (ceil(numel / world) a member)")
        group.persistent = session.is_persistent(group.id)
        if group.shard_on_host:
            session.move_shard(group.id, "host")  # zero-filled: nothing to copy yet

    def _make_shards(self, group):
        """The coordinator's flat shard (`store`), the optimizer's (`master`)
        and each member's views of them."""
        session = self.session
        location = session.shard_location(group.id)
        on_host = location == "host"
        # A shard in a file (NVMe offload) is reached through set_shard():
        # the engine keeps a device copy of it.
        store = None
        if location != "nvme":
            store = (self.memory.host_tensor if on_host else self.memory.tensor)(
                session.shard_data(group.id), group.shard_numel, group.dtype)
        group.direct = store is not None
        if store is None:
            store = torch.zeros(group.shard_numel, dtype=group.dtype, device=self.memory.device)
        group.store = store
        precision = self.precision
        master_dtype = precision.master_dtype if precision is not None else None
        if group.host is not None:
            # The optimizer is offloaded: the master is on the host. With the
            # shard there too, the host step writes the coordinator's shard
            # itself (fp32), or its rounding (mixed precision).
            group.host.attach(group, store if on_host and group.direct else None)
            master = group.host.master
        elif on_host and group.trained:
            # The optimizer steps on the device: its master stays there.
            master = torch.zeros(group.shard_numel, dtype=master_dtype or group.dtype,
                                 device=self.memory.device)
        elif master_dtype is None or master_dtype == group.dtype:
            master = store
        else:
            master = torch.zeros(group.shard_numel, dtype=master_dtype, device=self.memory.device)
        group.master = master
        stores = store.split(group.sizes)
        masters = master.split(group.sizes)
        for zp, s, m in zip(group.members, stores, masters):
            zp.store = s
            shard = torch.nn.Parameter(m, requires_grad=zp.requires_grad)
            if group.direct and master is store:
                # The coordinator owns the memory: it lives as long as the shard.
                shard._ductile_zero3_session = session
            zp.shard = shard

    def _initial_values(self, zp, source, names):
        """This rank's shard values (a flat tensor of shard_numel), or None
        when the coordinator's zero-filled shard is already right."""
        lo, hi = zp.slice_of(self.rank)
        out = torch.zeros(zp.shard_numel, dtype=zp.param.dtype)
        if source is not None:
            key = source.key_for(names)
            if key is None:
                raise IncompatibleError(
                    f"{source.path}: no tensor for parameter '{zp.name}' (looked for "
                    f"{', '.join(repr(n) for n in names)})")
            out[:hi - lo] = source.read(key, zp.shape, lo, hi)
            return out.to(self.memory.device)
        shard = _init.shard_of(zp.param)
        if shard is not None:
            if (shard.world, shard.rank) != (self.world, self.rank):
                raise IncompatibleError(
                    f"zero3.initialize: parameter '{zp.name}' was partitioned by zero3.init "
                    f"for rank {shard.rank} of {shard.world}, the engine is rank {self.rank} of "
                    f"{self.world}")
            return shard.values.to(self.memory.device)
        if zp.param.is_meta:
            raise InvalidArgumentError(
                f"zero3.initialize: parameter '{zp.name}' is on the meta device; build the "
                "model under zero3.init() or give load_from= (safetensors)")
        data = zp.param.data
        if not data.is_contiguous():
            data = data.contiguous()
        if self.world > 1:
            data = data.clone()
            self.comm.broadcast(data.view(-1), 0).wait()
        out[:hi - lo] = data.reshape(-1)[lo:hi]
        return out.to(self.memory.device)

    # --- before a pass --------------------------------------------------------------------

    def sync(self):
        """After the shards changed: master copies are cast into the
        coordinator's shards (one copy a group); a direct shard only needs
        its copy that outlived the pass (a persistent one) dropped; a copied
        shard is written back."""
        session = self.session
        with torch.no_grad():
            for group in self.groups:
                if group.host is not None:
                    self.offload.to_device(group)
                elif group.master is not group.store:
                    group.store.copy_(group.master)
                if not group.direct:
                    session.set_shard(group.id, group.store.data_ptr(),
                                      group.shard_numel * group.element_size)
                elif group.persistent:
                    session.shard_written(group.id)
        self.changed = False
