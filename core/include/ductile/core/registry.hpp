// Finding, loading and instantiating plugins.
//
// The registry lists a search path of directories (first match wins) for
// files named libductile_<kind>_<name>.so without opening them: a library is
// loaded (RTLD_NOW | RTLD_LOCAL) and its descriptor checked only when its kind
// and name are looked up, so a command that needs one plugin opens one
// library. plugins() and problems() load every file (for `plugins list`).
//
// Trust (docs/architecture.md): a directory, and a file, is used only when it
// and every directory above it are owned by root or the caller and writable
// by no one else (plugin_trust.hpp); a file is opened only after its ELF
// dynamic symbol table shows the entry symbol (elf_symbols.hpp), so no code
// of a library that is not a plugin runs; a file named like a plugin of the
// built-in directory is not used in its place unless RegistryOptions allows
// that kind and name ([plugins] override_builtin in a configuration).
//
// Every object is handed out
// as a shared_ptr whose deleter holds its library; beyond that, a library that
// loaded successfully is never unloaded before the process exits, so that an
// exception thrown by plugin code can still be caught and printed after the
// objects and the registry are gone.
//
// Threading: a registry is built on one thread; afterwards its const methods
// (which load libraries on demand under an internal mutex) and create() may
// be called from any thread.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <spdlog/logger.h>

#include "ductile/params.hpp"
#include "ductile/plugin.hpp"

namespace ductile::core {

class LoadedLibrary;

// A plugin found on the search path and successfully loaded.
struct PluginInfo {
  PluginKind kind;
  std::string name;
  std::string version;
  std::string description;
  std::filesystem::path file;
  std::string build_tag;
  std::uint32_t abi_version = 0;         // DUCTILE_ABI_VERSION, as the host's
  std::uint32_t interface_revision = 0;  // of its kind's interface (version.hpp), as the host's
  // Points into the loaded library; valid while the registry lives.
  std::vector<ParamSpec> params;
  ductile_plugin_factory factory = nullptr;
  // The plugin's parameter check; nullptr when the plugin defines none.
  ductile_plugin_validate validate = nullptr;
  // Keeps the library loaded; shared with every object created from it.
  std::shared_ptr<LoadedLibrary> library;
};

// A file on the search path that looked like a plugin but could not be used.
struct LoadProblem {
  std::filesystem::path file;
  std::string message;  // complete sentence naming the file
};

// Parses "elasticity", "batching", ... Returns false for anything else.
bool parse_plugin_kind(std::string_view text, PluginKind& kind);
std::vector<std::string> plugin_kind_names();

// A plugin's kind and name, as "kind/name" reads them.
struct PluginRef {
  PluginKind kind;
  std::string name;
  friend bool operator==(const PluginRef&, const PluginRef&) = default;
};
// Parses "kind/name" (a known kind, a non-empty name). nullopt otherwise.
std::optional<PluginRef> parse_plugin_ref(std::string_view text);

// Loads one plugin file and checks it. Throws ductile::Error
// (ErrorKind::plugin) with a message naming the file, before any of the
// file's code runs, for: a file or a directory above it that another user
// owns or may write (plugin_trust.hpp); a file that is not an ELF shared
// library for this machine, or does not export the entry symbol
// (elf_symbols.hpp). After loading, for a descriptor that points outside the
// library, a null descriptor, an ABI version, build tag, interface revision
// or shared-layout mismatch (both sides named), an invalid schema, a kind or
// name that does not match the file name. not_found when the file does not
// exist.
PluginInfo load_plugin_file(const std::filesystem::path& file);

// The checks load_plugin_file() makes of the descriptor a plugin's entry
// point returned, on their own (for tools and the fuzz tests): not null,
// the one rule of version.hpp (ABI version, build tag, shared layout, the
// kind's interface revision), name, factory, the schema (keys, types, each
// bound with its flag and not NaN, min <= max), and that `file`'s name, when
// it has the libductile_<kind>_<name>.so form, matches. Returns the
// plugin's information without a library (`library` is null).
// Throws ductile::Error (ErrorKind::plugin) naming `file` and what is wrong.
PluginInfo check_plugin_descriptor(const ductile_plugin_descriptor* descriptor,
                                   const std::filesystem::path& file);

// Calls the plugin's factory with `context`. Throws ductile::Error with the
// kind and type the plugin reported and a message naming the plugin and
// containing the plugin's message. The object keeps its library loaded.
std::shared_ptr<Plugin> create_plugin(const PluginInfo& info, const HostContext& context);

// What a plugin's validate hook reported.
struct PluginParamError {
  ErrorKind kind = ErrorKind::config;
  std::string type;
  std::string message;  // the plugin's message, unchanged
  std::string key;      // the parameter at fault, or empty
};

// Runs the plugin's validate hook on complete parameters (schema-checked,
// defaults filled in); nothing when the plugin has none or they are valid.
std::optional<PluginParamError> check_plugin_params(const PluginInfo& info, const Params& params);

// Same, but throws the reported error as a ductile::Error (a ParamError when
// the plugin named a key) with the plugin's kind, type and message.
void validate_plugin_params(const PluginInfo& info, const Params& params);

// A directory of the search path that was not searched, and why.
struct SkippedDirectory {
  std::filesystem::path directory;
  std::string reason;  // a phrase: "named by the file's [plugins] path; ..."
};

struct RegistryOptions {
  // Built-in plugins that a file of the same kind and name found elsewhere on
  // the search path may replace (when it comes first). Any other such file is
  // not used: the built-in plugin is, and problems() names the file.
  std::vector<PluginRef> builtin_overrides;
  // Directories the caller chose not to search (not on the search path);
  // named, with the reason, when a plugin is not found.
  std::vector<SkippedDirectory> unsearched;
};

class PluginRegistry {
 public:
  // Lists `search_path` in order (directory entries only; no library is
  // opened). A directory that fails the trust rule is not searched: a
  // warning and problems() name it and the reason. Duplicates (same kind and
  // name) keep the first, except that the built-in directory's file wins
  // unless options.builtin_overrides names it; the warning naming both files
  // is logged when that plugin is loaded. Problems of a file are collected
  // (see problems()) and logged at warning level when it is loaded.
  PluginRegistry(std::vector<std::filesystem::path> search_path,
                 std::shared_ptr<spdlog::logger> logger, RegistryOptions options = {});
  PluginRegistry(PluginRegistry&&) noexcept;
  PluginRegistry& operator=(PluginRegistry&&) noexcept;
  ~PluginRegistry();

