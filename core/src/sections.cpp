// The sections a configuration file may have. Plugin sections name their
// plugin with a selector key; host keys are keys of a section that the core
// (or a CLI command) owns rather than the selected plugin.
#include "ductile/core/config.hpp"

namespace ductile::core {
namespace {

constexpr const char* kLogLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off",
                                      nullptr};

std::vector<SectionSpec> make_specs() {
  std::vector<SectionSpec> specs;
  specs.push_back({"plugins",
                   std::nullopt,
                   "",
                   "",
                   {{"path", ParamType::string_list, 0, nullptr, 0, 0, nullptr,
                     "Plugin directories searched first, relative to the config file"}},
                   "where to find plugins"});
  specs.push_back({"log",
                   std::nullopt,
                   "",
                   "",
                   {{"level", ParamType::string, 0, "\"info\"", 0, 0, kLogLevels,
                     "Log level (overridden by --log-level and DUCTILE_LOG_LEVEL)"}},
                   "logging"});
  specs.push_back({"elasticity", PluginKind::elasticity, "policy", "", {}, "elasticity policy"});
  specs.push_back({"batching", PluginKind::batching, "sampler", "", {}, "batch sampler"});
  specs.push_back({"lr", PluginKind::lr, "rule", "", {}, "learning-rate scaling rule"});
  specs.push_back({"accelerator", PluginKind::accelerator, "backend", "cpu", {}, "accelerator backend"});
  specs.push_back({"zero", PluginKind::zero, "coordinator", "partitioned", {}, "ZeRO-3 parameter coordinator"});
  return specs;
}

}  // namespace

const std::vector<SectionSpec>& section_specs() {
  static const std::vector<SectionSpec> specs = make_specs();
  return specs;
}

const SectionSpec* find_section_spec(std::string_view name) {
  for (const auto& s : section_specs())
    if (s.name == name) return &s;
  return nullptr;
}

}  // namespace ductile::core
