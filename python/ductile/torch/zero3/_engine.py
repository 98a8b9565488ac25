"""The ZeRO-3 engine: a torch.nn.Module's parameters partitioned by the C++
coordinator (the configured ``zero`` plugin) over the ranks of its
accelerator, gathered just in time by module hooks.

What lives where:
- the coordinator owns every shard and every gathered copy, records the
  module trace and decides what to prefetch and release (C++);
- this engine tells it which module runs (fetch/release around each
  module's forward and backward), points ``param.data`` at the gathered
  copy while a module using it runs (an empty tensor otherwise),
  reduce-scatters each full gradient into this rank's gradient shard as soon
  as autograd has produced it, and lets an optimizer step on shards.

Tensors autograd saves for backward that lie in a gathered copy (a weight,
or a view of it such as ``weight.t()``) are saved as "parameter p, this
view" and rebuilt over the copy gathered again for backward, so a release
in between can never leave autograd reading freed memory.
"""

import bisect
import collections
import functools

import torch

from ... import _ductile
from ..._config import load_config
from ..._errors import ConfigError, IncompatibleError, InvalidArgumentError, UnsupportedError
from . import _hooks
from ._gradients import GradientReducer
from ._memory import DeviceMemory, type_name

_EXTERNAL = "_ductile_zero3_external_parameters"
_ENGINE = "_ductile_zero3_engine"


def register_external_parameter(module, parameter):
    """Declares that ``module``'s forward uses ``parameter`` although it
    belongs to another module (DeepSpeed's
    ``deepspeed.zero.register_external_parameter``): the engine gathers it
    with ``module``'s own parameters. Call it before ``initialize``."""
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgumentError(
            f"register_external_parameter: module must be a torch.nn.Module, got "
            f"{type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise InvalidArgumentError(
            f"register_external_parameter: parameter must be a torch.nn.Parameter, got "
            f"{type(parameter).__name__}")
    if module.__dict__.get(_ENGINE):
        raise IncompatibleError(
            f"register_external_parameter: {type(module).__name__} is already managed by a "
            "zero3 engine; register external parameters before initialize()")
    listed = module.__dict__.setdefault(_EXTERNAL, [])
    if not any(p is parameter for p in listed):
        listed.append(parameter)


class _Param:
    """One unique parameter of the model and what the engine knows of it."""

    __slots__ = ("id", "name", "param", "shape", "numel", "dtype", "type", "element_size",
                 "shard_numel", "shard", "direct", "full", "full_address", "full_bytes", "view",
                 "users", "persistent")

    def __init__(self, pid, name, param):
        self.id = pid
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.dtype = param.dtype
        self.type = type_name(param.dtype, f"parameter '{name}'")
        self.element_size = param.element_size()
        self.shard_numel = 0
        self.shard = None         # this rank's shard, the optimizer's parameter
        self.direct = False       # the shard is the coordinator's memory (else a copy)
        self.full = None          # flat tensor over the gathered copy (while materialized)
        self.full_address = 0
        self.full_bytes = 0
        self.view = None          # full[:numel].view(shape)
        self.users = 0            # fetched modules (engine-side) materializing it
        self.persistent = False


class _GuardedParameters(collections.OrderedDict):
    """A module's ``_parameters`` that refuses, during a forward, a
    parameter no running module has gathered (its data is the empty
    placeholder): the user sees which parameter to declare as external
    instead of a shape error from deep inside torch."""

    def __getitem__(self, key):
        p = super().__getitem__(key)
        engine = self.__dict__.get("engine")
        if engine is not None and engine._in_forward and p is not None:
            info = engine._info_of.get(id(p))
            if info is not None and info.users == 0:
                where = engine._module_stack[-1] if engine._module_stack else "<root>"
                raise IncompatibleError(
                    f"zero3: the forward of '{where}' uses parameter '{info.name}', which only "
                    "the modules owning it gather; declare it with ductile.torch.zero3."
                    "register_external_parameter(module, parameter) before initialize()")
        return p


class _SavedView:
    """What the pack hook keeps instead of a view of a gathered copy."""

    __slots__ = ("param", "offset", "size", "stride")

    def __init__(self, param, offset, size, stride):
        self.param = param
        self.offset = offset
        self.size = size
        self.stride = stride


