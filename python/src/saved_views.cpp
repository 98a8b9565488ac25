// Saved tensors in gathered copies; see saved_views.hpp.
#include "saved_views.hpp"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "ductile/error.hpp"

namespace ductile::python {

namespace py = pybind11;

namespace {

struct SavedView {
  py::object group;  // a GroupState
  py::object offset;
  py::object size;
  py::object stride;
};

py::object unpack_saved(py::handle packed) {
  if (!py::isinstance<SavedView>(packed)) return py::reinterpret_borrow<py::object>(packed);
  const auto& view = packed.cast<const SavedView&>();
  const GroupState& group = as_group(view.group);
  if (group.users == 0)
    throw Error(ErrorKind::incompatible,
                "zero3: backward needs the parameters of '" + group.name +
                    "', which no running module has gathered; if a module's forward uses a "
                    "parameter of another module, declare it with ductile.torch.zero3."
                    "register_external_parameter(module, parameter) before initialize()");
  return group.full.attr("as_strided")(view.size, view.stride, view.offset);
}

}  // namespace

void LiveCopies::add(std::uintptr_t start, std::size_t bytes, py::object group) {
  auto at = position(start);
  if (at != ranges_.end() && at->start == start)
    throw Error(ErrorKind::internal, "zero3: a gathered copy is live twice");
  GroupState* state = &as_group(group);
  ranges_.insert(at, Range{start, start + bytes, std::move(group), state});
}

void LiveCopies::remove(std::uintptr_t start) {
  auto at = position(start);
  if (at == ranges_.end() || at->start != start)
    throw Error(ErrorKind::internal, "zero3: released a gathered copy that is not live");
  ranges_.erase(at);
}

const LiveCopies::Range* LiveCopies::holding(std::uintptr_t address) const {
  auto at = std::upper_bound(ranges_.begin(), ranges_.end(), address,
                             [](std::uintptr_t a, const Range& r) { return a < r.start; });
  if (at == ranges_.begin()) return nullptr;
  --at;
  return address < at->end ? &*at : nullptr;
}

py::object LiveCopies::pack(py::handle tensor) const {
  if (!ranges_.empty()) {
    const Range* range = holding(tensor.attr("data_ptr")().cast<std::uintptr_t>());
    if (range != nullptr && tensor.attr("numel")().cast<std::int64_t>() > 0) {
      const GroupState& group = *range->state;
      // A reinterpreting view keeps a private copy.
      if (tensor.attr("dtype").ptr() != group.dtype.ptr() ||
          !tensor.attr("device").equal(group.full.attr("device")))
        return tensor.attr("clone")();
      return py::cast(SavedView{range->group, tensor.attr("storage_offset")(),
                                py::tuple(tensor.attr("size")()),
                                py::tuple(tensor.attr("stride")())});
    }
  }
  return py::reinterpret_borrow<py::object>(tensor);
}

std::vector<LiveCopies::Range>::iterator LiveCopies::position(std::uintptr_t start) {
  return std::lower_bound(ranges_.begin(), ranges_.end(), start,
                          [](const Range& r, std::uintptr_t s) { return r.start < s; });
}

void register_saved_views(py::module_& zero) {
  py::class_<SavedView>(zero, "SavedView", "A saved tensor that lies in a gathered copy.")
      .def_readonly("group", &SavedView::group)
      .def_readonly("offset", &SavedView::offset);
  py::class_<LiveCopies, std::shared_ptr<LiveCopies>>(
      zero, "LiveCopies", "The materialised groups by the address range of their copy.")
      .def(py::init<>())
      .def("add", &LiveCopies::add, py::arg("address"), py::arg("bytes"), py::arg("group"))
      .def("remove", &LiveCopies::remove, py::arg("address"))
      .def("pack", &LiveCopies::pack, py::arg("tensor"),
           "The pack hook: the tensor itself, or a SavedView when it lies in a live copy.")
      .def("__len__", &LiveCopies::size);
  zero.def("unpack_saved", &unpack_saved, py::arg("packed"),
           "The unpack hook: the saved tensor, or the view over its group's current copy.");
}

}  // namespace ductile::python
