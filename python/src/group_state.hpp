// The state of a zero3 parameter group and of its members that the C++ step
// path (unit_passes.cpp, group_gradients.cpp, saved_views.cpp) reads or
// writes on every use. It is owned here, in C++: the Python classes
// _param.ParamGroup and _param.ZeroParam subclass GroupState and
// MemberState, and read and write the same fields as typed properties, so
// that the step path reaches them by a cast instead of by attribute name.
//
// Ownership: the Python object owns its GroupState/MemberState; the fields
// hold references to torch's objects (tensors, parameters, dtypes) and to
// the group's members. Threading: the GIL held for every access. Errors:
// as_group/as_member of an object of another type raise pybind11's
// cast_error, RuntimeError in Python (a bug of ductile's, never the
// user's); a function taking a GroupState& raises TypeError.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace ductile::python {

// A member of a group (_param.ZeroParam): what its gradients go to.
struct MemberState {
  pybind11::object shard = pybind11::none();  // the optimizer's parameter (master dtype), or None
  bool requires_grad = false;                 // of the model's parameter
};

// A parameter group (_param.ParamGroup).
struct GroupState {
  // What it is, set once when the group is made.
  std::uint64_t id = 0;                       // the coordinator's parameter id of the group
  std::string name;                           // of the unit owning it (errors name it)
  pybind11::list members;                     // its ZeroParams (MemberState), in shard order
  pybind11::list params;                      // the model's parameters, in member order
  pybind11::list trained;                     // the members requiring grad
  pybind11::object dtype = pybind11::none();  // the compute dtype (of the gathered copy)
  pybind11::list sizes;                       // each member's shard numel
  pybind11::list numels;                      // each member's numel
  std::int64_t shard_numel = 0;               // of this rank's flat shard
  std::size_t full_bytes = 0;                 // of the gathered copy

  // Materialisation, written by the step path (unit_passes.cpp).
  std::int64_t users = 0;                           // fetched units materialising it
  pybind11::object full = pybind11::none();         // flat tensor over the gathered copy, or None
  std::uintptr_t full_address = 0;                  // of the gathered copy (0: not materialised)
  pybind11::object placeholder = pybind11::none();  // param.data between uses (empty tensor)
  pybind11::dict views_cache;  // address -> (full, member views): a few of the pool's buffers

  // Gradients (group_gradients.cpp).
  pybind11::object grad_flat = pybind11::none();   // the flat gradient shard (master dtype)
  pybind11::object grad_views = pybind11::none();  // its member views
  // The members' gradient views of the optimizer's host copy when the
  // optimizer is offloaded (None otherwise): what each member's shard.grad
  // is then instead of grad_views.
  pybind11::object host_grad_views = pybind11::none();
};

inline GroupState& as_group(pybind11::handle group) {
  return group.cast<GroupState&>();
}
inline MemberState& as_member(pybind11::handle member) {
  return member.cast<MemberState&>();
}

// Registers GroupState, MemberState (group_gradients.cpp); before the
// classes whose signatures name them.
void register_group_state(pybind11::module_& zero);

}  // namespace ductile::python
