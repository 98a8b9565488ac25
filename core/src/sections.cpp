// The sections a configuration file may have. The core owns [plugins] and
// [log] and knows one section per plugin kind with its selector key; the
// keys a section's host reads beside the plugin's (a lengths file, a base
// schedule) and aliases of a selector are added by the libraries above it
// (extend_section), so that the core holds no word of theirs or of another
// tool's.
#include <mutex>

#include <fmt/format.h>

#include "ductile/core/config.hpp"

namespace ductile::core {
namespace {

constexpr const char* kLogLevels[] = {"trace", "debug",    "info", "warn",
                                      "error", "critical", "off",  nullptr};

std::vector<SectionSpec> make_specs() {
  std::vector<SectionSpec> specs;
  specs.push_back(
      {"plugins",
       std::nullopt,
       "",
       "",
       {{.key = "path",
         .type = ParamType::string_list,
         .doc = "Plugin directories searched first, relative to the config file"},
        {.key = "override_builtin",
         .type = ParamType::string_list,
         .doc = "Built-in plugins (\"kind/name\") that a plugin of the same kind and name "
                "found on the search path replaces; without this, the built-in one is used"}},
       "where to find plugins",
       std::nullopt});
  specs.push_back({"log",
                   std::nullopt,
                   "",
                   "",
                   {{.key = "level",
                     .type = ParamType::string,
                     .default_value = "\"info\"",
                     .allowed_values = kLogLevels,
                     .doc = "Log level (overridden by --log-level and DUCTILE_LOG_LEVEL)"}},
                   "logging",
                   std::nullopt});
  specs.push_back(
      {"elasticity", PluginKind::elasticity, "policy", "", {}, "elasticity policy", std::nullopt});
  specs.push_back(
      {"batching", PluginKind::batching, "sampler", "", {}, "batch sampler", std::nullopt});
  specs.push_back(
      {"lr", PluginKind::lr, "rule", "", {}, "learning-rate scaling rule", std::nullopt});
  specs.push_back({"accelerator",
                   PluginKind::accelerator,
                   "backend",
                   "cpu",
                   {},
                   "accelerator backend",
                   std::nullopt});
  specs.push_back({"zero",
                   PluginKind::zero,
                   "coordinator",
                   "partitioned",
                   {},
                   "ZeRO-3 parameter coordinator",
                   std::nullopt});
  specs.push_back({"optimizer",
                   PluginKind::optimizer,
                   "name",
                   "cpu_adam",
                   {},
                   "optimizer stepping flat fp32 shards on the host",
                   std::nullopt});
  return specs;
}

struct SectionTable {
  std::mutex mutex;
  std::vector<SectionSpec> specs = make_specs();
};

SectionTable& table() {
  static SectionTable instance;
  return instance;
}

}  // namespace

std::vector<SectionSpec> section_specs() {
  auto& t = table();
  std::lock_guard lock(t.mutex);
  return t.specs;
}

std::optional<SectionSpec> find_section_spec(std::string_view name) {
  auto& t = table();
  std::lock_guard lock(t.mutex);
  for (const auto& s : t.specs)
    if (s.name == name) return s;
  return std::nullopt;
}

void extend_section(std::string_view section, std::vector<ParamSpec> host_keys,
                    std::optional<SelectorAlias> alias) {
  auto& t = table();
  std::lock_guard lock(t.mutex);
  SectionSpec* spec = nullptr;
  for (auto& s : t.specs)
    if (s.name == section) spec = &s;
  if (!spec)
    throw Error(ErrorKind::internal, fmt::format("extend_section: no section [{}]", section));
  for (const auto& key : host_keys)
    for (const auto& have : spec->host_keys)
      if (std::string_view(key.key) == have.key)
        throw Error(ErrorKind::internal,
                    fmt::format("extend_section: [{}] already has the key '{}'", section, key.key));
  if (alias && spec->alias)
    throw Error(ErrorKind::internal, fmt::format("extend_section: [{}] already has the alias '{}'",
                                                 section, spec->alias->key));
  spec->host_keys.insert(spec->host_keys.end(), host_keys.begin(), host_keys.end());
  if (alias) spec->alias = std::move(alias);
}

}  // namespace ductile::core
