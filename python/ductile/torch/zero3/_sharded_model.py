"""The sharding set-up of the zero3 engine (FSDP2's ``fully_shard``
set-up): a model's parameters partitioned over a world, and what keeps
them so.

``ShardedModel`` builds, in order: the coordinator session (the configured
``zero`` plugin) over the world, the device and the world's collectives;
the parameters, their groups and units, registered with the coordinator
(_shards.py); where each group's optimizer state lives under
max_device_memory (_budget.py, _offload.py); this rank's shards filled; the
gradient reducer (_gradients.py); and the pass hooks installed
(_passes.py). Before each pass it brings the shards up to date with what
the optimizer wrote.

The world is torch.distributed's process group when it is initialised and
the configuration allows it (``[accelerator] communicator = "auto"`` or
``"host"``): the coordinator's gathers and the engine's reduce-scatters run
on it (gloo on cpu, NCCL on cuda) and no MPI is started. Otherwise it is the
accelerator's own (Open MPI under mpirun or ``ductile agent --mpi-world``,
NCCL over an MPI bootstrap, or a single process).
"""

import torch

from ... import _ductile
from ..._errors import IncompatibleError
from . import _budget
from ._collectives import SessionCollectives
from ._gradients import GradientReducer
from ._memory import DeviceMemory
from ._offload import place
from ._passes import Passes
from ._shards import Sharding


class ShardedModel:
    """A model's parameters partitioned over the ranks of a world: the
    coordinator session, the sharding (parameters, groups, units), their
    placement and offload, the gradient reducer and the passes."""

    def __init__(self, model, runtime, world, precision, groups, offload, max_device_memory,
                 load_from, has_optimizer, step_in_backward, move_model=False):
        self.session = _ductile.zero.Session(runtime, world)
        self.memory = DeviceMemory(self.session.backend)
        if self.session.host_world:
            if world.device.type != self.memory.device.type:
                raise IncompatibleError(
                    f"zero3: torch.distributed's {world.backend} process group works on "
                    f"{world.device.type}, the configured accelerator on {self.session.backend}; "
                    "use gloo with backend = \"cpu\" or NCCL with backend = \"cuda\"")
            self.comm = world
        else:
            self.comm = SessionCollectives(self.session, self.memory.device)
        self.rank = self.session.rank
        self.world_size = self.session.size

        self.sharding = Sharding(self.session, self.memory, self.comm, precision)
        if move_model and not any(p.is_meta for p in model.parameters()):
            # DeepSpeed's engine takes the model where it was built (the HF
            # Trainer leaves it on the CPU for it) and moves it, buffers too.
            model.to(self.memory.device)
        self.params = self.sharding.collect(model)
        units = self.sharding.plan(model, groups)
        self.groups = self.sharding.groups
        self.placement = _budget.Placement(
            self.groups, precision.master_dtype if precision is not None else None,
            2 if has_optimizer else 0, _budget.gather_reserve(self.session, self.groups),
            _budget.staging_cap(self.session, self.groups))
        self.offload = place(self.groups, self.placement, offload,
                             _budget.budget_bytes(max_device_memory, self.memory.device),
                             has_optimizer, step_in_backward, self.memory.device)
        self.sharding.offload = self.offload
        self.sharding.partition(model, load_from)
        reduce_dtype = precision.reduce_dtype if precision is not None else None
        self.gradients = GradientReducer(self.comm, reduce_dtype)
        self.passes = Passes(self.session, self.memory, self.params, self.groups,
                             self.gradients, self.begin_pass)
        self.passes.register_units(units)
        self.passes.install(model)

    def begin_pass(self):
        """Before a pass: on cuda, torch's current stream becomes the
        coordinator's compute stream (gathers ordered after the optimizer's
        writes and before the kernels that read them, copies reused only
        after those kernels: see docs/zero3.md, "Streams"); then the shards
        are brought up to date."""
        if self.memory.device.type == "cuda":
            self.session.set_compute_stream(torch.cuda.current_stream(self.memory.device)
                                            .cuda_stream)
        if self.sharding.changed:
            self.sharding.sync()
