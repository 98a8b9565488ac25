// Configuration files: TOML parsed with TOML++, validated against the schema
// of each selected plugin before anything is created.
//
// A file has one section per plugin kind, naming its plugin with a selector
// key, plus host sections owned by the core:
//
//   [plugins]    path = ["dir", ...]     extra plugin directories (relative to the file)
//                override_builtin = ["kind/name", ...]  built-in plugins those may replace
//   [log]        level = "info"
//   [elasticity] policy = "v0.1"
//   [batching]   sampler = "greedy"
//   [lr]         rule = "linear"
//   [accelerator] backend = "cpu"        (default "cpu")
//   [zero]       coordinator = "partitioned" (default)
//
// Every other key of a plugin section must be in the selected plugin's schema
// or in the section's host keys, which libraries above the core add
// (extend_section). All errors of a file are reported together,
// sorted by position, as "file:line:col: message".
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ductile/error.hpp"
#include "ductile/params.hpp"
#include "ductile/plugin.hpp"

namespace ductile::core {

class PluginRegistry;
struct PluginRef;

// How deep tables, arrays and dotted keys may nest in a configuration file;
// a deeper file is refused (ConfigError at the place it gets too deep) before
// it is parsed.
inline constexpr std::size_t kMaxConfigNesting = 128;

struct SourcePosition {
  std::string file;
  std::uint32_t line = 0;    // 1-based; 0 = unknown
  std::uint32_t column = 0;  // 1-based; 0 = unknown
};

struct Diagnostic {
  SourcePosition where;
  std::string message;
  std::string format() const;  // "file:line:col: message", one line (printable())
};

// The most diagnostics a ConfigError holds and prints: a file of a million
// bad keys is reported by its first ones and a count of the rest.
inline constexpr std::size_t kMaxConfigDiagnostics = 100;

// Thrown when a configuration is invalid: what() is every diagnostic, one a
// line, in file order, at most kMaxConfigDiagnostics of them, then "... and N
// more"; kind() is ErrorKind::config.
class ConfigError : public Error {
 public:
  // `diagnostics` in file order; `more`: how many were left out of them.
  explicit ConfigError(std::vector<Diagnostic> diagnostics, std::size_t more = 0);
  const std::vector<Diagnostic>& diagnostics() const { return diagnostics_; }
  // The diagnostics left out (beyond kMaxConfigDiagnostics).
  std::size_t more() const { return more_; }

 private:
  std::vector<Diagnostic> diagnostics_;
  std::size_t more_ = 0;
};

// A second key that may name a section's plugin, for files written in
// another tool's words: the pipeline gives [elasticity] the `version = 0.1`
// of another tool's files. The core reads the key's value as text (a number as
// written, or a string; `expected` says what else it may hold, for the
// message about a value of another type) and asks `resolve` which plugin it
// selects, given the selector key's value when the file has one too.
// `resolve` returns the plugin to use or throws Error(config) with the
// message to report at the key (a contradiction, say).
struct SelectorAlias {
  std::string key;
  std::string expected;
  std::function<std::string(std::string_view value, const std::optional<std::string>& selected)>
      resolve;
};

// How a section of the file is interpreted. `kind` is set for plugin
// sections; host-only sections have no selector.
struct SectionSpec {
  std::string name;
  std::optional<PluginKind> kind;
  std::string selector;              // key naming the plugin ("policy", ...)
  std::string default_plugin;        // used when the selector key is absent; "" = required
  std::vector<ParamSpec> host_keys;  // keys the section's host owns, beside the plugin's
  std::string doc;
  std::optional<SelectorAlias> alias;
};

// The sections a file may have, in a fixed order: [plugins] and [log], which
// the core owns, and one section per plugin kind. A copy, so that it stays
// valid while a library extends a section.
std::vector<SectionSpec> section_specs();
std::optional<SectionSpec> find_section_spec(std::string_view name);

// Adds host keys (keys a library above the core reads from a plugin
// section, beside the plugin's own) and optionally a selector alias to a
// section. The pipeline calls it as its library loads, for [batching]'s
// lengths file, [lr]'s base schedule and [elasticity]'s `version`; the core
// holds none of those words.
// Ownership: the ParamSpec strings must outlive the process (literals).
// Threading: safe to call while other threads validate files; a file
// validated before the call does not see the keys.
// Errors: Error(internal) for an unknown section, a key the section already
// has, or a second alias.
void extend_section(std::string_view section, std::vector<ParamSpec> host_keys,
                    std::optional<SelectorAlias> alias = std::nullopt);

// A validated plugin section.
struct PluginSection {
  std::string section;
  PluginKind kind;
  std::string plugin;    // the selected plugin's name
  Params params;         // the plugin's parameters, defaults filled in
  Params host_params;    // the section's host keys, defaults filled in
  SourcePosition where;  // the section header
};

// One value of a configuration written in another tool's format (a
// DeepSpeed JSON config), already converted by the front end that read it:
// typed by the selected plugin's schema at that edge, then checked by
// Config::validate like a TOML value (bounds, allowed strings, the plugin's
// validate hook). `user_key` is the key as the user wrote it
// ("zero_optimization.stage3_prefetch_bucket_size"): every message about the
// value names it.
struct ConfigEntry {
  std::string section;  // "zero"
  std::string key;      // "prefetch_bucket_size", or the section's selector
  ParamValue value;
  std::string user_key;
};

// A parsed, not yet validated file: enough to learn [plugins] path and
// [log] level, which are needed before plugins can be found.
class ConfigDocument {
 public:
  // Throws ConfigError for a file that cannot be read or is not valid TOML.
  static ConfigDocument from_file(const std::filesystem::path& file);
  // The same document for the text of `file` that the caller has read
  // already (with read_user_file, to tell JSON from TOML, say): its name and
  // directory are the file's. Throws ConfigError for text that is not valid
  // TOML.
  static ConfigDocument from_file_text(const std::filesystem::path& file, std::string_view text);
  static ConfigDocument from_string(std::string_view text, std::string_view source_name,
                                    const std::filesystem::path& base_dir = {});
  // A document of sections given as entries (see ConfigEntry): no [plugins]
  // or [log] section, and no positions (messages name `source_name` and the
  // user's key). Throws nothing; Config::validate reports the problems.
  static ConfigDocument from_entries(std::vector<ConfigEntry> entries, std::string_view source_name,
                                     const std::filesystem::path& base_dir = {});

