"""What zero3's backward hooks cost per module and pass (a program that
prints figures, medians; not a test), in plain torch on a stack of small
layers, for the ways a module can learn that its backward starts and ends:

- none: no hook (the floor);
- identity nodes: an autograd Function on the module's inputs and outputs
  whose backward runs the action (zero3's code path before torch 2);
- tensor hooks on the outputs and the input, each acting once per backward
  (the mechanism zero3's step path uses, in C++ there:
  python/src/unit_passes.cpp; written here in Python);
- torch.autograd.graph.register_multi_grad_hook on outputs (mode "any") and
  inputs (mode "all");
- full backward hooks: Module.register_full_backward_pre_hook and
  register_full_backward_hook.

Each variant runs the same counting action at the same points (hooks on
tensors are removed after each backward, as the engine does at the end of a
pass), and the program checks that every variant ran it equally often.

  PYTHONPATH=build/python .venv/bin/python tests/benchmarks/python/bench_hooks.py [LAYERS [STEPS]]
"""

import statistics
import sys
import time

import torch
import torch.nn as nn



class Counter:
    def __init__(self):
        self.starts = 0
        self.ends = 0

    def start(self, *_):
        self.starts += 1

    def end(self, *_):
        self.ends += 1


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, action, *tensors):
        ctx.action = action
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.action()
        return (None,) + grads


def identity_nodes(module, counter, per_pass):
    def pre(mod, args):
        return _Identity.apply(counter.end, *args)

    def post(mod, args, output):
        return _Identity.apply(counter.start, output)[0]
    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def tensors_requiring_grad(*values):
    """The distinct tensors requiring grad in nested tuples, lists and dicts."""
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


def once_per_backward(action):
    last = [None]

    def hook(grad):
        task = torch._C._current_graph_task_id()
        if last[0] != task:
            last[0] = task
            action()
    return hook


def tensor_hooks(module, counter, per_pass):
    def pre(mod, args, kwargs):
        inputs = tensors_requiring_grad(args, kwargs)
        if len(inputs) == 1:
            per_pass.append(inputs[0].register_hook(once_per_backward(counter.end)))
        elif inputs:
            per_pass.append(torch.autograd.graph.register_multi_grad_hook(
                inputs, lambda grads: counter.end(), mode="all"))

    def post(mod, args, kwargs, output):
        hook = once_per_backward(counter.start)
        per_pass.extend(t.register_hook(hook) for t in tensors_requiring_grad(output))
    return [module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True)]


def multi_grad_hooks(module, counter, per_pass):
    register = torch.autograd.graph.register_multi_grad_hook

    def pre(mod, args, kwargs):
        per_pass.append(register(tensors_requiring_grad(args, kwargs), counter.end,
                                 mode="all"))

    def post(mod, args, kwargs, output):
        per_pass.append(register(tensors_requiring_grad(output), counter.start,
                                 mode="any"))
    return [module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True)]


def full_backward_hooks(module, counter, per_pass):
    return [module.register_full_backward_pre_hook(counter.start),
            module.register_full_backward_hook(counter.end)]


VARIANTS = {"none": None, "identity nodes (before torch 2)": identity_nodes,
            "zero3: tensor hooks": tensor_hooks,
            "register_multi_grad_hook": multi_grad_hooks,
            "full backward hooks": full_backward_hooks}


def main(layers=64, steps=200):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stack = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])
    x = torch.randn(32, 64, requires_grad=True)
    print(f"torch {torch.__version__}, {layers} Linear(64, 64) layers, batch 32, 1 thread, "
          f"median of {steps} forward + backward passes")
    base = None
    counts = {}
    for name, install in VARIANTS.items():
        counter, per_pass = Counter(), []
        handles = [h for m in stack for h in install(m, counter, per_pass)] if install else []
        times = []
        for _ in range(steps + 20):
            t0 = time.perf_counter()
            stack(x).sum().backward()
            for h in per_pass:
                h.remove()
            per_pass.clear()
            times.append(time.perf_counter() - t0)
        for h in handles:
            h.remove()
        median = statistics.median(times[20:])
        base = base or median
        counts[name] = (counter.starts, counter.ends)
        extra = (median - base) / layers * 1e6
        print(f"  {name:36s} {median * 1e3:8.3f} ms   {extra:6.2f} us per module and pass"
              f"   (starts {counter.starts}, ends {counter.ends})")
    hooked = [c for n, c in counts.items() if n != "none"]
    if any(c != hooked[0] for c in hooked):
        sys.exit(f"the variants ran the actions a different number of times: {counts}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
