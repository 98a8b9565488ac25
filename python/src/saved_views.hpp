// Saved tensors of a zero3 forward that lie in a gathered copy
// (ductile.torch.zero3's saved-tensor hooks, in C++ so that autograd calls no
// Python function per saved tensor): autograd keeps "this view of group g"
// instead, and gets the view back over the copy gathered again for
// backward, so a release in between never leaves it reading freed memory.
//
// _ductile.zero.LiveCopies: add(address, bytes, group) when a group is
// materialised, remove(address) when it is released (the step path,
// unit_passes.cpp, calls both), pack(tensor) as the pack hook;
// _ductile.zero.unpack_saved(packed) as the unpack hook. A group is a
// GroupState (group_state.hpp): its `dtype`, `full` (the flat tensor over
// the gathered copy), `users` and `name` are read.
//
// Threading: the GIL held (autograd calls the hooks with it). Errors:
// unpack_saved of a group no running module has gathered raises
// IncompatibleError naming the group; add() of an address already live, or
// remove() of one that is not, is an internal error. Ownership: holds a
// reference to each live group.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "group_state.hpp"

namespace ductile::python {

// The materialised groups by the address range of their gathered copy.
class LiveCopies {
 public:
  void add(std::uintptr_t start, std::size_t bytes, pybind11::object group);
  void remove(std::uintptr_t start);
  std::size_t size() const { return ranges_.size(); }
  // The pack hook: the tensor itself, or a SavedView when it lies in a live copy.
  pybind11::object pack(pybind11::handle tensor) const;

 private:
  struct Range {
    std::uintptr_t start;
    std::uintptr_t end;
    pybind11::object group;  // keeps `state` alive
    GroupState* state;
  };
  // The range holding `address`, or null.
  const Range* holding(std::uintptr_t address) const;
  std::vector<Range>::iterator position(std::uintptr_t start);
  std::vector<Range> ranges_;  // by start
};

void register_saved_views(pybind11::module_& zero);

}  // namespace ductile::python
