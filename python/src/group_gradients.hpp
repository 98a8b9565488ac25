// The gradients of a zero3 parameter group (GroupState, group_state.hpp:
// _param.ParamGroup) on the step path, in C++ so that a backward runs one
// Python function of ductile's a group (GradientReducer.reduce) and none a
// parameter:
//
// - take_gradients(group, world, dtype): the gradients the group's
//   parameters hold, laid out rank-major ((world, shard_numel), `dtype`; a
//   missing one as zeros) for a reduce-scatter, and which members had one;
//   the parameters' gradients are dropped. None when no member has one.
// - add_grad_shard(group, shard, mask): adds a reduced gradient shard
//   (shard_numel elements) of the members in `mask` to the group's
//   gradient shard: into it while the members' `shard.grad` are still its
//   views, else as a new one in the master dtype, each member's
//   `shard.grad` a view of it (of the host copy when the optimizer is
//   offloaded: `group.host_grad_views`).
// - grads_attached(group): the members' `shard.grad` are still the views of
//   the group's gradient shard (nobody cleared or replaced them since).
//
// Threading: the GIL held. Errors: torch's, as raised; a group that is not a
// GroupState raises TypeError. Ownership: nothing is kept; the group's
// tensors stay in its GroupState.
#pragma once

#include <pybind11/pybind11.h>

#include "group_state.hpp"

namespace ductile::python {

void register_group_gradients(pybind11::module_& zero);

}  // namespace ductile::python
