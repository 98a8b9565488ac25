// The step path of ductile.torch.zero3 in C++ (_ductile.zero.UnitPasses):
// the module hooks of each unit, the tensor hooks that start and end its
// backward, the fetch and release counts, and the materialisation of its
// parameter groups. Torch calls these hooks directly, so a unit's forward
// and backward run no Python function of ductile's: the hooks call torch's
// and the coordinator's C functions, and Python only at the edges of a pass
// (begin_pass and end_backward, once a pass), to reduce a group's gradients
// (reduce_gradients, once a group a backward), and for the views over a
// gathered copy at an address it has none kept for (gathered_views). Those
// four are the owner's: _ductile.zero.PassEvents, a C++ class with virtual
// methods that the Python owner (_passes.Passes) subclasses and hands over
// once, at construction.
//
// The state it keeps: per unit, how often it is fetched and how many
// recomputations inside backward hold it; where the passes are
// (_ductile.zero.TrainingState: IDLE, FORWARD, BACKWARD, POST_BACKWARD; the
// owner sets it at the end of a backward and of a pass); the units in
// forward. A group is a GroupState (group_state.hpp, the base of
// _param.ParamGroup): its `users`, `full`, `full_address` and `views_cache`
// are written here, as the saved-tensor hooks (saved_views.hpp) and
// GuardedParameters read them.
//
// Ownership: holds the session's bound methods, the live copies and the
// groups; the owner only weakly, so an engine that is dropped is freed.
// The hook objects hold the UnitPasses. close() drops the Python objects it
// holds (uninstall calls it).
// Threading: the GIL held (torch calls hooks with it); a fetch releases it
// inside the coordinator while it waits. Errors: the coordinator's, torch's
// and the owner's, as raised; a hook of a closed UnitPasses, or of one
// whose owner is gone, raises IncompatibleError; an owner that is not a
// PassEvents raises RuntimeError (pybind11's cast error) at construction.
#pragma once

#include <pybind11/pybind11.h>

namespace ductile::python {

void register_unit_passes(pybind11::module_& zero);

}  // namespace ductile::python
