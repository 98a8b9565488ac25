"""Parameters and their groups: the sharded parameter, the group gathered in one collective,
how a model is sharded into them (at once, or built straight into shards under ``init()``), and
full parameters gathered back."""

from __future__ import annotations

import json
import math
import os
import weakref
from collections.abc import Iterable
from typing import Any, Literal, Self, TYPE_CHECKING, TypeAlias

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ... import _ductile
from ..._config import StrPath
from ..._errors import IncompatibleError, InvalidArgumentError, IoError
from . import _passes
from ._gradients import as_dtype
from ._safetensors import SafetensorsSource
from ._world import type_name

# Parameter state (FSDP2's ``FSDPParam`` / ``FSDPParamGroup`` seam; docs/zero3.md,
# "Partitioning"). A ``ParamGroup`` is the parameters one hooked module (a unit, _passes.py) owns,
# one coordinator parameter: each member sharded on its own (``ceil(numel / world)`` elements a
# rank, zero-padded), this rank's slices back to back in one flat shard, the gathered copy holding
# each member whole, back to back. Per group, up to three flat tensors: ``store`` (this rank's
# shard in the compute dtype, as the coordinator keeps it: its own memory, ``direct``, or a copy
# written back with ``set_shard``), ``master`` (the optimizer's shard: ``store`` itself, or an
# fp32 copy under mixed precision) and ``full`` (the gathered copy while a module using the group
# runs). Per parameter (``ZeroParam``): ``shard`` (a ``torch.nn.Parameter`` over its slice of
# ``master``, whose ``.grad`` is a view of the group's flat gradient shard) and ``store``.
#
# What the C++ step path (python/src/unit_passes.cpp, group_gradients.cpp, saved_views.cpp) reads
# or writes on every use is owned by C++: a ``ParamGroup`` is a ``_ductile.zero.GroupState``
# (python/src/group_state.hpp) and a ``ZeroParam`` a ``_ductile.zero.MemberState``, whose fields
# are typed properties here. The live copies (``_ductile.zero.LiveCopies``) let a tensor autograd
# saves inside a gathered copy be rebuilt over the copy gathered again for backward.


class ZeroParam(_ductile.zero.MemberState):
    """One unique parameter of the model and what the engine knows of it;
    ``shard`` and ``requires_grad`` are C++ (MemberState)."""

    # shape: the parameter's whole shape when its data is not (an engine's
    # placeholder, rejoin()); else its own.
    def __init__(self, pid, name, param, dtype, shape=None):
        super().__init__()
        self.id = pid
        self.name = name
        self.param = param
        self.shape = full_shape(param) if shape is None else tuple(shape)
        self.numel = math.prod(self.shape)
        self.dtype = dtype  # the compute dtype: of the store and the gathered copy
        self.orig_dtype = param.dtype  # the model's own
        self.type = type_name(dtype, f"parameter '{name}'")
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.requires_grad = param.requires_grad
        self.shard_numel = 0
        self.store = None   # its slice of the group's store (compute dtype)
        self.shard = None   # the optimizer's parameter (master dtype)
        self.group: Any = None  # the ParamGroup it belongs to, set by that group
        self.offset = 0     # of its slice in the group's flat shard

    @property
    def direct(self):
        return self.group.direct

    @property
    def persistent(self):
        return self.group.persistent

    def slice_of(self, rank):
        """[lo, hi) of the flattened parameter held by `rank` (hi may be
        below lo + shard_numel for the last ranks: the rest is padding)."""
        lo = min(rank * self.shard_numel, self.numel)
        return lo, min(lo + self.shard_numel, self.numel)


