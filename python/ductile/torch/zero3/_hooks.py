"""The backward half of the engine's module hooks, on torch 2's tensor
hooks:

- ``before_backward`` hooks a module's outputs: the first gradient that
  reaches any of them fetches the module again, right before autograd runs
  the module's own backward nodes;
- ``after_backward`` hooks a module's inputs, positional and keyword: once
  the gradients of all of them that take part in this backward are in
  (``torch.autograd.graph.register_multi_grad_hook``, mode "all", for more
  than one), the module's backward is done and it is released.

Nothing is inserted into the graph and no tensor is replaced: the module's
outputs reach the caller as the module returned them, so a custom output
type (a Hugging Face ``ModelOutput``), tensor identity and in-place changes
behave as without ductile. Before torch 2 the engine passed inputs and
outputs through an identity autograd function, which rebuilt the output
containers and saw positional inputs only. ``register_full_backward_pre_hook``
wraps them in a ``BackwardHookFunction`` node, which refuses in-place changes
of a module's output, and calls a module's backward hook before its backward
when no input needs a gradient. tests/benchmarks/python/bench_hooks.py
measures all of them.
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


def _once_per_backward(action):
    """A tensor hook running ``action()`` at its first call in each backward
    (a retained graph may be differentiated again)."""
    last = [None]

    def hook(grad):
        task = torch._C._current_graph_task_id()
        if last[0] != task:
            last[0] = task
            action()
    return hook


def before_backward(action, outputs):
    """Runs ``action()`` when the first gradient with respect to one of
    ``outputs`` is computed; returns the hook handles (none when no output
    requires grad: no backward will reach the module).

    The same as ``register_multi_grad_hook(outputs, ..., mode="any")``, with
    a plain tensor hook per output: a third of the cost per module and pass
    (tests/benchmarks/python/bench_hooks.py)."""
    hook = _once_per_backward(action)
    return [t.register_hook(hook) for t in tensors_requiring_grad(outputs)]


def after_backward(action, inputs, kwargs):
    """Runs ``action()`` when the gradients with respect to every input that
    this backward computes are in; returns the hook handles (none when no
    input requires grad: the release then waits for the end of the pass).
    One input, the usual case, needs only its own tensor hook."""
    tensors = tensors_requiring_grad(inputs, kwargs)
    if len(tensors) == 1:
        return [tensors[0].register_hook(_once_per_backward(action))]
    if not tensors:
        return []
    return [_register_multi_grad_hook(tensors, lambda grads: action(), mode="all")]