  ConfigDocument(ConfigDocument&&) noexcept;
  ConfigDocument& operator=(ConfigDocument&&) noexcept;
  ~ConfigDocument();

  // A document of this one's section `name` alone; with
  // `top_level_keys`, a document without that table has its top-level keys
  // (those that are not tables) read as the section. For a copy of a
  // configuration that only one section of is wanted from (the scheduler's
  // copy of [elasticity]). `unnamed`, when given, is added as an entry if the
  // section names no plugin (neither its selector key nor its alias): the
  // plugin another tool's default selects.
  ConfigDocument section_document(std::string_view name, bool top_level_keys,
                                  std::optional<ConfigEntry> unnamed = std::nullopt) const;

  const std::string& source_name() const;
  // Directory that relative paths in the file are resolved against.
  const std::filesystem::path& base_dir() const;
  // [plugins] path, resolved against base_dir() (what is malformed is
  // skipped here and reported by Config::validate).
  std::vector<std::filesystem::path> plugin_dirs() const;
  // [plugins] override_builtin: the built-in plugins a plugin found on the
  // search path may replace (malformed entries skipped, as above).
  std::vector<PluginRef> builtin_overrides() const;
  // [log] level if present.
  std::optional<std::string> log_level() const;

  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  ConfigDocument();
  std::unique_ptr<Impl> impl_;
};

// A validated configuration.
class Config {
 public:
  // Validates every section against `registry` (loading only the plugins
  // the file selects). With `plugin_checks`, each plugin's validate hook is
  // run too on its section (when the schema is satisfied), its error placed
  // at the key it names or else at the section header: `ductile config
  // check` does this; a Runtime runs the hooks before creating an instance.
  // Throws ConfigError with all problems found.
  static Config validate(const ConfigDocument& document, const PluginRegistry& registry,
                         bool plugin_checks = false);

  const std::string& source_name() const { return source_name_; }
  const std::filesystem::path& base_dir() const { return base_dir_; }
  const std::vector<PluginSection>& plugin_sections() const { return sections_; }
  const PluginSection* section(PluginKind kind) const;
  // A validated host-only section ([log], [plugins], ...) by name.
  const Params* host_section(std::string_view name) const;

 private:
  std::string source_name_;
  std::filesystem::path base_dir_;
  std::vector<PluginSection> sections_;
  std::map<std::string, Params, std::less<>> host_;
};

// The one check of a parameter value against its schema entry, whatever edge
// converted it (TOML, JSON, Python keyword arguments, Params built in C++):
// type (an integer is accepted for a floating key and returned as a double),
// bounds, allowed strings. Returns the checked value, or nullopt with `error`
// set to "<what> = <value> is out of range: must be ..." or the like, where
// `what` names the key as the caller's user wrote it.
std::optional<ParamValue> check_param_value(const ParamSpec& spec, ParamValue value,
                                            const std::string& what, std::string& error);

// Validates `value` (a TOML value written as text, as in ParamSpec defaults)
// against one spec. Used for defaults and by tests. Throws Error(config).
ParamValue parse_param_literal(const ParamSpec& spec, std::string_view literal);

// "1.5", "[2, 4]", "\"seqlen\"": a value formatted as TOML.
std::string format_param_value(const ParamValue& value);

}  // namespace ductile::core
