"""Which modules the zero3 engine hooks and which parameters each gathers
(FSDP2's ``fully_shard`` per module, chosen by a policy instead of by hand).

A *unit* is a hooked module: its forward fetches, its end releases, and the
end of its backward reduce-scatters. It owns a *group* (_param.ParamGroup):
the parameters of the modules under it that no nested unit owns, one group
a dtype. It also gathers the groups of parameters that its modules use but
another unit owns: a weight tied across units, or one declared with
``register_external_parameter``.

``groups`` of ``zero3.initialize`` says which modules are units:

- ``"auto"`` (the default): the transformer blocks. A Hugging Face model
  names them (``_no_split_modules``, the classes ``accelerate`` never
  splits); otherwise each child of an ``nn.ModuleList`` that holds
  parameters is one. The root owns the rest (embeddings, final norm,
  head). A model with neither falls back to ``"module"``.
- ``"module"``: every module that owns parameters (DeepSpeed's granularity:
  the least gathered memory, the most collectives).
- a tuple of module classes, or a callable ``module -> bool``: those
  modules, and the root.
"""

import collections

import torch

from ..._errors import InvalidArgumentError

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
        if names:
            if any(type(m).__name__ in names for m in model.modules()):
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
        if not classes or not all(isinstance(c, type) and issubclass(c, torch.nn.Module)
                                  for c in classes):
            raise InvalidArgumentError(
                f"zero3.initialize: groups = {policy!r}; valid: \"auto\", \"module\", a tuple "
                "of torch.nn.Module classes, or a callable module -> bool")
        return lambda m: isinstance(m, classes)
    if callable(policy):
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
    units: collections.OrderedDict[int, Unit] = collections.OrderedDict()
    for name, module in model.named_modules():
        if module is model:
            owner = None
        elif per_module:
            owner = None
        elif select(module):
            owner = None
        else:
            owner = unit_of.get(id(_parent_of(model, name)))
        if owner is None:
            owner = units.setdefault(id(module), Unit(module, name or "<root>"))
        unit_of[id(module)] = owner
    # Parameters to their owning unit, in named_modules() order (a tied
    # parameter belongs to the first module holding it).
    owned: collections.OrderedDict[int, list] = collections.OrderedDict(
        (key, []) for key in units)
    used: collections.OrderedDict[int, list] = collections.OrderedDict(
        (key, []) for key in units)
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
    result = []
    for key, unit in units.items():
        by_dtype: collections.OrderedDict[torch.dtype, list] = collections.OrderedDict()
        for zp in owned[key]:
            by_dtype.setdefault(zp.dtype, []).append(zp)
        for members in by_dtype.values():
            unit.own.append(make_group(unit.name, members))
        result.append(unit)
    for key, unit in units.items():
        seen = {id(g) for g in unit.own}
        unit.groups = list(unit.own)
        for zp in used[key]:
            if zp.group is not None and id(zp.group) not in seen:
                seen.add(id(zp.group))
                unit.groups.append(zp.group)
    return [u for u in result if u.groups]


def _parent_of(model, name):
    if not name:
        return None
    parent = name.rpartition(".")[0]
    return model.get_submodule(parent) if parent else model
