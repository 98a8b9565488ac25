"""Units and passes: which modules zero3 hooks (a unit: a transformer block by default), and
the forward and backward passes over them that gather, release and reduce their groups."""

import collections

import torch

from ... import _ductile
from ..._errors import IncompatibleError, InvalidArgumentError


class Placeholders:
    """One empty tensor per dtype: ``param.data`` between uses."""

    def __init__(self, device):
        self._device = device
        self._by_dtype = {}

    def get(self, dtype):
        t = self._by_dtype.get(dtype)
        if t is None:
            t = self._by_dtype[dtype] = torch.empty(0, dtype=dtype, device=self._device)
        return t


# Which modules the engine hooks (units) and which parameters each gathers (FSDP2's
# ``fully_shard`` per module, chosen by a policy: ``groups`` of ``zero3.initialize``, described
# there and in docs/zero3.md). A unit owns the parameters of the modules under it that no nested
# unit owns, one group a dtype, and also gathers the groups of parameters its modules use but
# another unit owns (a tie across units, or ``register_external_parameter``).

EXTERNAL = "_ductile_zero3_external_parameters"


class Unit:
    """A hooked module, the groups it owns and the groups it gathers."""

    __slots__ = ("module", "name", "own", "groups", "id")

    def __init__(self, module, name):
        self.module = module
        self.name = name
        self.own = []      # ParamGroups it owns (one a dtype)
        self.groups = []   # ParamGroups it gathers: its own first, then others'
        self.id = -1       # the coordinator's module id


def _block_classes(model):
    names: set[str] = set()
    for module in model.modules():
        listed = getattr(module, "_no_split_modules", None)
        if isinstance(listed, (list, tuple, set)):
            names.update(n for n in listed if isinstance(n, str))
    return names


def _has_parameters(module):
    return any(True for _ in module.parameters())


def _selector(model, policy):
    """A predicate module -> is a unit (the root aside), or None for "module"."""
    if policy is None or policy == "auto":
        names = _block_classes(model)
        if names and any(type(m).__name__ in names for m in model.modules()):
            return lambda m: type(m).__name__ in names
        listed: set[int] = set()
        for m in model.modules():
            if isinstance(m, torch.nn.ModuleList):
                listed.update(id(c) for c in m.children() if _has_parameters(c))
        if listed:
            return lambda m: id(m) in listed
        return None
    if policy == "module":
        return None
    if isinstance(policy, type):
        policy = (policy,)
    if isinstance(policy, (tuple, list, set, frozenset)):
        classes = tuple(policy)
        if classes and all(isinstance(c, type) and issubclass(c, torch.nn.Module)
                           for c in classes):
            return lambda m: isinstance(m, classes)
    elif callable(policy):
        return lambda m: bool(policy(m))
    raise InvalidArgumentError(
        f"zero3.initialize: groups = {policy!r}; valid: \"auto\", \"module\", a tuple of "
        "torch.nn.Module classes, or a callable module -> bool")


def plan(model, param_of, policy, make_group):
    """The units of `model`, in named_modules() order (the root first when it
    is one). `param_of`: id(parameter) -> ZeroParam of every managed
    parameter. `make_group(name, members)` makes a ParamGroup."""
    select = _selector(model, policy)
    per_module = select is None
    unit_of: dict[int, Unit] = {}  # id(module) -> the Unit whose modules it belongs to
    units: dict[int, Unit] = {}
    for name, module in model.named_modules():
        owner = None
        if module is not model and not per_module and not select(module):
            owner = unit_of.get(id(_parent_of(model, name)))
        if owner is None:
            owner = units.setdefault(id(module), Unit(module, name or "<root>"))
        unit_of[id(module)] = owner
    # Parameters to their owning unit, in named_modules() order (a tied
    # parameter belongs to the first module holding it).
    owned: dict[int, list] = {key: [] for key in units}
    used: dict[int, list] = {key: [] for key in units}
    taken = set()
    for name, module in model.named_modules():
        unit = unit_of[id(module)]
        key = id(unit.module)
        for p in module.parameters(recurse=False):
            zp = param_of.get(id(p))
            if zp is None:
                continue
            if id(p) not in taken:
                taken.add(id(p))
                owned[key].append(zp)
            used[key].append(zp)
        for p in module.__dict__.get(EXTERNAL, []):
            zp = param_of.get(id(p))
            if zp is None:
                raise InvalidArgumentError(
                    f"zero3.initialize: an external parameter registered on module "
                    f"'{name or type(module).__name__}' is not a parameter of the model")
            used[key].append(zp)
    for key, unit in units.items():
        by_dtype: dict[torch.dtype, list] = {}
        for zp in owned[key]:
            by_dtype.setdefault(zp.dtype, []).append(zp)
        unit.own = [make_group(unit.name, members) for members in by_dtype.values()]
    for key, unit in units.items():
        seen = {id(g) for g in unit.own}
        unit.groups = list(unit.own)
        for zp in used[key]:
            if zp.group is not None and id(zp.group) not in seen:
                seen.add(id(zp.group))
                unit.groups.append(zp.group)
    return [u for u in units.values() if u.groups]


