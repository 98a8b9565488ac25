// _ductile.lr_schedules: DeepSpeed's learning-rate schedulers
// (pipeline/deepspeed_schedules.hpp) for ductile.deepspeed.lr_schedules: a
// schedule made from a type name and a dict of parameters (read by the
// same C++ function as a config's scheduler block), whose rates and betas at
// any step Python sets on the param groups.
#include <cmath>

#include <pybind11/stl.h>

#include "bindings.hpp"
#include "ductile/pipeline/deepspeed_schedules.hpp"

namespace ductile::python {

namespace {

using nlohmann::json;

// One parameter's Python value as JSON, strictly (no bool for a number):
// None, bool, int, float, str, or a list or tuple of those.
json json_of(const py::handle& value, const std::string& key) {
  if (value.is_none()) return nullptr;
  if (PyBool_Check(value.ptr())) return value.ptr() == Py_True;
  if (PyFloat_Check(value.ptr())) {
    // JSON has no NaN or infinity: refused here, shown as Python writes them.
    const double number = real_argument(value, key);
    if (!std::isfinite(number))
      throw Error(ErrorKind::invalid_argument,
                  key + " = " + py::repr(value).cast<std::string>() + "; valid: a finite number");
    return number;
  }
  if (PyIndex_Check(value.ptr())) return int_argument(value, key);
  if (PyUnicode_Check(value.ptr())) return text_argument(value, key);
  if (PyList_Check(value.ptr()) || PyTuple_Check(value.ptr())) {
    json out = json::array();
    std::size_t i = 0;
    for (const auto& item : value)
      out.push_back(json_of(item, key + "[" + std::to_string(i++) + "]"));
    return out;
  }
  throw Error(ErrorKind::invalid_argument,
              key + " = " + py::repr(value).cast<std::string>() + " (" + python_type_name(value) +
                  "); valid: a number, a list of numbers, a bool or a str");
}

py::object python_of(const json& value) {
  return py::module_::import("json").attr("loads")(value.dump());
}

pipeline::DeepSpeedSchedule make_schedule(const py::handle& type, const py::dict& params,
                                          const std::vector<double>& group_lrs, bool has_betas,
                                          const std::string& key_prefix) {
  json object = json::object();
  for (const auto& [key, value] : params) {
    const std::string name = text_argument(key, key_prefix + "params key");
    object[name] = json_of(value, key_prefix + name);
  }
  auto spec = pipeline::deepspeed_schedule_spec(text_argument(type, key_prefix + "type"), object,
                                                key_prefix);
  return pipeline::DeepSpeedSchedule(std::move(spec), group_lrs, has_betas);
}

}  // namespace

py::object deepspeed_scheduler_dict(const pipeline::DeepSpeedScheduleSpec& spec) {
  py::dict d;
  d["type"] = pipeline::to_string(spec.type());
  d["params"] = python_of(pipeline::deepspeed_schedule_params(spec));
  return d;
}

void register_lr_schedules(py::module_& m) {
  using pipeline::DeepSpeedSchedule;
  std::vector<std::string> names;
  for (const char* const* name = pipeline::kDeepSpeedScheduleNames; *name; ++name)
    names.emplace_back(*name);
  m.attr("TYPES") = py::tuple(py::cast(names));
  py::class_<DeepSpeedSchedule>(m, "DeepSpeedSchedule")
      .def(py::init(&make_schedule), py::arg("type"), py::arg("params"), py::arg("group_lrs"),
           py::arg("optimizer_has_betas") = true, py::arg("key_prefix") = "",
           "DeepSpeed's scheduler `type` (TYPES) with `params` (DeepSpeed's parameter names; "
           "an absent one, None for a non-optional one, or \"auto\" keeps DeepSpeed's "
           "default) over param groups whose rates are now `group_lrs`. Errors name "
           "`key_prefix` + the parameter (InvalidArgumentError).")
      .def_property_readonly(
          "type", [](const DeepSpeedSchedule& s) { return pipeline::to_string(s.spec().type()); })
      .def_property_readonly(
          "params",
          [](const DeepSpeedSchedule& s) {
            return python_of(pipeline::deepspeed_schedule_params(s.spec()));
          },
          "Every parameter with its value, DeepSpeed's defaults filled in.")
      .def_property_readonly(
          "last_batch_iteration",
          [](const DeepSpeedSchedule& s) { return s.spec().last_batch_iteration; })
      .def_property_readonly("groups", &DeepSpeedSchedule::groups)
      .def_property_readonly("cycles_momentum", &DeepSpeedSchedule::cycles_momentum,
                             "OneCycle with cycle_momentum on an optimizer with betas.")
      .def_property_readonly_static(
          "second_beta", [](const py::object&) { return DeepSpeedSchedule::kOneCycleSecondBeta; },
          "The second beta OneCycle sets with the first.")
      .def(
          "lrs",
          [](const DeepSpeedSchedule& s, const py::handle& last_batch_iteration) {
            return s.lrs(int_argument(last_batch_iteration, "last_batch_iteration"));
          },
          py::arg("last_batch_iteration"),
          "Every group's rate at that index of the last batch (DeepSpeed's get_lr()).")
      .def(
          "betas",
          [](const DeepSpeedSchedule& s, const py::handle& last_batch_iteration) {
            return s.betas(int_argument(last_batch_iteration, "last_batch_iteration"));
          },
          py::arg("last_batch_iteration"),
          "Every group's first beta at that index ([] unless cycles_momentum).")
      .def("initial_lrs", &DeepSpeedSchedule::initial_lrs,
           "The rates a scheduler made at last_batch_iteration -1 sets.")
      .def("initial_betas", &DeepSpeedSchedule::initial_betas,
           "The first betas a scheduler made at last_batch_iteration -1 sets.");
}

}  // namespace ductile::python
