"""Pass and hook orchestration of the zero3 engine (FSDP2's
``FSDPParamGroup``/``FSDPState`` seam): which module runs, when its
parameters are fetched and released, and when a pass begins and ends.

- A forward pre-hook fetches a module's parameters (its own and those
  declared external) and materialises them; the forward hook releases them.
- For backward, a tensor hook on the module's outputs fetches it again when
  the first of their gradients arrives, and one on its inputs releases it
  once all of theirs are in (_hooks.py).
- A recomputation inside backward (non-reentrant activation checkpointing)
  fetches through the same pre-hook and holds the module until its own
  backward is done, since what autograd recomputes points into the copy.
- The root module's forward runs with saved-tensor hooks that save views of
  gathered copies as "this view of parameter p" (_param.SavedView).
- A pass is a forward and its backward (or a forward without grad); its end
  releases what is still fetched, waits for the gradient reduce-scatters and
  ends the coordinator's step.
"""

import collections
import functools

import torch

from ..._errors import IncompatibleError, InvalidArgumentError
from . import _hooks
from ._param import Live, Placeholders, SavedView, dematerialize, materialize

EXTERNAL = "_ductile_zero3_external_parameters"
ENGINE = "_ductile_zero3_engine"


class GuardedParameters(collections.OrderedDict):
    """A module's ``_parameters`` that refuses, during a forward, a
    parameter no running module has gathered (its data is the empty
    placeholder): the user sees which parameter to declare as external
    instead of a shape error from deep inside torch."""

    def __getitem__(self, key):
        p = super().__getitem__(key)
        passes = self.__dict__.get("passes")
        if passes is not None and passes.in_forward and p is not None:
            zp = passes.param_of.get(id(p))
            if zp is not None and zp.users == 0:
                where = passes.module_stack[-1] if passes.module_stack else "<root>"
                raise IncompatibleError(
                    f"zero3: the forward of '{where}' uses parameter '{zp.name}', which only "
                    "the modules owning it gather; declare it with ductile.torch.zero3."
                    "register_external_parameter(module, parameter) before initialize()")
        return p


