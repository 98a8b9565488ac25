// Saved tensors of a zero3 forward that lie in a gathered copy
// (ductile.torch.zero3's saved-tensor hooks, in C++ so that autograd calls no
// Python function per saved tensor): autograd keeps "this view of group g"
// instead, and gets the view back over the copy gathered again for
// backward, so a release in between never leaves it reading freed memory.
//
// _ductile.zero.LiveCopies: add(address, bytes, group) when a group is
// materialised, remove(address) when it is released, pack(tensor) as the
// pack hook; _ductile.zero.unpack_saved(packed) as the unpack hook. A group
// is the Python object _param.ParamGroup: `dtype`, `full` (the flat tensor
// over the gathered copy), `users` and `name` are read from it.
//
// Threading: the GIL held (autograd calls the hooks with it). Errors:
// unpack_saved of a group no running module has gathered raises
// IncompatibleError naming the group; add() of an address already live is
// an internal error. Ownership: holds a reference to each live group.
#pragma once

#include <pybind11/pybind11.h>

namespace ductile::python {

void register_saved_views(pybind11::module_& zero);

}  // namespace ductile::python
