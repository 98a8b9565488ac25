// A parameter group's gradients and its state; see group_gradients.hpp and
// group_state.hpp.
#include "group_gradients.hpp"

#include <cstdint>

#include "group_state.hpp"

namespace ductile::python {

namespace py = pybind11;

namespace {

py::object torch_function(const char* name) {
  return py::module_::import("torch").attr(name);
}

py::object take_gradients(GroupState& group, std::int64_t world, const py::object& dtype) {
  const py::list& params = group.params;
  const std::size_t n = params.size();
  py::list flats(n);
  py::list mask(n);
  py::object device = py::none();
  for (std::size_t i = 0; i < n; ++i) {
    py::object grad = params[i].attr("grad");
    const bool has = !grad.is_none();
    if (has) {
      device = grad.attr("device");
      flats[i] = grad.attr("reshape")(-1);
    }
    mask[i] = py::bool_(has);
  }
  if (device.is_none()) return py::none();
  for (py::handle p : params) p.attr("grad") = py::none();
  // Kept for the life of the process (never decremented after Python ends).
  static const py::handle zeros = torch_function("zeros").release();
  static const py::handle empty = torch_function("empty").release();
  static const py::handle chunk_cat = torch_function("_chunk_cat").release();
  for (std::size_t i = 0; i < n; ++i)
    if (!py::bool_(mask[i]))
      flats[i] = zeros(group.numels[i], py::arg("dtype") = group.dtype, py::arg("device") = device);
  py::object out =
      empty(world, group.shard_numel, py::arg("dtype") = dtype, py::arg("device") = device);
  chunk_cat(flats, 0, world, py::arg("out") = out);
  return py::make_tuple(out, mask);
}

// What the members' shard.grad are while the gradient shard is attached.
const py::object& member_views(const GroupState& group) {
  return group.host_grad_views.is_none() ? group.grad_views : group.host_grad_views;
}

bool grads_attached(const GroupState& group) {
  if (group.grad_flat.is_none()) return false;
  const py::list& members = group.members;
  const py::sequence views = member_views(group);
  for (std::size_t i = 0; i < members.size(); ++i) {
    const py::object grad = as_member(members[i]).shard.attr("grad");
    if (!grad.is_none()) return grad.ptr() == py::object(views[i]).ptr();
  }
  return false;
}

void add_grad_shard(GroupState& group, py::object shard, const py::list& mask) {
  const py::list& members = group.members;
  if (grads_attached(group)) {
    group.grad_flat.attr("add_")(shard);
    const py::sequence views = member_views(group);
    for (std::size_t i = 0; i < members.size(); ++i) {
      const py::object& member_shard = as_member(members[i]).shard;
      if (py::bool_(mask[i]) && member_shard.attr("grad").is_none())
        member_shard.attr("grad") = views[i];
    }
    return;
  }
  const py::object master = as_member(members[0]).shard.attr("dtype");
  if (shard.attr("dtype").ptr() != master.ptr()) shard = shard.attr("to")(master);
  group.grad_views = shard.attr("split")(group.sizes);
  group.grad_flat = std::move(shard);
  const py::sequence targets = member_views(group);
  for (std::size_t i = 0; i < members.size(); ++i) {
    const MemberState& member = as_member(members[i]);
    if (py::bool_(mask[i]) && member.requires_grad) member.shard.attr("grad") = targets[i];
  }
}

// The GroupState of a Python object, or null before its __init__ made it.
GroupState* constructed(PyObject* self) {
  auto holder = reinterpret_cast<py::detail::instance*>(self)->get_value_and_holder();
  return holder.holder_constructed() ? holder.value_ptr<GroupState>() : nullptr;
}

}  // namespace

void register_group_state(py::module_& zero) {
  py::class_<MemberState>(zero, "MemberState",
                          "What the step path reads of a group's member (_param.ZeroParam).")
      .def(py::init<>())
      .def_readwrite("shard", &MemberState::shard)
      .def_readwrite("requires_grad", &MemberState::requires_grad);
  using G = GroupState;
  // The Python objects a group holds are shown to the garbage collector:
  // members refer back to their group, a cycle it must see to free.
  auto collectable = py::custom_type_setup([](PyHeapTypeObject* heap_type) {
    PyTypeObject* type = &heap_type->ht_type;
    type->tp_flags |= Py_TPFLAGS_HAVE_GC;
    type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) -> int {
      Py_VISIT(Py_TYPE(self));
      const G* g = constructed(self);
      if (g == nullptr) return 0;
      for (PyObject* field :
           {g->members.ptr(), g->params.ptr(), g->trained.ptr(), g->dtype.ptr(), g->sizes.ptr(),
            g->numels.ptr(), g->full.ptr(), g->placeholder.ptr(), g->views_cache.ptr(),
            g->grad_flat.ptr(), g->grad_views.ptr(), g->host_grad_views.ptr()})
        Py_VISIT(field);
      return 0;
    };
    type->tp_clear = [](PyObject* self) -> int {
      if (G* g = constructed(self)) *g = G();
      return 0;
    };
  });
  py::class_<G>(zero, "GroupState",
                "A parameter group's state on the step path (_param.ParamGroup); see "
                "python/src/group_state.hpp.",
                collectable)
      .def(py::init<>())
      .def_readwrite("id", &G::id)
      .def_readwrite("name", &G::name)
      .def_readwrite("members", &G::members)
      .def_readwrite("params", &G::params)
      .def_readwrite("trained", &G::trained)
      .def_readwrite("dtype", &G::dtype)
      .def_readwrite("sizes", &G::sizes)
      .def_readwrite("numels", &G::numels)
      .def_readwrite("shard_numel", &G::shard_numel)
      .def_readwrite("full_bytes", &G::full_bytes)
      .def_readwrite("users", &G::users)
      .def_readwrite("full", &G::full)
      .def_readwrite("full_address", &G::full_address)
      .def_readwrite("placeholder", &G::placeholder)
      .def_readwrite("views_cache", &G::views_cache)
      .def_readwrite("grad_flat", &G::grad_flat)
      .def_readwrite("grad_views", &G::grad_views)
      .def_readwrite("host_grad_views", &G::host_grad_views);
}

void register_group_gradients(py::module_& zero) {
  zero.def("take_gradients", &take_gradients, py::arg("group"), py::arg("world"), py::arg("dtype"),
           "A group's gradients rank-major for a reduce-scatter and which members had one "
           "(None: no member had one); the parameters' gradients are dropped.");
  zero.def("add_grad_shard", &add_grad_shard, py::arg("group"), py::arg("shard"), py::arg("mask"),
           "Adds a reduced gradient shard of the members in `mask` to the group's.");
  zero.def("grads_attached", &grads_attached, py::arg("group"),
           "The members' shard.grad are still the views of the group's gradient shard.");
}

}  // namespace ductile::python
