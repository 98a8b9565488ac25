// The embedding API: load a configuration and get plugin instances, without
// the CLI. Typical use in a training framework:
//
//   auto runtime = ductile::core::Runtime::from_file("train.toml");
//   auto policy = runtime.get<ductile::ElasticityPolicy>();
//   auto accel = runtime.get<ductile::Accelerator>();
//
// Ownership: the Runtime owns the registry (and so keeps the libraries loaded)
// and one shared instance per configured plugin kind. Instances handed out
// stay valid after the Runtime is destroyed: each keeps its library loaded.
// Threading: construct on one thread. get()/instance() are serialized by an
// internal mutex and may be called from any thread.
// Errors: ductile::Error; ConfigError for an invalid configuration.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <spdlog/logger.h>

#include "ductile/core/config.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/plugin.hpp"

namespace ductile::core {

struct RuntimeOptions {
  // Searched before the config's [plugins] path.
  std::vector<std::filesystem::path> extra_plugin_dirs;
  // Logger for the runtime and (as the parent of) its plugins; default: the
  // core's logger.
  std::shared_ptr<spdlog::logger> logger;
  // Run each selected plugin's validate hook while validating the file, so
  // that its errors come as a ConfigError with file:line:col (as `ductile
  // config check` does). Off: the hooks run before each instance is created
  // and throw the plugin's error unchanged.
  bool plugin_checks = false;
  // Built-in plugins that a plugin found elsewhere may replace, besides
  // those of the file's [plugins] override_builtin (registry.hpp).
  std::vector<PluginRef> builtin_overrides{};
  // Whether the directories of the file's [plugins] path are searched. Off,
  // no code from a directory the file names runs (`ductile config check`
  // of a file from elsewhere); a plugin not found names those directories
  // with `config_dirs_note` as the reason.
  bool search_config_plugin_dirs = true;
  std::string config_dirs_note = "named by the file's [plugins] path, not searched here";
};

class Runtime {
 public:
  static Runtime from_file(const std::filesystem::path& file, RuntimeOptions options = {});
  static Runtime from_string(std::string_view toml, std::string_view source_name,
                             RuntimeOptions options = {});
  static Runtime from_document(const ConfigDocument& document, RuntimeOptions options = {});

  // A runtime of another document on this runtime's registry (the plugins
  // are found once; both keep it alive): for a document that needed the
  // registry to be written, a DeepSpeed JSON config typed by the plugins'
  // schemas. The document's [plugins] section, if any, is not searched.
  // Instances are not shared. Throws ConfigError as from_document does.
  Runtime with_config(const ConfigDocument& document, bool plugin_checks = false) const;

  Runtime(Runtime&&) noexcept;
  Runtime& operator=(Runtime&&) noexcept;
  ~Runtime();

  const Config& config() const;
  const PluginRegistry& registry() const;
  std::shared_ptr<spdlog::logger> logger() const;

  // True when the configuration selects a plugin of this kind (explicitly
  // or through a default of a section that is present).
  bool has(PluginKind kind) const;

  // The shared instance for a kind, created on first use with the
  // section's parameters. Throws Error(config) if the file has no such section.
  std::shared_ptr<Plugin> instance(PluginKind kind);

  template <class Interface>
  std::shared_ptr<Interface> get() {
    return std::static_pointer_cast<Interface>(instance(Interface::kind));
  }

  // A new, unshared instance of a named plugin with explicit parameters
  // (validated against its schema; defaults filled in).
  std::shared_ptr<Plugin> create(PluginKind kind, std::string_view name, const Params& params);
  template <class Interface>
  std::shared_ptr<Interface> create(std::string_view name, const Params& params = {}) {
    return std::static_pointer_cast<Interface>(create(Interface::kind, name, params));
  }

  struct State;

 private:
  explicit Runtime(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Checks explicit parameters against a plugin's schema and fills defaults.
// Throws Error(config) naming the plugin, key and value.
Params complete_params(const PluginInfo& info, const Params& given);

// The parameters of `given` whose keys the plugin's schema has (values
// unchecked); the names of the others are appended to `dropped` when given.
// For settings written for another plugin or another tool (another tool's
// block read by a policy that lacks some of its keys).
Params schema_params(const PluginInfo& info, const Params& given,
                     std::vector<std::string>* dropped = nullptr);

// The strings a key of the plugin's schema allows; empty when the plugin has
// no such key or takes any string. For front ends that check a typed option
// against the schema before the plugin exists (naming it their own way).
std::vector<std::string> schema_allowed_values(const PluginInfo& info, std::string_view key);

}  // namespace ductile::core
