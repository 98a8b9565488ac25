// The step path of ductile.torch.zero3 in C++ (_ductile.zero.UnitPasses):
// the module hooks of each unit, the tensor hooks that start and end its
// backward, the fetch and release counts, and the materialisation of its
// parameter groups. Torch calls these hooks directly, so a unit's forward
// and backward run no Python function of ductile's: the hooks call torch's
// and the coordinator's C functions, and Python only at the edges of a pass
// (the owner's begin_pass and end_backward, once a pass) and to reduce a
// group's gradients (the owner's gradients.reduce, once a group a backward).
//
// The state it keeps is the Python engine's (_passes.Passes reads it through
// properties): per unit, how often it is fetched and how many recomputations
// inside backward hold it; whether a pass is open and a backward running;
// the units in forward. A group is the Python object _param.ParamGroup: its
// `users`, `full`, `full_address` are written here, as the saved-tensor hooks
// (saved_views.hpp) and GuardedParameters read them.
//
// Ownership: holds the session, the live copies and the groups; the owner
// (the Python Passes) only weakly, so an engine that is dropped is freed.
// The hook objects hold the UnitPasses. close() drops the Python objects it
// holds (uninstall calls it).
// Threading: the GIL held (torch calls hooks with it); a fetch releases it
// inside the coordinator while it waits. Errors: the coordinator's and
// torch's, as raised; a hook of a closed UnitPasses raises
// IncompatibleError.
#pragma once

#include <pybind11/pybind11.h>

namespace ductile::python {

void register_unit_passes(pybind11::module_& zero);

}  // namespace ductile::python
