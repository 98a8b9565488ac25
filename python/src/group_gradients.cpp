// A parameter group's gradients; see group_gradients.hpp.
#include "group_gradients.hpp"

#include <cstdint>

namespace ductile::python {

namespace py = pybind11;

namespace {

py::object torch_function(const char* name) {
  return py::module_::import("torch").attr(name);
}

py::object take_gradients(const py::object& group, std::int64_t world, const py::object& dtype) {
  const py::list params = group.attr("params");
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
  const py::list numels = group.attr("numels");
  for (std::size_t i = 0; i < n; ++i)
    if (!py::bool_(mask[i]))
      flats[i] =
          zeros(numels[i], py::arg("dtype") = group.attr("dtype"), py::arg("device") = device);
  py::object out =
      empty(world, group.attr("shard_numel"), py::arg("dtype") = dtype, py::arg("device") = device);
  chunk_cat(flats, 0, world, py::arg("out") = out);
  return py::make_tuple(out, mask);
}

// What the members' shard.grad are while the gradient shard is attached.
py::object member_views(const py::object& group) {
  const py::object host = group.attr("host");
  return host.is_none() ? group.attr("grad_views") : host.attr("grad_views");
}

bool grads_attached(const py::object& group) {
  if (group.attr("grad_flat").is_none()) return false;
  const py::list members = group.attr("members");
  const py::sequence views = member_views(group);
  for (std::size_t i = 0; i < members.size(); ++i) {
    const py::object grad = members[i].attr("shard").attr("grad");
    if (!grad.is_none()) return grad.ptr() == py::object(views[i]).ptr();
  }
  return false;
}

void add_grad_shard(const py::object& group, py::object shard, const py::list& mask) {
  const py::list members = group.attr("members");
  if (grads_attached(group)) {
    group.attr("grad_flat").attr("add_")(shard);
    const py::sequence views = member_views(group);
    for (std::size_t i = 0; i < members.size(); ++i) {
      const py::object member_shard = members[i].attr("shard");
      if (py::bool_(mask[i]) && member_shard.attr("grad").is_none())
        member_shard.attr("grad") = views[i];
    }
    return;
  }
  const py::object master = members[0].attr("shard").attr("dtype");
  if (shard.attr("dtype").ptr() != master.ptr()) shard = shard.attr("to")(master);
  const py::object views = shard.attr("split")(group.attr("sizes"));
  group.attr("grad_flat") = shard;
  group.attr("grad_views") = views;
  const py::sequence targets = member_views(group);
  for (std::size_t i = 0; i < members.size(); ++i) {
    const py::object member = members[i];
    if (py::bool_(mask[i]) && py::bool_(member.attr("requires_grad")))
      member.attr("shard").attr("grad") = targets[i];
  }
}

}  // namespace

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
