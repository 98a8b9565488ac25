"""Fetch and release of the zero3 engine's groups, the module and tensor
hooks that drive them, and the passes they run in (FSDP2's ``FSDPState``
seam): which unit runs, when its groups are fetched and materialised, when
they are released and their gradients reduced, and when a pass begins and
ends.

- A forward pre-hook on a unit (_units.py) fetches its groups and
  materialises them (one coordinator call and one materialisation a
  group); the forward hook releases them.
- Release is counted: a unit is fetched and released once per use, and
  its last release hands its groups back to the coordinator
  (``session.release``: each gathered copy freed unless persistent, used by
  another fetched unit, or kept for a use soon in the trace) and points
  their parameters at the empty placeholder again (_param.py).
- For backward, a tensor hook on the unit's outputs fetches it again when
  the first of their gradients arrives, and one on its inputs releases it
  once all of theirs are in (_hooks.py); that release, the last of the
  unit in this backward, reduce-scatters the unit's own groups (small
  groups share a collective: _gradients.py; autograd has accumulated their
  parameters' gradients by then, since it runs AccumulateGrad nodes first).
- A recomputation inside backward (non-reentrant activation checkpointing)
  fetches through the same pre-hook and holds the unit until its own
  backward is done, since what autograd recomputes points into the copy.
- The root module's forward runs with saved-tensor hooks (C++) that save
  views of gathered copies as "this view of group g".
- While the trace is recorded, each module's ``_parameters`` refuses a
  parameter no running unit gathered, naming it (GuardedParameters); once
  the trace runs, the plain dict is back (no Python call a parameter).
- A pass is a forward and its backward (or a forward without grad); the end
  of its backward reduce-scatters what gradients are left (a parameter used
  by a later unit, a unit whose inputs need no gradient), releases what is
  still fetched, and ends the coordinator's step.
"""

import collections
import functools

import torch

from ... import _ductile
from ..._errors import IncompatibleError
from . import _hooks
from ._param import Placeholders, dematerialize, materialize
from ._units import EXTERNAL

ENGINE = "_ductile_zero3_engine"

__all__ = ["ENGINE", "EXTERNAL", "GuardedParameters", "Passes"]


class GuardedParameters(collections.OrderedDict):
    """A module's ``_parameters`` that refuses, during a forward, a
    parameter no running unit has gathered (its data is the empty
    placeholder): the user sees which parameter to declare as external
    instead of a shape error from deep inside torch."""

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


# True while autograd's engine runs a backward on this thread: != -1.
_graph_task_id = torch._C._current_graph_task_id


