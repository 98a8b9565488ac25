"""``deepspeed.zero`` on ductile's ZeRO-3: ``Init`` builds a model straight
into shards, ``GatheredParameters`` holds whole parameters for a while,
``register_external_parameter`` declares a parameter a module uses but does
not own. Each is ``ductile.torch.zero3``'s, under DeepSpeed's signature.
"""

from collections.abc import Iterable
from typing import Any, Literal, Self

import torch

from .._errors import InvalidArgumentError
from ..torch.zero3 import GatheredParameters as _Gathered
from ..torch.zero3 import init as _init
from ..torch.zero3 import register_external_parameter
from ..torch.zero3._param import is_partitioned, parameters_of

__all__ = ["Init", "GatheredParameters", "register_external_parameter"]


class Init(_init):
    """``with deepspeed.zero.Init(): model = Model(...)``: each parameter is
    cut to this rank's slice as it is created (``zero3.init``). The ranks
    come from the launcher's environment (RANK, WORLD_SIZE) or
    ``data_parallel_group``. ``enabled=False`` builds the model whole.
    DeepSpeed's other arguments configure its own partitioner: a
    ``remote_device``, ``dtype`` or ``module`` given is refused, naming it,
    rather than ignored."""

    def __init__(self, module: None = None,
                 data_parallel_group: "torch.distributed.ProcessGroup | None" = None,
                 mem_efficient_linear: bool = True,
                 remote_device: Literal["cpu"] | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: None = None, mpu: None = None, **kwargs: Any) -> None:
        for name, value, allowed in (("module", module, None), ("remote_device", remote_device,
                                                                 (None, "cpu")),
                                     ("dtype", dtype, None), ("mpu", mpu, None)):
            if value is not None and (allowed is None or value not in allowed):
                raise InvalidArgumentError(
                    f"deepspeed.zero.Init: {name}={value!r} is not supported by ductile; "
                    f"valid: {' or '.join(repr(a) for a in (allowed or (None,)))} (ductile "
                    "partitions the parameters as they are created, in their own dtype)")
        unknown = sorted(k for k, v in kwargs.items() if v not in (None, False))
        if unknown:
            raise InvalidArgumentError(
                f"deepspeed.zero.Init: {', '.join(unknown)} not supported by ductile")
        self.enabled = bool(enabled)
        world_size = rank = None
        if data_parallel_group is not None:
            import torch.distributed as dist
            world_size = dist.get_world_size(data_parallel_group)
            rank = dist.get_rank(data_parallel_group)
        super().__init__(world_size=world_size, rank=rank)

    def __enter__(self) -> Self:
        return super().__enter__() if self.enabled else self

    def __exit__(self, *exc: object) -> Literal[False]:
        return super().__exit__(*exc) if self.enabled else False


class GatheredParameters(_Gathered):
    """``with deepspeed.zero.GatheredParameters(params, modifier_rank=0): ...``
    (``zero3.GatheredParameters``), on parameters of an engine or built under
    ``Init``. As in DeepSpeed, a parameter that is not partitioned (whole
    already) is left as it is. ``fwd_module`` registers `params` as external
    parameters of that module, as DeepSpeed does."""

    def __init__(self,
                 params: torch.nn.Module | torch.nn.Parameter | Iterable[torch.nn.Parameter]
                 | None,
                 modifier_rank: int | None = None, fwd_module: torch.nn.Module | None = None,
                 enabled: bool = True) -> None:
        params = [p for p in parameters_of(params) if is_partitioned(p)]
        super().__init__(params, modifier_rank=modifier_rank, enabled=enabled and bool(params))
        if fwd_module is not None:
            for p in self.params:
                register_external_parameter(fwd_module, p)
