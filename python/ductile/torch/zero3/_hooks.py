"""The backward half of the engine's module hooks, on torch 2.x's
``torch.autograd.graph.register_multi_grad_hook``:

- ``before_backward`` hooks a module's outputs: the first gradient that
  reaches any of them (mode "any") fetches the module again, right before
  autograd runs the module's own backward nodes;
- ``after_backward`` hooks a module's inputs, positional and keyword: once
  the gradients of all of them that take part in this backward are in (mode
  "all"), the module's backward is done and it is released.

Nothing is inserted into the graph and no tensor is replaced: the module's
outputs reach the caller as the module returned them (no identity autograd
node, no rebuilt containers), so in-place operations on them and custom
output types behave as without ductile. ``register_full_backward_pre_hook``
would wrap inputs and outputs in a ``BackwardHookFunction`` node (which
refuses in-place changes of a module's output views) and, for a module whose
inputs need no gradient, would call its backward hook before the module's
backward has run.
"""

import torch

_register_multi_grad_hook = torch.autograd.graph.register_multi_grad_hook


def tensors_requiring_grad(*values):
    """The distinct tensors that require grad in (nested) tuples, lists and
    dicts (a ModelOutput is a dict), in order of appearance."""
    found = {}
    stack = list(reversed(values))
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                found.setdefault(id(value), value)
        elif isinstance(value, (tuple, list)):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
    return list(found.values())


def before_backward(action, outputs):
    """Runs ``action()`` when the first gradient with respect to one of
    ``outputs`` is computed; returns the hook handle, or None when no output
    requires grad (no backward will reach the module)."""
    tensors = tensors_requiring_grad(outputs)
    if not tensors:
        return None
    return _register_multi_grad_hook(tensors, lambda grad: action(), mode="any")


def after_backward(action, inputs, kwargs):
    """Runs ``action()`` when the gradients with respect to every input that
    this backward computes are in; returns the hook handle, or None when no
    input requires grad (the release then waits for the end of the pass)."""
    tensors = tensors_requiring_grad(inputs, kwargs)
    if not tensors:
        return None
    return _register_multi_grad_hook(tensors, lambda grads: action(), mode="all")