class Zero3Engine:
    """See ``ductile.torch.zero3.initialize``."""

    def __init__(self, model, optimizer_factory=None, config=None, *, plugin_path=None):
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(
                f"zero3.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
        if config is None:
            raise InvalidArgumentError(
                "zero3.initialize: config is required: a ductile TOML (path, text or dict) with "
                "[zero] and [accelerator] sections")
        loaded = load_config(config, format="toml" if isinstance(config, dict) else None,
                             plugin_path=plugin_path)
        if loaded.format != "toml":
            raise ConfigError(
                f"{loaded.origin}: zero3 needs a ductile TOML configuration with [zero] and "
                "[accelerator] sections, got a DeepSpeed JSON config")
        self.config = loaded
        self._session = _ductile.zero.Session(loaded.runtime)
        self.rank = self._session.rank
        self.world_size = self._session.size
        self._memory = DeviceMemory(self._session.backend)
        self.module = model

        self._params = []
        by_tensor = {}
        for name, p in model.named_parameters():
            if p.numel() == 0:
                continue  # nothing to partition; it stays as it is
            if p.device != self._memory.device:
                raise InvalidArgumentError(
                    f"zero3.initialize: parameter '{name}' is on {p.device}, the "
                    f"{self._session.backend} accelerator needs {self._memory.device}; move the "
                    "model first")
            info = _Param(len(self._params), name, p)
            self._params.append(info)
            by_tensor[id(p)] = info
        if not self._params:
            raise InvalidArgumentError("zero3.initialize: the model has no parameters")

        self._info_of = by_tensor  # id(param) -> _Param
        self._partition()
        self._module_ids = {}      # module -> coordinator module id
        self._module_params = []   # module id -> [_Param]
        self._module_names = []
        self._register_modules(model, by_tensor)
        self._make_shards()

        self._fetched = [0] * len(self._module_params)
        # Fetches of modules run again inside backward (activation
        # checkpointing recomputes them): held until the module's backward
        # is done, since the recomputed saved tensors point into the copy.
        self._recompute_holds = [0] * len(self._module_params)
        self._grad_hooks = []      # this pass's backward hook handles
        self._live_starts = []     # sorted addresses of materialized copies
        self._live = []            # their _Param, same order
        self._pass_open = False
        self._backward_active = False
        self._module_stack = []    # names of the hooked modules in forward, innermost last
        self._in_forward = False
        self._gradients = GradientReducer(self._session, self.world_size)
        self.module_callback = None
        self._placeholders = {}
        self._handles = []
        with torch.no_grad():
            self._gradients.install(self._params)
            for info in self._params:
                info.param.data = self._placeholder(info.dtype)
        self._install_module_hooks(model)
        self.optimizer = None
        if optimizer_factory is not None:
            self.optimizer = optimizer_factory([info.shard for info in self._params])

    # --- set-up --------------------------------------------------------------

    def _partition(self):
        """Rank 0's values (as DistributedDataParallel does) become the shards."""
        session = self._session
        with torch.no_grad():
            for info in self._params:
                data = info.param.data
                if not data.is_contiguous():
                    data = data.contiguous()
                if self.world_size > 1:
                    session.broadcast(data.data_ptr(), info.numel, info.type, 0).wait()
                session.register_parameter(info.id, info.numel, info.type)
                session.set_full(info.id, data.data_ptr(), info.numel * info.element_size)

    def _register_modules(self, model, by_tensor):
        for name, module in model.named_modules():
            members = []
            for p in module.parameters(recurse=False):
                info = by_tensor.get(id(p))
                if info is not None and info not in members:
                    members.append(info)
            for p in module.__dict__.get(_EXTERNAL, []):
                info = by_tensor.get(id(p))
                if info is None:
                    raise InvalidArgumentError(
                        f"zero3.initialize: an external parameter registered on module "
                        f"'{name or type(module).__name__}' is not a parameter of the model")
                if info not in members:
                    members.append(info)
            if not members:
                continue
            mid = len(self._module_params)
            self._session.register_module(mid, [info.id for info in members])
            self._module_ids[module] = mid
            self._module_params.append(members)
            self._module_names.append(name or "<root>")

    def _make_shards(self):
        """The optimizer's shard of each parameter: the coordinator's own
        memory where it gives access to it (ShardStorage), else a copy that
        is written back before each pass (a coordinator without the
        capability, or a shard kept in a file under nvme_path)."""
        session = self._session
        for info in self._params:
            info.shard_numel = session.shard_numel(info.id)
            info.persistent = session.is_persistent(info.id)
            shard = None
            if session.has_shard_storage:
                try:
                    address = session.shard_data(info.id)
                except UnsupportedError:
                    address = None
                if address is not None:
                    shard = self._memory.tensor(address, info.shard_numel, info.dtype)
            info.direct = shard is not None
            if shard is None:
                shard = torch.empty(info.shard_numel, dtype=info.dtype, device=self._memory.device)
                session.read_shard(info.id, shard.data_ptr(), info.shard_numel * info.element_size)
            info.shard = torch.nn.Parameter(shard, requires_grad=info.param.requires_grad)
            if info.direct:
                # The coordinator owns the memory: it lives as long as the shard.
                info.shard._ductile_zero3_session = session

    def _install_module_hooks(self, model):
        original = model.forward
        engine = self

        def forward(*args, **kwargs):
            return engine._root_forward(original, args, kwargs)
        model.__dict__["forward"] = forward
        model.__dict__[_ENGINE] = True
        for module in model.modules():
            mid = self._module_ids.get(module)
            if mid is None:
                continue
            module.__dict__[_ENGINE] = True
            if any(id(p) in self._info_of for p in module.parameters(recurse=False)):
                guarded = _GuardedParameters(module._parameters)
                guarded.engine = self
                module.__dict__["_parameters"] = guarded
            self._handles.append(module.register_forward_pre_hook(
                _pre_forward_hook(self, mid), with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                _post_forward_hook(self, mid), with_kwargs=True))

    def _placeholder(self, dtype):
        t = self._placeholders.get(dtype)
        if t is None:
            t = self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self._memory.device)
        return t

    # --- passes, fetch and release --------------------------------------------

    def _begin_pass(self):
        """The optimizer may have changed the shards since the last pass: a
        shard in the coordinator's memory needs only its copy that outlived
        the pass (a persistent one) dropped; a copied shard is written back."""
        for info in self._params:
            self._shard_changed(info)
        self._pass_open = True

    def _shard_changed(self, info):
        if not info.direct:
            self._session.set_shard(info.id, info.shard.data_ptr(),
                                    info.shard_numel * info.element_size)
        elif info.persistent:
            self._session.shard_written(info.id)

    def _end_pass(self):
        self._release_everything()
        self._gradients.drain()
        self._session.end_step()
        self._pass_open = False

    def _fetch(self, mid):
        count = self._fetched[mid]
        if count == 0:
            if not self._pass_open:
                self._begin_pass()
            self._session.fetch(mid)
            self._materialize(mid)
        self._fetched[mid] = count + 1
        if self.module_callback is not None:
            self.module_callback("fetch", self._module_names[mid], self._session.stats())

    def _release(self, mid):
        count = self._fetched[mid]
        if count == 0:
            return  # released already, by the end of the pass
        self._fetched[mid] = count - 1
        # Drive the gathers in flight: on transports that progress only
        # inside MPI calls, a peer's gather advances when this rank polls
        # (its progress thread may not get the core while it computes).
        self._session.progress()
        if count == 1:
            self._session.release(mid)
            self._dematerialize(mid)
            if self.module_callback is not None:
                self.module_callback("release", self._module_names[mid], self._session.stats())

    def _materialize(self, mid):
        session = self._session
        for info in self._module_params[mid]:
            if info.users == 0:
                address = session.full_data(info.id)
                if address != info.full_address or info.full is None:
                    numel = self.world_size * info.shard_numel
                    info.full = self._memory.tensor(address, numel, info.dtype)
                    info.full_address = address
                    info.full_bytes = numel * info.element_size
                    info.view = info.full[:info.numel].view(info.shape)
                info.param.data = info.view
                i = bisect.bisect_left(self._live_starts, address)
                self._live_starts.insert(i, address)
                self._live.insert(i, info)
            info.users += 1

    def _dematerialize(self, mid):
        for info in self._module_params[mid]:
            info.users -= 1
            if info.users == 0:
                info.param.data = self._placeholder(info.dtype)
                i = bisect.bisect_left(self._live_starts, info.full_address)
                del self._live_starts[i]
                del self._live[i]
                # The copy may be freed now: never touch it again.
                info.full = None
                info.view = None
                info.full_address = 0

    def _owner(self, tensor):
        """The materialized parameter whose gathered copy holds `tensor`'s data."""
        if not self._live_starts or tensor.numel() == 0:
            return None
        address = tensor.data_ptr()
        i = bisect.bisect_right(self._live_starts, address) - 1
        if i < 0:
            return None
        info = self._live[i]
        return info if address < info.full_address + info.full_bytes else None

    # --- saved tensors --------------------------------------------------------

    def _pack(self, tensor):
        info = self._owner(tensor)
        if info is None:
            return tensor
        if tensor.dtype != info.dtype or tensor.device != info.full.device:
            return tensor.clone()  # a reinterpreting view: keep a private copy
        return _SavedView(info, tensor.storage_offset(), tuple(tensor.size()),
                          tuple(tensor.stride()))

    def _unpack(self, packed):
        if type(packed) is not _SavedView:
            return packed
        info = packed.param
        if info.users == 0:
            raise IncompatibleError(
                f"zero3: backward needs parameter '{info.name}', which no running module has "
                "gathered; if a module's forward uses a parameter of another module, declare "
                "it with ductile.torch.zero3.register_external_parameter(module, parameter) "
                "before initialize()")
        return info.full.as_strided(packed.size, packed.stride, packed.offset)

    # --- module hooks ------------------------------------------------------------

    def _root_forward(self, forward, args, kwargs):
        """The model's forward, with the saved-tensor hooks on."""
        if self._backward_active:
            self._abandon()  # the last backward raised before it ended
        self._in_forward = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                output = forward(*args, **kwargs)
        except BaseException:
            self._abandon()
            raise
        finally:
            self._in_forward = False
        if not torch.is_grad_enabled() and self._pass_open:
            self._end_pass()  # no backward follows a pass without grad
        return output

    def _abandon(self):
        """After a forward or backward that raised: releases what it had
        fetched and waits for its gradients, locally (no collective: the
        other ranks may not have failed), so the next pass starts clean."""
        self._module_stack.clear()
        self._backward_active = False
        self._release_everything()
        self._gradients.abandon()

    def _release_everything(self):
        """The end of a pass: every module still fetched is released, and the
        backward hooks of modules whose backward did not run are dropped (a
        hook on a tensor that outlives the pass would fire in a later one)."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        for mid, count in enumerate(self._fetched):
            self._recompute_holds[mid] = 0
            if count:
                self._fetched[mid] = 1
                self._release(mid)

    def _enter_backward(self):
        """Called from inside autograd's backward: the first call of a pass
        queues the end of the pass for when the backward is done."""
        if not self._backward_active:
            self._backward_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_backward(self, mid):
        self._enter_backward()
        self._fetch(mid)

    def _post_backward(self, mid):
        self._release(mid)
        holds, self._recompute_holds[mid] = self._recompute_holds[mid], 0
        for _ in range(holds):
            self._release(mid)

    def _end_backward(self):
        self._backward_active = False
        self._end_pass()

    # --- public API --------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss, **kwargs):
        """``loss.backward(**kwargs)``; gradient shards are complete when it returns."""
        loss.backward(**kwargs)

    def step(self):
        """Steps the optimizer on the shards, then clears the gradient shards."""
        if self.optimizer is None:
            raise IncompatibleError(
                "zero3: step() needs an optimizer; pass optimizer_factory to initialize()")
        if self._backward_active:
            raise IncompatibleError("zero3: step() called during backward")
        self.optimizer.step()
        self.zero_grad()

    def zero_grad(self):
        for info in self._params:
            info.shard.grad = None

    def shard_parameters(self):
        """This rank's shards, one flat tensor per parameter, in
        ``model.named_parameters()`` order: what the optimizer steps on."""
        return [info.shard for info in self._params]

    def named_shards(self):
        return [(info.name, info.shard) for info in self._params]

    def stats(self):
        """The coordinator's counters (gathers, prefetched, waited time, live
        and peak elements, trace) plus the engine's gradient reduce-scatters."""
        s = self._session.stats()
        s.update(self._gradients.counters)
        s["rank"] = self.rank
        s["world_size"] = self.world_size
        s["shard_bytes"] = sum(i.shard_numel * i.element_size for i in self._params)
        s["parameter_bytes"] = sum(i.numel * i.element_size for i in self._params)
        return s

    def trace(self):
        """The recorded module order, as module names (empty while recording)."""
        return [self._module_names[mid] for mid in self._session.trace()]

    def all_reduce(self, tensor, op="mean"):
        """All-reduces a contiguous tensor in place over the engine's ranks
        (op: sum, mean, min, max) and returns it. Collective."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            raise InvalidArgumentError("zero3: all_reduce needs a contiguous torch.Tensor")
        if op not in ("sum", "mean", "min", "max"):
            raise InvalidArgumentError(
                f"zero3: all_reduce op '{op}' is unknown; valid: sum, mean, min, max")
        kind = type_name(tensor.dtype, "the all_reduce tensor")
        self._session.all_reduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), kind,
                                 "sum" if op == "mean" else op).wait()
        if op == "mean":
            tensor.div_(self.world_size)
        return tensor

    def full_parameters(self):
        """Every parameter, whole, on every rank (a dict name -> tensor, new
        memory): the shards all-gathered. Collective."""
        out = {}
        for info in self._params:
            full = torch.empty(self.world_size * info.shard_numel, dtype=info.dtype,
                               device=self._memory.device)
            shard = info.shard.detach()
            self._session.all_gather(shard.data_ptr(), full.data_ptr(), info.shard_numel,
                                     info.type).wait()
            out[info.name] = full[:info.numel].view(info.shape).clone()
        return out

    def check_invariants(self):
        self._session.check_invariants()

    def close(self):
        """Removes the hooks and gives every parameter its full values back
        (all-gathered; collective). The engine is unusable afterwards."""
        if self._pass_open:
            self._end_pass()
        full = self.full_parameters()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.module.__dict__.pop("forward", None)
        for module in self.module.modules():
            module.__dict__.pop(_ENGINE, None)
            if isinstance(module.__dict__.get("_parameters"), _GuardedParameters):
                module.__dict__["_parameters"] = collections.OrderedDict(module._parameters)
        self._gradients.remove()
        with torch.no_grad():
            for info in self._params:
                info.param.data = full[info.name]

    def save(self, directory, client_state=None):
        """Writes this rank's shards and optimizer state under `directory`
        (rank 0 adds the manifest). Collective. See _checkpoint.py."""
        from . import _checkpoint
        _checkpoint.save(self, directory, client_state)

    def load(self, directory):
        """Restores shards and optimizer state saved at any world size;
        returns the client_state given to save(). Collective."""
        from . import _checkpoint
        return _checkpoint.load(self, directory)


def _inside_backward():
    """True while autograd's engine runs a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def _pre_forward_hook(engine, mid):
    post_backward = functools.partial(engine._post_backward, mid)

    def hook(module, args, kwargs):
        if _inside_backward():
            engine._enter_backward()
            # A recomputation inside backward (non-reentrant activation
            # checkpointing): autograd keeps what it recomputes, views of the
            # gathered copy among them, until this module's backward, so the
            # module stays fetched until then (counted now: a recomputation
            # that torch stops early never reaches the forward hook).
            engine._fetch(mid)
            engine._recompute_holds[mid] += 1
            return None
        engine._module_stack.append(engine._module_names[mid])
        engine._fetch(mid)
        if torch.is_grad_enabled():
            engine._grad_hooks.extend(_hooks.after_backward(post_backward, args, kwargs))
        return None
    return hook


def _post_forward_hook(engine, mid):
    pre_backward = functools.partial(engine._pre_backward, mid)

    def hook(module, args, kwargs, output):
        if _inside_backward():
            return None  # a recomputation: released after the module's backward
        engine._module_stack.pop()
        engine._release(mid)
        if torch.is_grad_enabled():
            engine._grad_hooks.extend(_hooks.before_backward(pre_backward, output))
        return None
    return hook
