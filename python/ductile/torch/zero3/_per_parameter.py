"""The optimizer of an engine that steps in backward (``step_in_backward``):
one optimizer per parameter shard, each stepped as soon as that shard's
gradient is reduce-scattered, so the gradient shards never all exist at
once (torch's ``_apply_optimizer_in_backward`` does the same for plain
modules). ``PerParameterOptimizers`` shows them as one optimizer to the
engine's checkpoints: ``param_groups`` (one group per parameter, in order),
``state``, ``state_dict()`` and ``load_state_dict()`` with torch's layout.
"""

import torch

from ..._errors import InvalidArgumentError


class PerParameterOptimizers:
    def __init__(self, factory, shards):
        self.optimizers = []
        for shard in shards:
            optimizer = factory([shard])
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise InvalidArgumentError(
                    "zero3: with step_in_backward, optimizer_factory must return a "
                    f"torch.optim.Optimizer for each shard, got {type(optimizer).__name__}")
            if len(optimizer.param_groups) != 1:
                raise InvalidArgumentError(
                    "zero3: with step_in_backward, optimizer_factory([shard]) must make one "
                    "parameter group")
            self.optimizers.append(optimizer)
        self.kind = type(self.optimizers[0]).__name__ if self.optimizers else "none"

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self):
        merged = {}
        for o in self.optimizers:
            merged.update(o.state)
        return merged

    def step(self):
        """Nothing: every parameter was stepped during backward."""

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        state, groups, index = {}, [], 0
        for o in self.optimizers:
            sd = o.state_dict()
            for group in sd["param_groups"]:
                groups.append(dict(group, params=[index]))
            if 0 in sd["state"]:
                state[index] = sd["state"][0]
            index += 1
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optimizers):
            raise ValueError(f"{len(groups)} parameter groups for {len(self.optimizers)} "
                             "per-parameter optimizers")
        for o, group in zip(self.optimizers, groups):
            (index,) = group["params"]
            entry = state_dict["state"].get(index)
            o.load_state_dict({"state": {0: entry} if entry is not None else {},
                               "param_groups": [dict(group, params=[0])]})
