"""The autograd pieces of the engine's module hooks, on the API torch 1.13
and 2.x share (no backward pre-hooks, which came in 2.0):

- ``wrap_outputs`` passes a module's outputs through an identity autograd
  node after its forward: the node's backward runs before the module's own
  backward nodes, and fetches the module.
- ``wrap_inputs`` does the same to a module's inputs before its forward: the
  node's backward runs once gradients have reached the inputs, after the
  module's own backward nodes (they were created later, so autograd runs
  them first), and releases the module.
Both find the tensors that require grad in a (nested) tuple, list or dict
and keep the structure.
"""

import functools

import torch


class _Boundary(torch.autograd.Function):
    """Identity in forward; its backward runs `action` (a module's fetch or
    release) once, when the gradients of all the tensors it wrapped are in."""

    @staticmethod
    def forward(ctx, action, *tensors):
        ctx.action = action
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.action()
        return (None,) + grads


def _collect(value, out):
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _collect(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, out)


def _rebuild(value, replaced):
    if isinstance(value, torch.Tensor):
        return replaced.get(id(value), value)
    if isinstance(value, tuple):
        items = [_rebuild(v, replaced) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return type(value)(_rebuild(v, replaced) for v in value)
    if isinstance(value, dict):
        rebuilt = {k: _rebuild(v, replaced) for k, v in value.items()}
        try:
            return type(value)(rebuilt)
        except TypeError:
            return rebuilt
    return value


def wrap(action, value):
    """`value` with every tensor that requires grad passed through one
    _Boundary node running `action` in backward; None when there is none, so
    the caller keeps `value` as it is."""
    tensors = []
    _collect(value, tensors)
    if not tensors:
        return None
    unique = list({id(t): t for t in tensors}.values())
    outputs = _Boundary.apply(action, *unique)
    return _rebuild(value, {id(t): o for t, o in zip(unique, outputs)})


def wrap_outputs(engine, module_id, output):
    """Before the module's backward: fetch it again."""
    return wrap(functools.partial(engine._pre_backward, module_id), output)


def wrap_inputs(engine, module_id, inputs):
    """After the module's backward (its inputs' gradients are in): release it."""
    return wrap(functools.partial(engine._post_backward, module_id), inputs)
