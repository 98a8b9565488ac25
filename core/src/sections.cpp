// The sections a configuration file may have. Plugin sections name their
// plugin with a selector key; host keys are keys of a section that the core
// (or a CLI command) owns rather than the selected plugin.
#include "ductile/core/config.hpp"

namespace ductile::core {
namespace {

constexpr const char* kLengthFormats[] = {"auto", "text", "csv", "npy", "mmidx", nullptr};
constexpr const char* kLrSchedules[] = {"constant", "warmup_linear", "warmup_cosine", nullptr};
constexpr const char* kLogLevels[] = {"trace", "debug",    "info", "warn",
                                      "error", "critical", "off",  nullptr};

std::vector<SectionSpec> make_specs() {
  std::vector<SectionSpec> specs;
  specs.push_back({"plugins",
                   std::nullopt,
                   "",
                   "",
                   {{"path", ParamType::string_list, 0, nullptr, 0, 0, nullptr,
                     "Plugin directories searched first, relative to the config file"},
                    {"override_builtin", ParamType::string_list, 0, nullptr, 0, 0, nullptr,
                     "Built-in plugins (\"kind/name\") that a plugin of the same kind and name "
                     "found on the search path replaces; without this, the built-in one is used"}},
                   "where to find plugins"});
  specs.push_back({"log",
                   std::nullopt,
                   "",
                   "",
                   {{"level", ParamType::string, 0, "\"info\"", 0, 0, kLogLevels,
                     "Log level (overridden by --log-level and DUCTILE_LOG_LEVEL)"}},
                   "logging"});
  specs.push_back({"elasticity", PluginKind::elasticity, "policy", "", {}, "elasticity policy"});
  // Host keys of [batching]: where the demo and `ductile pack --config` read lengths.
  specs.push_back(
      {"batching",
       PluginKind::batching,
       "sampler",
       "",
       {{"lengths", ParamType::string, 0, nullptr, 0, 0, nullptr,
         "File of per-sample lengths (text, CSV, .npy or DeepSpeed metric prefix), "
         "relative to the config file"},
        {"column", ParamType::string, 0, nullptr, 0, 0, nullptr, "CSV column holding the lengths"},
        {"count_column", ParamType::string, 0, nullptr, 0, 0, nullptr,
         "CSV column of counts: the file is a histogram (length, count)"},
        {"format", ParamType::string, 0, "\"auto\"", 0, 0, kLengthFormats,
         "Format of the lengths file (auto: from the extension)"}},
       "batch sampler"});
  // Host keys of [lr]: the base schedule the scaling rule is applied to.
  specs.push_back({"lr",
                   PluginKind::lr,
                   "rule",
                   "",
                   {{"base_lr", ParamType::floating, param_has_min, "0.001", 0, 0, nullptr,
                     "Learning rate tuned for base_batch_size (peak of the schedule)"},
                    {"base_batch_size", ParamType::floating, param_has_min, nullptr, 1, 0, nullptr,
                     "Batch size (samples) that base_lr is tuned for"},
                    {"schedule", ParamType::string, 0, "\"constant\"", 0, 0, kLrSchedules,
                     "Base schedule: constant, warmup_linear or warmup_cosine"},
                    {"warmup_steps", ParamType::integer, param_has_min, "0", 0, 0, nullptr,
                     "Steps of linear warm-up from min_lr to base_lr"},
                    {"total_steps", ParamType::integer, param_has_min, "0", 0, 0, nullptr,
                     "Step at which the decay reaches min_lr"},
                    {"min_lr", ParamType::floating, param_has_min, "0.0", 0, 0, nullptr,
                     "Learning rate at the start of warm-up and the end of decay"}},
                   "learning-rate scaling rule"});
  specs.push_back(
      {"accelerator", PluginKind::accelerator, "backend", "cpu", {}, "accelerator backend"});
  specs.push_back(
      {"zero", PluginKind::zero, "coordinator", "partitioned", {}, "ZeRO-3 parameter coordinator"});
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