  // The default search path: `config_dirs` (from a config's [plugins] path),
  // then DUCTILE_PLUGIN_PATH (colon-separated), then the built-in plugin
  // directory.
  static std::vector<std::filesystem::path> default_search_path(
      const std::vector<std::filesystem::path>& config_dirs = {});

  // <directory of libductile_core.so>/ductile/plugins: next to the binaries
  // in the build tree, lib/ductile/plugins under the install prefix.
  static std::filesystem::path builtin_plugin_dir();
  // The directory of libductile_core.so, where ductile's other libraries
  // (pipeline, agent) are too ("." if it cannot be found). When the core is
  // linked into a program (the `ductile` program built with
  // DUCTILE_STATIC_RUNTIME), the library directory of that program's
  // installation: <program's directory>/<bin to lib> (../lib).
  static std::filesystem::path core_library_dir();

  const std::vector<std::filesystem::path>& search_path() const;
  // The directories not searched: those the options named, then those the
  // trust rule refused, each with the reason.
  const std::vector<SkippedDirectory>& skipped() const;
  // Every plugin of the search path, sorted by kind and name: loads every
  // file not loaded yet.
  const std::vector<PluginInfo>& plugins() const;
  // What could not be used: the refused directories, then the files that
  // failed to load and those that named a built-in plugin without leave, in
  // search-path order. Loads every file.
  const std::vector<LoadProblem>& problems() const;

  // The plugin of this kind and name, loading only its file. Throws
  // ductile::Error: ErrorKind::plugin when the file exists but fails to load
  // (with that failure), else ErrorKind::not_found listing the plugins of
  // that kind (from file names), the closest name, the directories searched
  // and those not searched with the reason.
  const PluginInfo& find(PluginKind kind, std::string_view name) const;

  // Finds by name alone (any kind), loading only the matching file; throws
  // not_found or, when the name exists in several kinds, invalid_argument
  // asking for kind/name.
  const PluginInfo& find_any(std::string_view name) const;

  // Names of the plugins of one kind, sorted, from the file names (nothing
  // is opened, so a name may belong to a file that fails to load).
  std::vector<std::string> names(PluginKind kind) const;

  // create_plugin(info, context).
  std::shared_ptr<Plugin> create(const PluginInfo& info, const HostContext& context) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace ductile::core
