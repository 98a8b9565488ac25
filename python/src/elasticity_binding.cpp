// _ductile.elasticity: elasticity policies from a DeepSpeed JSON block or a
// ductile TOML runtime, their compute(), and the scheduler contract. The
// Python module ductile.elasticity builds DeepSpeed's API on these.
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/elasticity_policy.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/json.hpp"

namespace ductile::python {

namespace {

// A policy ready to compute, with where its settings came from; the
// runtime keeps the registry (and the plugin's library) alive.
struct PolicyHandle {
  std::shared_ptr<RuntimeHandle> runtime;
  pipeline::ElasticityPolicySetup setup;
};

std::shared_ptr<PolicyHandle> from_deepspeed(const std::string& json_text,
                                             const std::string& origin,
                                             const py::object& plugin_path) {
  auto runtime = plain_runtime(paths_from(plugin_path));
  std::lock_guard lock(runtime->mutex);
  auto setup = pipeline::elasticity_policy_from_deepspeed_json(runtime->runtime, json_text, origin);
  return std::make_shared<PolicyHandle>(PolicyHandle{std::move(runtime), std::move(setup)});
}

std::shared_ptr<PolicyHandle> from_runtime(const std::shared_ptr<RuntimeHandle>& runtime) {
  std::lock_guard lock(runtime->mutex);
  auto setup = pipeline::elasticity_policy_from_runtime(runtime->runtime);
  return std::make_shared<PolicyHandle>(PolicyHandle{runtime, std::move(setup)});
}

// The result's one JSON form (pipeline::to_json), as a dict.
py::dict result_dict(const ElasticityResult& r) {
  return py::module_::import("json").attr("loads")(pipeline::to_json(r).dump());
}

}  // namespace

void register_elasticity(py::module_& m) {
  py::class_<PolicyHandle, std::shared_ptr<PolicyHandle>>(m, "Policy",
                                                          "An elasticity policy plugin instance.")
      .def_property_readonly("name", [](const PolicyHandle& h) { return h.setup.source.policy; })
      .def_property_readonly("origin", [](const PolicyHandle& h) { return h.setup.source.origin; })
      .def_property_readonly("deepspeed_json",
                             [](const PolicyHandle& h) { return h.setup.source.deepspeed_json; })
      .def_property_readonly("warnings",
                             [](const PolicyHandle& h) { return h.setup.source.warnings; })
      .def_property_readonly(
          "params",
          [](const PolicyHandle& h) { return dict_from_params(h.setup.effective_params); })
      .def(
          "compute",
          [](const PolicyHandle& h, std::int64_t world_size, bool require_micro_batch) {
            ElasticityResult r;
            {
              py::gil_scoped_release release;
              r = h.setup.policy->compute(ElasticityRequest{world_size, require_micro_batch});
            }
            return result_dict(r);
          },
          py::arg("world_size") = 0, py::arg("require_micro_batch") = false)
      .def(
          "check_scheduler",
          [](const PolicyHandle& h) {
            return pipeline::check_scheduler_elasticity(
                pipeline::fingerprint_of(h.setup.source.policy, h.setup.effective_params),
                core::logger());
          },
          "Compares with DEEPSPEED_ELASTICITY_CONFIG / DUCTILE_ELASTICITY_CONFIG; raises "
          "ElasticityConfigError naming every difference; False (and a warning) when unset.");

  m.def("from_deepspeed", &from_deepspeed, py::arg("json_text"), py::arg("origin"),
        py::arg("plugin_path") = py::none());
  m.def("from_runtime", &from_runtime, py::arg("runtime"));
  m.def(
      "is_json_config",
      [](const std::string& path, const std::string& content) {
        return pipeline::is_json_config(path, content);
      },
      py::arg("path"), py::arg("content"),
      "Whether a configuration is JSON: a .json path, or another than .toml with content whose "
      "first non-blank character is '{' (the one detection of every front end).");
  m.def(
      "deepspeed_mode",
      [](const std::string& json_text, const std::string& origin) {
        const auto mode = pipeline::parse_deepspeed_elasticity_mode(json_text, origin);
        py::dict d;
        d["has_block"] = mode.has_block;
        d["elastic"] = mode.elastic;
        d["warnings"] = mode.warnings;
        return d;
      },
      py::arg("json_text"), py::arg("origin"),
      "DeepSpeedConfig's rules for the elasticity block beside the batch keys "
      "(pipeline::deepspeed_elasticity_mode): {has_block, elastic, warnings}.");
  m.def(
      "non_elastic_plan",
      [](const std::string& json_text, const std::string& origin, std::int64_t world_size) {
        const auto mode = pipeline::parse_deepspeed_elasticity_mode(json_text, origin);
        const auto plan = pipeline::non_elastic_plan(mode.batch, world_size, origin);
        return py::module_::import("json").attr("loads")(
            pipeline::non_elastic_json(mode.batch, plan).dump());
      },
      py::arg("json_text"), py::arg("origin"), py::arg("world_size") = 0,
      "The batch of a non-elastic DeepSpeed config for a world size "
      "(pipeline::non_elastic_plan), as `ductile elastic --json` prints it.");
  m.def(
      "check_scheduler_deepspeed",
      [](const std::string& json_text, const std::string& origin) {
        auto source = pipeline::elasticity_from_deepspeed_json(
            json_text, origin, plain_runtime({})->runtime.registry());
        return pipeline::check_scheduler_elasticity(
            pipeline::fingerprint_of(source.policy, source.params), core::logger());
      },
      py::arg("json_text"), py::arg("origin"));
}

}  // namespace ductile::python