class Passes:
    """One engine's passes over its model: the unit hooks, the fetch and
    release of each unit's groups, and the reduce-scatters a backward
    starts."""

    def __init__(self, session, memory, params, groups, gradients, begin_pass):
        self.session = session
        self.memory = memory
        self.params = params
        self.groups = groups
        self.param_of = {id(zp.param): zp for zp in params}
        self.gradients = gradients
        self._begin_pass_callback = begin_pass
        self.units = []           # coordinator module id -> _units.Unit
        self.module_names = []
        self.live = _ductile.zero.LiveCopies()
        self.placeholders = Placeholders(memory.device)
        self._guarded_modules = []  # (module, GuardedParameters, plain dict)
        self._guarded = False
        self.pass_open = False
        self.backward_active = False
        self.module_stack = []    # names of the units in forward, innermost last
        self.in_forward = False
        self.module_callback = None
        self._grad_hooks = []     # this pass's backward hook handles
        self._handles = []
        self._fetched = []
        # Fetches of units run again inside backward (activation
        # checkpointing recomputes them): held until the unit's backward
        # is done, since the recomputed saved tensors point into the copy.
        self._recompute_holds = []

    # --- set-up ------------------------------------------------------------------

    def register_units(self, units):
        for mid, unit in enumerate(units):
            unit.id = mid
            self.session.register_module(mid, [g.id for g in unit.groups])
            self.units.append(unit)
            self.module_names.append(unit.name)
        self._fetched = [0] * len(units)
        self._recompute_holds = [0] * len(units)

    def install(self, model):
        original = model.forward
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
                _pre_forward_hook(self, unit.id), with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(
                _post_forward_hook(self, unit.id), with_kwargs=True))
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
        for module in model.modules():
            module.__dict__.pop(ENGINE, None)

    # --- passes, fetch and release ---------------------------------------------------

    def begin_pass(self):
        self._begin_pass_callback()
        self.pass_open = True

    def end_pass(self):
        self.release_everything()
        self.gradients.drain()
        self.session.end_step()
        self.pass_open = False
        recording = self.session.trace_mode != "complete"
        if recording != self._guarded:
            self._set_guards(recording)

    def fetch(self, mid):
        count = self._fetched[mid]
        if count == 0:
            if not self.pass_open:
                self.begin_pass()
            self.session.fetch(mid)
            for group in self.units[mid].groups:
                materialize(group, self.session, self.memory, self.live)
        self._fetched[mid] = count + 1
        if self.module_callback is not None:
            self.module_callback("fetch", self.module_names[mid], self.session.stats())

    def release(self, mid):
        count = self._fetched[mid]
        if count == 0:
            return  # released already, by the end of the pass
        self._fetched[mid] = count - 1
        # Drives the gathers in flight: on transports that progress only
        # inside MPI calls, a peer's gather advances when this rank polls
        # (its progress thread may not get the core while it computes).
        self.session.progress()
        if count == 1:
            self.session.release(mid)
            for group in self.units[mid].groups:
                dematerialize(group, self.live)
            if self.module_callback is not None:
                self.module_callback("release", self.module_names[mid], self.session.stats())

    def release_everything(self):
        """The end of a pass: every unit still fetched is released, and the
        backward hooks of units whose backward did not run are dropped (a
        hook on a tensor that outlives the pass would fire in a later one)."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        for mid, count in enumerate(self._fetched):
            self._recompute_holds[mid] = 0
            if count:
                self._fetched[mid] = 1
                self.release(mid)

    def abandon(self):
        """After a forward or backward that raised: releases what it had
        fetched and waits for its gradients, locally (no collective: the
        other ranks may not have failed), so the next pass starts clean."""
        self.module_stack.clear()
        self.backward_active = False
        self.release_everything()
        self.gradients.abandon(self.groups)

    # --- the root and the unit hooks -----------------------------------------------------

    def root_forward(self, forward, args, kwargs):
        """The model's forward, with the saved-tensor hooks on."""
        if self.backward_active:
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
        if not torch.is_grad_enabled() and self.pass_open:
            self.end_pass()  # no backward follows a pass without grad
        return output

    def enter_backward(self):
        """Called from inside autograd's backward: the first call of a pass
        queues the end of the pass for when the backward is done."""
        if not self.backward_active:
            self.backward_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def pre_backward(self, mid):
        self.enter_backward()
        self.fetch(mid)

    def post_backward(self, mid):
        self.release(mid)
        holds, self._recompute_holds[mid] = self._recompute_holds[mid], 0
        for _ in range(holds):
            self.release(mid)
        if self._fetched[mid] == 0:
            # The unit's backward is done: its parameters' gradients are in
            # (a later use adds more, reduced at the end of the backward).
            for group in self.units[mid].own:
                self.gradients.reduce(group)

    def _end_backward(self):
        self.backward_active = False
        for group in self.groups:
            self.gradients.reduce(group)
        self.end_pass()

    def fetched_count(self, mid):
        return self._fetched[mid]


def _pre_forward_hook(passes, mid):
    post_backward = functools.partial(passes.post_backward, mid)

    def hook(module, args, kwargs):
        if _graph_task_id() != -1:
            passes.enter_backward()
            # A recomputation inside backward (non-reentrant activation
            # checkpointing): autograd keeps what it recomputes, views of the
            # gathered copy among them, until this unit's backward, so the
            # unit stays fetched until then (counted now: a recomputation
            # that torch stops early never reaches the forward hook).
            passes.fetch(mid)
            passes._recompute_holds[mid] += 1
            return None
        passes.module_stack.append(passes.module_names[mid])
        passes.fetch(mid)
        if torch.is_grad_enabled():
            passes._grad_hooks.extend(_hooks.after_backward(post_backward, args, kwargs))
        return None
    return hook


def _post_forward_hook(passes, mid):
    pre_backward = functools.partial(passes.pre_backward, mid)

    def hook(module, args, kwargs, output):
        if _graph_task_id() != -1:
            return None  # a recomputation: released after the unit's backward
        passes.module_stack.pop()
        passes.release(mid)
        if torch.is_grad_enabled():
            passes._grad_hooks.extend(_hooks.before_backward(pre_backward, output))
        return None
    return hook