def _parent_of(model, name):
    if not name:
        return None
    parent = name.rpartition(".")[0]
    return model.get_submodule(parent) if parent else model


# Fetch and release of the groups, the hooks that drive them and the passes they run in (FSDP2's
# ``FSDPState`` seam; docs/zero3.md, "Gathering"). The hooks, the counts, the materialisation and
# where the passes are (``state``, a ``TrainingState``) are C++ (``_ductile.zero.UnitPasses``,
# python/src/unit_passes.cpp), which torch calls directly; this module installs them and runs the
# edges of a pass, which the step path calls through the one ``PassEvents`` object ``Passes`` is.
# Nothing is inserted into the graph and no tensor is replaced, so custom output types, tensor
# identity and in-place changes behave as without ductile. A unit's last release in a backward
# reduce-scatters its own groups (autograd runs AccumulateGrad nodes first, so their gradients are
# in); the end of a backward reduce-scatters what is left (a parameter used by a later unit, a
# unit whose inputs need no gradient). While the trace is recorded, each module's ``_parameters``
# refuses a parameter no running unit gathered, naming it (GuardedParameters); once the trace
# runs, the plain dict is back (no Python call a parameter).

ENGINE = "_ductile_zero3_engine"

TrainingState = _ductile.zero.TrainingState

__all__ = ["ENGINE", "EXTERNAL", "GuardedParameters", "Passes", "TrainingState"]


class GuardedParameters(collections.OrderedDict):
    """A module's ``_parameters`` that refuses, during a forward, a
    parameter no running unit has gathered (its data is the empty
    placeholder): the user sees which parameter to declare as external
    instead of a shape error from deep inside torch."""

    # The engine's passes, set after construction; read from __dict__ (a
    # dict subclass without it guards nothing).
    passes: "Passes"

    def __getitem__(self, key):
        p = super().__getitem__(key)
        passes = self.__dict__.get("passes")
        if passes is not None and passes.in_forward and p is not None:
            zp = passes.param_of.get(id(p))
            if zp is not None and zp.group.users == 0:
                where = passes.module_stack[-1] if passes.module_stack else "<root>"
                raise IncompatibleError(
                    f"zero3: the forward of '{where}' uses parameter '{zp.name}', which only "
                    "the modules owning it gather; declare it with ductile.torch.zero3."
                    "register_external_parameter(module, parameter) before initialize()")
        return p