class ParamGroup(_ductile.zero.GroupState):
    """Parameters gathered, materialised, released and reduced together.
    What the step path uses (``id``, ``name``, ``members``, ``params``,
    ``trained``, ``dtype``, ``sizes``, ``numels``, ``shard_numel``,
    ``full_bytes``, ``users``, ``full``, ``full_address``, ``placeholder``,
    ``views_cache``, ``grad_flat``, ``grad_views``, ``host_grad_views``) is
    C++ (GroupState)."""

    def __init__(self, gid, name, members, world):
        super().__init__()
        self.id = gid
        self.name = name
        self.members = members
        self.params = [zp.param for zp in members]
        first = members[0]
        self.dtype = first.dtype
        self.type = first.type
        self.element_size = first.element_size
        self.world = world
        offset = 0
        for zp in members:
            zp.group = self
            zp.shard_numel = -(-zp.numel // world)
            zp.offset = offset
            offset += zp.shard_numel
        self.shard_numel = offset
        self.numel = sum(zp.numel for zp in members)
        self.sizes = [zp.shard_numel for zp in members]
        self.numels = [zp.numel for zp in members]
        self.trained = [zp for zp in members if zp.requires_grad]
        self.store = None
        self.master = None
        self.direct = False
        self.persistent = False
        self.full_bytes = world * self.shard_numel * self.element_size
        self.accumulated = None  # gradients summed without sync, rank-major (reduce dtype)
        self.accumulated_mask = None
        self.host = None  # its optimizer offload (_offload.HostShard), or None
        self.shard_on_host = False  # the coordinator keeps its shard in host memory

    def views_at(self, memory, address):
        """(full, member views) over the gathered copy at `address` (the step
        path keeps a few, in ``views_cache``)."""
        full = memory.tensor(address, self.world * self.shard_numel, self.dtype)
        pieces = full.split([self.world * s for s in self.sizes])
        views = [piece[:zp.numel].view(zp.shape) for piece, zp in zip(pieces, self.members)]
        return full, views


# The engine's parameters and groups, registered with the coordinator (one coordinator parameter,
# one collective, a group), and this rank's shards, brought up to date before each pass with what
# the optimizer wrote (``Sharding.changed``).


def replace_parameter(model, old, new):
    """Every module slot holding `old` holds `new` (ties stay ties)."""
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is old:
                module._parameters[key] = new
        listed = module.__dict__.get(_passes.EXTERNAL)
        if listed:
            module.__dict__[_passes.EXTERNAL] = [new if p is old else p for p in listed]


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
            if hasattr(p, "ds_id"):
                raise InvalidArgumentError(
                    f"zero3.initialize: parameter '{name}' was partitioned by DeepSpeed's "
                    "deepspeed.zero.Init (it has ds_id), whose partitions ductile cannot adopt; "
                    "create the model under ductile's zero.Init instead: import ductile.hf, "
                    "ductile.trl or ductile.accelerate before the model is made (transformers' "
                    "from_config and from_pretrained then partition it with ductile's), or "
                    "build it under ductile.deepspeed.zero.Init()")
            partitioned = shard_of(p) is not None
            if id(p) in seen or (p.numel() == 0 and not partitioned):
                continue  # shared (tied), or nothing to partition
            seen.add(id(p))
            if not p.is_meta and not partitioned and p.device != self.memory.device:
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

    def adopt(self, previous):
        """The parameters of an engine this one replaces at another world
        size (rejoin): the same model parameters, names and dtypes, their
        shards made anew."""
        params = []
        for old in previous:
            zp = ZeroParam(old.id, old.name, old.param, old.dtype, old.shape)
            zp.orig_dtype = old.orig_dtype  # the parameter's data is a placeholder
            zp.requires_grad = old.requires_grad
            params.append(zp)
        self.params = params
        return params

    def plan(self, model, policy):
        """The units and groups."""
        param_of = {id(zp.param): zp for zp in self.params}

        def make_group(name, members):
            self.groups.append(ParamGroup(len(self.groups), name, members, self.world))
            return self.groups[-1]

        self.units = _passes.plan(model, param_of, policy, make_group)
        return self.units

    # --- partitioning -------------------------------------------------------------------

    def partition(self, model, load_from, fill=True):
        """Registers every group and fills this rank's shards: from the
        slices zero3.init kept, from safetensors (load_from), or from rank
        0's values (broadcast, as DistributedDataParallel does); without
        `fill`, leaves them zero (a load follows: no broadcast whose values
        it would overwrite, so that every rank of a round, started or
        rejoined in place, runs the same collectives before it)."""
        source = SafetensorsSource(load_from) if load_from is not None else None
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
                    if fill:
                        values = self._initial_values(zp, source, aliases[id(zp.param)])
                        if values is not None:
                            zp.store.copy_(values)
                            if zp.shard.data_ptr() != zp.store.data_ptr():
                                zp.shard.data.copy_(values)
                        del values
                    if shard_of(zp.param) is not None:
                        delattr(zp.param, _INIT)  # the shard is the engine's from now on
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
        shard = shard_of(zp.param)
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


# Partitioned construction, ``with zero3.init()`` (docs/zero3.md, "Partitioned construction"): a
# parameter is replaced by a meta one as its module registers it and this rank keeps only its
# slice; an in-place write to it runs on a transient full tensor holding that slice, so it draws
# the random numbers the eager model draws. At most one parameter is whole at a time. The world
# size and rank come from torch.distributed when it is initialised, else from the launcher's
# environment (mpirun, torchrun), and must be the engine's. ``load_from`` reads, from
# safetensors files, only the rows holding this rank's slice of each parameter.

_INIT = "_ductile_zero3_init"


class InitShard:
    """This rank's slice of a parameter built under zero3.init."""

    __slots__ = ("values", "shape", "numel", "world", "rank", "lo", "hi", "dtype", "__weakref__")

    def __init__(self, shape, dtype, world, rank):
        self.shape = tuple(shape)
        self.numel = math.prod(self.shape)
        numel = self.numel
        self.world = world
        self.rank = rank
        self.dtype = dtype
        shard = -(-numel // world)
        self.lo = min(rank * shard, numel)
        self.hi = min(self.lo + shard, numel)
        self.values = torch.zeros(shard, dtype=dtype)

    def take(self, full):
        self.values[:self.hi - self.lo].copy_(full.reshape(-1)[self.lo:self.hi])

    def whole(self):
        """A transient full tensor holding this rank's slice (zeros elsewhere)."""
        full = torch.zeros(self.numel, dtype=self.dtype)
        full[self.lo:self.hi] = self.values[:self.hi - self.lo]
        return full


def shard_of(param):
    """The InitShard of a parameter partitioned by zero3.init, or None."""
    return getattr(param, _INIT, None)


def full_shape(param):
    """A parameter's whole shape, also while zero3.init keeps only its slice."""
    shard = shard_of(param)
    return shard.shape if shard is not None else tuple(param.shape)


def launch_world():
    """(world size, rank) of this process: torch.distributed, else the launcher."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    for size, rank in (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("PMI_SIZE", "PMI_RANK"),
                       ("WORLD_SIZE", "RANK")):
        if os.environ.get(size) and os.environ.get(rank):
            return int(os.environ[size]), int(os.environ[rank])
    return 1, 0


def _writes_first_argument(func):
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


class _Mode(TorchDispatchMode):
    """Runs in-place writes to partitioned parameters on transient full tensors."""

    def __init__(self, owners):
        super().__init__()
        self._owners = owners  # meta storage id -> InitShard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if (isinstance(target, torch.Tensor) and target.is_meta and self._owners
                and _writes_first_argument(func)):
            shard = self._owners.get(target.untyped_storage()._cdata)
            if shard is not None:
                return self._write(func, target, shard, args, kwargs)
        return func(*args, **kwargs)

    def _write(self, func, target, shard, args, kwargs):
        for a in list(args[1:]) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a.is_meta:
                raise IncompatibleError(
                    f"zero3.init: {func} writes a partitioned parameter from another meta "
                    "tensor (a partitioned parameter's values are not available during "
                    "construction); initialise it from real values")
        full = shard.whole()
        real = full.as_strided(target.size(), target.stride(), target.storage_offset())
        func(real, *args[1:], **kwargs)
        shard.take(full)
        return target


class init:  # noqa: N801 - used as a context manager, like torch.no_grad
    """``with zero3.init(): model = Model(...)``: see the module's docstring."""

    def __init__(self, world_size: int | None = None, rank: int | None = None) -> None:
        detected = launch_world()
        self.world_size = detected[0] if world_size is None else world_size
        self.rank = detected[1] if rank is None else rank
        if not (isinstance(self.world_size, int) and isinstance(self.rank, int)
                and 0 <= self.rank < self.world_size):
            raise InvalidArgumentError(
                f"zero3.init: rank {self.rank!r} of world size {self.world_size!r} is not valid")
        self._owners: dict[int, InitShard] = {}  # meta storage id -> this rank's slice
        # every module that registered a parameter while it lasted, by id
        self._modules: dict[int, torch.nn.Module] = {}
        # torch's hook handle and dispatch mode, set by __enter__
        self._handle: Any = None
        self._mode: Any = None

    def _register(self, module, name, param):
        self._modules[id(module)] = module
        if param is None or shard_of(param) is not None or param.is_meta:
            return None
        shard = InitShard(param.shape, param.dtype, self.world_size, self.rank)
        with torch.no_grad():
            shard.take(param.detach())
        meta = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                  requires_grad=param.requires_grad)
        setattr(meta, _INIT, shard)
        self._owners[meta.untyped_storage()._cdata] = shard
        # The storage id may be reused once the parameter dies: forget it then.
        owners, key = self._owners, meta.untyped_storage()._cdata
        weakref.finalize(meta, owners.pop, key, None)
        return meta

    def __enter__(self) -> Self:
        self._handle = torch.nn.modules.module.register_module_parameter_registration_hook(
            self._register)
        self._mode = _Mode(self._owners)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self._mode.__exit__(*exc)
        self._handle.remove()
        self._owners.clear()
        try:
            if exc[0] is None:
                _rest(self._modules.values())
        finally:
            self._modules.clear()
        return False


def _rest(modules):
    """After construction, each meta parameter of `modules` becomes an empty
    real one holding the same slice: the form a partitioned parameter has
    outside a gather (DeepSpeed's too), whose ``.data`` GatheredParameters
    can point at the whole value (a meta tensor's cannot be)."""
    modules = list(modules)
    rested: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        for p in module._parameters.values():
            if p is None or not p.is_meta or shard_of(p) is None or id(p) in rested:
                continue
            real = torch.nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
            real.__dict__.update(p.__dict__)  # the slice, and what the model's code set
            rested[id(p)] = real
    for module in modules:
        for key, p in list(module._parameters.items()):
            if p is not None and id(p) in rested:
                module._parameters[key] = rested[id(p)]
        listed = module.__dict__.get(_passes.EXTERNAL)
        if listed:
            module.__dict__[_passes.EXTERNAL] = [rested.get(id(p), p) for p in listed]


# Whole parameters out of an engine (``full_parameters``, ``state_dict``, ``save_consolidated``,
# ``GatheredParameters``): collective, each parameter all-gathered from the optimizer's shards
# one at a time, so no rank holds more than one whole parameter beyond what it keeps.

if TYPE_CHECKING:
    from ._engine import Zero3Engine

# The dtype of whole parameters: a torch dtype, "fp32"/"bf16"/"fp16" (and
# their long names), "param" (each parameter's own) or None (the optimizer
# shards': the fp32 masters with mixed precision).
DtypeArgument: TypeAlias = torch.dtype | str | None

_OWNER = "_ductile_zero3_owner"


def _gather(engine, zp, dtype=None):
    """zp's whole value (shape zp.shape, new memory), on the engine's device."""
    shard = zp.shard.detach()
    out = torch.empty(engine.world_size * zp.shard_numel, dtype=shard.dtype,
                      device=engine._memory.device)
    # An offloaded master is on the host: the collective takes a device copy.
    engine.comm.all_gather(out, shard.to(out.device).contiguous()).wait()
    full = out[:zp.numel].view(zp.shape)
    if dtype is not None and dtype != full.dtype:
        full = full.to(dtype)
    return full


def _dtype_of(zp, dtype):
    return zp.orig_dtype if dtype == "param" else as_dtype(dtype, "dtype")


def full_parameters(engine: Zero3Engine,
                    dtype: DtypeArgument = None) -> dict[str, torch.Tensor]:
    return {zp.name: _gather(engine, zp, _dtype_of(zp, dtype)) for zp in engine._params}


def _entries(engine):
    """(state_dict key, ZeroParam or buffer tensor) in model.state_dict() order."""
    by_param = {id(zp.param): zp for zp in engine._params}
    return [(key, by_param.get(id(value), value))
            for key, value in engine.module.state_dict(keep_vars=True).items()]


def state_dict(engine: Zero3Engine, dtype: DtypeArgument = None,
               rank0_only: bool = False) -> dict[str, torch.Tensor]:
    keep = not rank0_only or engine.rank == 0
    out, gathered = {}, {}
    for key, entry in _entries(engine):
        if not hasattr(entry, "shard"):
            if keep:
                out[key] = entry.detach().clone().cpu()
            continue
        if entry.id not in gathered:
            value = _gather(engine, entry, _dtype_of(entry, dtype)).cpu()
            gathered[entry.id] = value if keep else None
        if keep:
            out[key] = gathered[entry.id]
    return out


def _plan_files(items, max_shard_bytes):
    """Groups (key, nbytes) into files of at most max_shard_bytes each (a
    larger tensor alone); returns the list of key lists."""
    files: list[list] = []
    current: list = []
    size = 0
    for key, nbytes in items:
        if current and size + nbytes > max_shard_bytes:
            files.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes
    if current or not files:
        files.append(current)
    return files


def save_consolidated(engine: Zero3Engine, path: StrPath, dtype: DtypeArgument = None,
                      max_shard_bytes: int = 5 << 30) -> None:
    from safetensors.torch import save_file

    path = os.fspath(path)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InvalidArgumentError(
            f"zero3: save_consolidated max_shard_bytes = {max_shard_bytes!r}; a positive int")
    # One name per tensor: safetensors refuses shared storage, and
    # from_pretrained ties the others again (tie_word_embeddings).
    entries, seen = [], set()
    for key, entry in _entries(engine):
        ident = ("param", entry.id) if hasattr(entry, "shard") else ("buffer", id(entry))
        if ident in seen:
            continue
        seen.add(ident)
        entries.append((key, entry))

    def out_dtype(entry):
        if hasattr(entry, "shard"):
            return _dtype_of(entry, dtype) or entry.shard.dtype
        return entry.dtype

    def nbytes(entry):
        numel = entry.numel if hasattr(entry, "shard") else entry.numel()
        return numel * torch.empty((), dtype=out_dtype(entry)).element_size()

    sizes = {key: nbytes(entry) for key, entry in entries}
    files = _plan_files([(key, sizes[key]) for key, _ in entries], max_shard_bytes)
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    lookup = dict(entries)
    if engine.rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise IoError(f"{path}: cannot create the folder: {e.strerror}") from e
    for name, keys in zip(names, files):
        tensors = {}
        for key in keys:
            entry = lookup[key]
            if hasattr(entry, "shard"):
                value = _gather(engine, entry, out_dtype(entry))
            else:
                value = entry.detach()
            if engine.rank == 0:
                tensors[key] = value.contiguous().cpu()
        if engine.rank == 0:
            try:
                save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
            except OSError as e:
                raise IoError(f"{os.path.join(path, name)}: cannot write: {e.strerror}") from e
    if engine.rank == 0:
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {key: n for n, keys in zip(names, files) for key in keys}}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        config = getattr(engine.module, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(path)
    engine.comm.barrier()


def register_owner(engine, zp):
    setattr(zp.param, _OWNER, (weakref.ref(engine), zp))


def _owner(param):
    owner = getattr(param, _OWNER, None)
    return (None, None) if owner is None else (owner[0](), owner[1])


def parameters_of(params):
    """The parameters GatheredParameters is given, as a list: a module's, one
    parameter, or an iterable of them (None: none)."""
    if isinstance(params, torch.nn.Module):
        return list(params.parameters())
    if isinstance(params, torch.nn.Parameter):
        return [params]
    return list(params or ())


def is_partitioned(param):
    """Whether `param` is partitioned by ductile: managed by a live zero3
    engine, or built under zero3.init and not yet adopted by one."""
    return _owner(param)[0] is not None or shard_of(param) is not None


def _init_world(shard, modifier_rank):
    """The process group of a parameter zero3.init partitioned, checked."""
    dist = torch.distributed
    if shard.world > 1 and not (dist.is_available() and dist.is_initialized()):
        raise IncompatibleError(
            f"zero3.GatheredParameters: a parameter partitioned by zero3.init over "
            f"{shard.world} ranks needs torch.distributed's process group to gather it; "
            "initialise it first (torch.distributed.init_process_group)")
    if shard.world > 1 and dist.get_world_size() != shard.world:
        raise IncompatibleError(
            f"zero3.GatheredParameters: a parameter partitioned by zero3.init over "
            f"{shard.world} ranks, torch.distributed's world has {dist.get_world_size()}")
    if modifier_rank is not None and not 0 <= modifier_rank < shard.world:
        raise InvalidArgumentError(
            f"zero3.GatheredParameters: modifier_rank {modifier_rank} is not a rank of the "
            f"{shard.world}-rank world")


def _collective_device():
    """Where torch.distributed's default group takes its tensors."""
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend \
        else torch.device("cpu")


def _values_restored():
    """Whether this process starts in a round that resumes from a snapshot in
    memory (``ductile agent`` sets DUCTILE_SNAPSHOT_RESTORE): the engine gives
    every parameter the snapshot's value once it exists, so what zero3.init's
    parameters hold before (a model's initialisation under
    GatheredParameters) is overwritten, and is kept local: workers that
    rejoin the round in place, which build no model, run no such collective."""
    from ._snapshots import RESTORE_ENV
    return bool(os.environ.get(RESTORE_ENV))


def _gather_init(shard):
    """The whole value of a parameter zero3.init partitioned (new memory, on
    the CPU): every rank's slice, gathered (in a round restored from memory,
    this rank's slice in its place and zeros elsewhere)."""
    if shard.world == 1:
        return shard.values[:shard.numel].clone().view(shard.shape)
    if _values_restored():
        return shard.whole().view(shard.shape)
    device = _collective_device()
    local = shard.values.to(device)
    pieces = [torch.empty_like(local) for _ in range(shard.world)]
    torch.distributed.all_gather(pieces, local)
    return torch.cat(pieces)[:shard.numel].cpu().view(shard.shape)


def _scatter_init(shard, full, modifier_rank):
    """Rank `modifier_rank`'s `full` value becomes every rank's slice."""
    flat = full.detach().reshape(-1).contiguous()
    if shard.world > 1 and not _values_restored():
        device = _collective_device()
        on_device = flat.to(device)
        torch.distributed.broadcast(on_device, modifier_rank)
        flat = on_device.cpu()
    shard.take(flat)


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=0): ...``: inside,
    each of `params` (parameters of a zero3 model or built under
    zero3.init, or a module: its parameters) holds its whole value (in the
    model's dtype, the fp32 masters' values with mixed precision). On exit,
    with modifier_rank set, that rank's values (changes included) are
    broadcast and become the shards (and the optimizer's masters)
    everywhere; with modifier_rank None changes are dropped. Collective (a
    zero3.init parameter, before any engine has it, over torch.distributed's
    default group); use it between passes, not inside a forward."""

    def __init__(self,
                 params: torch.nn.Module | torch.nn.Parameter | Iterable[torch.nn.Parameter],
                 modifier_rank: int | None = None, enabled: bool = True) -> None:
        self.params = parameters_of(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._held: list[tuple[Zero3Engine, Any]] = []  # (engine, its ZeroParam)
        self._built: list[tuple[torch.nn.Parameter, InitShard]] = []  # zero3.init's

    def __enter__(self) -> Self:
        if not self.enabled:
            return self
        seen = set()
        for p in self.params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            engine, zp = _owner(p)
            if engine is None:
                shard = shard_of(p)
                if shard is None:
                    raise InvalidArgumentError(
                        "zero3.GatheredParameters: a parameter that neither a live zero3 engine "
                        "manages nor zero3.init partitioned")
                _init_world(shard, self.modifier_rank)
                self._built.append((p, shard))
                continue
            if engine._passes.pass_open:
                raise IncompatibleError(
                    "zero3.GatheredParameters: inside a pass (between a forward and the end of "
                    "its backward); use it between steps")
            if self.modifier_rank is not None and not 0 <= self.modifier_rank < engine.world_size:
                raise InvalidArgumentError(
                    f"zero3.GatheredParameters: modifier_rank {self.modifier_rank} is not a rank "
                    f"of the {engine.world_size}-rank world")
            self._held.append((engine, zp))
        with torch.no_grad():
            for engine, zp in self._held:
                zp.param.data = _gather(engine, zp, zp.orig_dtype)
            for p, shard in self._built:
                p.data = _gather_init(shard)
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        if not self.enabled:
            return False
        try:
            if self.modifier_rank is not None:
                for engine, zp in self._held:
                    with torch.no_grad():
                        flat = zp.param.data.reshape(-1).contiguous()
                        if engine.world_size > 1:
                            engine.comm.broadcast(flat, self.modifier_rank).wait()
                        lo, hi = zp.slice_of(engine.rank)
                        engine.shards_writable()
                        zp.shard.zero_()
                        zp.shard[:hi - lo].copy_(flat[lo:hi])
                    engine.shards_changed()
                with torch.no_grad():
                    for p, shard in self._built:
                        _scatter_init(shard, p.data, self.modifier_rank)
        finally:
            with torch.no_grad():
                for engine, zp in self._held:
                    zp.param.data = engine._passes.placeholders.get(zp.dtype)
                for p, shard in self._built:
                    p.data = torch.empty(0, dtype=shard.dtype, device=p.device)
            self._held = []
            self._built = []
        return False