def _inside_backward():
    """True while autograd's engine runs a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


class Passes:
    """Fetch, release and the hooks of one engine's model."""

    def __init__(self, session, memory, world, params, gradients, begin_pass):
        self.session = session
        self.memory = memory
        self.world = world
        self.params = params
        self.param_of = {id(zp.param): zp for zp in params}
        self.gradients = gradients
        self._begin_pass_callback = begin_pass
        self.module_ids = {}      # module -> coordinator module id
        self.module_params = []   # module id -> [ZeroParam]
        self.module_names = []
        self.live = Live()
        self.placeholders = Placeholders(memory.device)
        self.pass_open = False
        self.backward_active = False
        self.module_stack = []    # names of the hooked modules in forward, innermost last
        self.in_forward = False
        self.module_callback = None
        self._grad_hooks = []     # this pass's backward hook handles
        self._handles = []
        self._fetched = []
        # Fetches of modules run again inside backward (activation
        # checkpointing recomputes them): held until the module's backward
        # is done, since the recomputed saved tensors point into the copy.
        self._recompute_holds = []

    # --- set-up ------------------------------------------------------------------

    def register_modules(self, model):
        for name, module in model.named_modules():
            members = []
            for p in module.parameters(recurse=False):
                zp = self.param_of.get(id(p))
                if zp is not None and zp not in members:
                    members.append(zp)
            for p in module.__dict__.get(EXTERNAL, []):
                zp = self.param_of.get(id(p))
                if zp is None:
                    raise InvalidArgumentError(
                        f"zero3.initialize: an external parameter registered on module "
                        f"'{name or type(module).__name__}' is not a parameter of the model")
                if zp not in members:
                    members.append(zp)
            if not members:
                continue
            mid = len(self.module_params)
            self.session.register_module(mid, [zp.id for zp in members])
            self.module_ids[module] = mid
            self.module_params.append(members)
            self.module_names.append(name or "<root>")
        self._fetched = [0] * len(self.module_params)
        self._recompute_holds = [0] * len(self.module_params)

    def install(self, model):
        original = model.forward
        passes = self

        def forward(*args, **kwargs):
            return passes.root_forward(original, args, kwargs)
        model.__dict__["forward"] = forward
        model.__dict__[ENGINE] = True
        for module in model.modules():
            mid = self.module_ids.get(module)
            if mid is None:
                continue
            module.__dict__[ENGINE] = True
            if any(id(p) in self.param_of for p in module.parameters(recurse=False)):
                guarded = GuardedParameters(module._parameters)
                guarded.passes = self
                module.__dict__["_parameters"] = guarded
            self._handles.append(module.register_forward_pre_hook(
                _pre_forward_hook(self, mid), with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                _post_forward_hook(self, mid), with_kwargs=True))
        with torch.no_grad():
            for zp in self.params:
                zp.param.data = self.placeholders.get(zp.dtype)

    def uninstall(self, model):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        model.__dict__.pop("forward", None)
        for module in model.modules():
            module.__dict__.pop(ENGINE, None)
            if isinstance(module.__dict__.get("_parameters"), GuardedParameters):
                module.__dict__["_parameters"] = collections.OrderedDict(module._parameters)

    # --- passes, fetch and release ---------------------------------------------------

    def begin_pass(self):
        self._begin_pass_callback()
        self.pass_open = True

    def end_pass(self):
        self.release_everything()
        self.gradients.drain()
        self.session.end_step()
        self.pass_open = False

    def fetch(self, mid):
        count = self._fetched[mid]
        if count == 0:
            if not self.pass_open:
                self.begin_pass()
            self.session.fetch(mid)
            for zp in self.module_params[mid]:
                materialize(zp, self.session, self.memory, self.world, self.live)
        self._fetched[mid] = count + 1
        if self.module_callback is not None:
            self.module_callback("fetch", self.module_names[mid], self.session.stats())

    def release(self, mid):
        count = self._fetched[mid]
        if count == 0:
            return  # released already, by the end of the pass
        self._fetched[mid] = count - 1
        # Drive the gathers in flight: on transports that progress only
        # inside MPI calls, a peer's gather advances when this rank polls
        # (its progress thread may not get the core while it computes).
        self.session.progress()
        if count == 1:
            self.session.release(mid)
            for zp in self.module_params[mid]:
                dematerialize(zp, self.placeholders, self.live)
            if self.module_callback is not None:
                self.module_callback("release", self.module_names[mid], self.session.stats())

    def release_everything(self):
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
                self.release(mid)

    def abandon(self):
        """After a forward or backward that raised: releases what it had
        fetched and waits for its gradients, locally (no collective: the
        other ranks may not have failed), so the next pass starts clean."""
        self.module_stack.clear()
        self.backward_active = False
        self.release_everything()
        self.gradients.abandon()

    # --- saved tensors -------------------------------------------------------------

    def pack(self, tensor):
        zp = self.live.owner(tensor)
        if zp is None:
            return tensor
        if tensor.dtype != zp.dtype or tensor.device != zp.full.device:
            return tensor.clone()  # a reinterpreting view: keep a private copy
        return SavedView(zp, tensor.storage_offset(), tuple(tensor.size()),
                         tuple(tensor.stride()))

    @staticmethod
    def unpack(packed):
        if type(packed) is not SavedView:
            return packed
        zp = packed.param
        if zp.users == 0:
            raise IncompatibleError(
                f"zero3: backward needs parameter '{zp.name}', which no running module has "
                "gathered; if a module's forward uses a parameter of another module, declare "
                "it with ductile.torch.zero3.register_external_parameter(module, parameter) "
                "before initialize()")
        return zp.full.as_strided(packed.size, packed.stride, packed.offset)

    # --- the root and the module hooks ---------------------------------------------------

    def root_forward(self, forward, args, kwargs):
        """The model's forward, with the saved-tensor hooks on."""
        if self.backward_active:
            self.abandon()  # the last backward raised before it ended
        self.in_forward = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
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

    def _end_backward(self):
        self.backward_active = False
        self.end_pass()

    def fetched_count(self, mid):
        return self._fetched[mid]


def _pre_forward_hook(passes, mid):
    post_backward = functools.partial(passes.post_backward, mid)

    def hook(module, args, kwargs):
        if _inside_backward():
            passes.enter_backward()
            # A recomputation inside backward (non-reentrant activation
            # checkpointing): autograd keeps what it recomputes, views of the
            # gathered copy among them, until this module's backward, so the
            # module stays fetched until then (counted now: a recomputation
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
        if _inside_backward():
            return None  # a recomputation: released after the module's backward
        passes.module_stack.pop()
        passes.release(mid)
        if torch.is_grad_enabled():
            passes._grad_hooks.extend(_hooks.before_backward(pre_backward, output))
        return None
    return hook