class Passes(_ductile.zero.PassEvents):
    """One engine's passes over its model: the unit hooks, the fetch and
    release of each unit's groups, and the reduce-scatters a backward
    starts. The hooks and the counts are C++ (``_ductile.zero.UnitPasses``,
    python/src/unit_passes.hpp): a unit's forward and backward call no
    Python function of ductile's but ``gradients.reduce`` once a group; the
    edges of a pass (its start, the end of its backward) run here, as the
    step path's ``PassEvents``."""

    def __init__(self, session, memory, params, groups, gradients, begin_pass):
        super().__init__()
        self.session = session
        self.memory = memory
        self.params = params
        self.groups = groups
        self.param_of = {id(zp.param): zp for zp in params}
        self.gradients = gradients
        # The events the step path calls, bound straight to what runs them
        # (one Python call each): the engine's start of a pass, and the
        # reducer once a group whose unit's backward is done.
        self.begin_pass = begin_pass
        self.reduce_gradients = gradients.reduce
        self.units = []           # coordinator module id -> Unit
        self.module_names = []
        self.live = _ductile.zero.LiveCopies()
        self.core = _ductile.zero.UnitPasses(session, self.live, self)
        self.placeholders = Placeholders(memory.device)
        self._guarded_modules = []  # (module, GuardedParameters, plain dict)
        self._guarded = False
        self.in_forward = False   # the root's forward is running (GuardedParameters)
        self._handles = []
        self._own_forward = None  # the instance's own forward before install()

    # The state of the passes the C++ step path keeps and acts on.
    module_callback = property(lambda self: self.core.module_callback,
                               lambda self, value: setattr(self.core, "module_callback", value))

    @property
    def state(self):
        """Where the passes are: a TrainingState."""
        return self.core.state

    @property
    def pass_open(self):
        return self.core.state != TrainingState.IDLE

    @property
    def backward_active(self):
        return self.core.state == TrainingState.BACKWARD

    @property
    def module_stack(self):
        """Names of the units in forward, innermost last."""
        return self.core.module_stack

    # --- set-up ------------------------------------------------------------------

    def register_units(self, units):
        for unit in units:
            unit.id = self.core.add_unit(unit.name, unit.groups, unit.own)
            self.session.register_module(unit.id, [g.id for g in unit.groups])
            self.units.append(unit)
            self.module_names.append(unit.name)

    def install(self, model):
        original = model.forward
        # A forward the instance had of its own (a library's patch, as TRL's
        # fused LM head), given back by uninstall.
        self._own_forward = model.__dict__.get("forward")
        passes = self

        def forward(*args, **kwargs):
            return passes.root_forward(original, args, kwargs)
        model.__dict__["forward"] = forward
        model.__dict__[ENGINE] = True
        for module in model.modules():
            if any(id(p) in self.param_of for p in module.parameters(recurse=False)):
                module.__dict__[ENGINE] = True
                guarded = GuardedParameters(module._parameters)
                guarded.passes = self
                self._guarded_modules.append((module, guarded))
        self._set_guards(True)
        for unit in self.units:
            unit.module.__dict__[ENGINE] = True
            self._handles.append(unit.module.register_forward_pre_hook(
                self.core.pre_forward_hook(unit.id), with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(
                self.core.post_forward_hook(unit.id), with_kwargs=True))
        for group in self.groups:
            group.placeholder = self.placeholders.get(group.dtype)
        with torch.no_grad():
            for zp in self.params:
                zp.param.data = zp.group.placeholder

    def _set_guards(self, on):
        """Each module's _parameters guarded (while the trace is recorded)
        or plain (once it runs); the same entries either way."""
        for module, guarded in self._guarded_modules:
            current = module.__dict__["_parameters"]
            if on and current is not guarded:
                guarded.clear()
                guarded.update(current)
                module.__dict__["_parameters"] = guarded
            elif not on and current is guarded:
                module.__dict__["_parameters"] = collections.OrderedDict(guarded)
        self._guarded = on

    def uninstall(self, model):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._set_guards(False)
        self._guarded_modules = []
        model.__dict__.pop("forward", None)
        own, self._own_forward = self._own_forward, None
        if own is not None:
            model.__dict__["forward"] = own
        for module in model.modules():
            module.__dict__.pop(ENGINE, None)
        self.core.close()

    # --- passes, fetch and release ---------------------------------------------------

    def gathered_views(self, group, address):
        """(full, member views) over `group`'s gathered copy at `address`
        (called by the step path when it has none kept for that address)."""
        return group.views_at(self.memory, address)

    def end_pass(self):
        self.core.release_everything()
        self.gradients.drain()
        self.session.end_step()
        self.core.state = TrainingState.IDLE
        recording = self.session.trace_mode != "complete"
        if recording != self._guarded:
            self._set_guards(recording)

    def abandon(self):
        """After a forward or backward that raised: releases what it had
        fetched and waits for its gradients, locally (no collective: the
        other ranks may not have failed), so the next pass starts clean."""
        self.core.clear_stack()
        if self.core.state == TrainingState.BACKWARD:
            self.core.state = TrainingState.FORWARD  # the pass stays open
        self.core.release_everything()
        self.gradients.abandon(self.groups)

    # --- the root and the end of a backward ----------------------------------------------

    def root_forward(self, forward, args, kwargs):
        """The model's forward, with the saved-tensor hooks on."""
        if self.core.state == TrainingState.BACKWARD:
            self.abandon()  # the last backward raised before it ended
        self.in_forward = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.live.pack,
                                                          _ductile.zero.unpack_saved):
                output = forward(*args, **kwargs)
        except BaseException:
            self.abandon()
            raise
        finally:
            self.in_forward = False
        if not torch.is_grad_enabled() and self.core.state != TrainingState.IDLE:
            self.end_pass()  # no backward follows a pass without grad
        return output

    def end_backward(self):
        """Queued by the step path at the first backward hook of a pass: the
        gradients left (a parameter used by a later unit, a unit whose inputs
        need no gradient) are reduced and the pass ends."""
        self.core.state = TrainingState.POST_BACKWARD
        for group in self.core.groups_with_gradients(self.groups):
            self.gradients.reduce(group)
        self.end_pass()
