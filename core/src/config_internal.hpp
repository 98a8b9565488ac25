// Internals shared by the configuration sources of the core.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <toml++/toml.h>

#include "ductile/core/config.hpp"

namespace ductile::core {

struct ConfigDocument::Impl {
  std::string source_name;
  std::filesystem::path base_dir;
  toml::table root;
  // A document read from another format (from_entries): its sections, in
  // the order given; `root` is then empty.
  std::vector<ConfigEntry> entries;
};

SourcePosition position_of(const std::string& file, const toml::source_region& region);

// The problems of a file as they are found, kept few: the first
// kMaxConfigDiagnostics in file order and a count of the others, so that a
// file of a million bad keys costs neither the memory nor the time of a
// million messages (config_validation.cpp).
class Problems {
 public:
  // Whether a problem at `where` may be among the first in file order (when
  // not, it is counted and its message need not be made).
  bool wanted(const SourcePosition& where);
  void add(Diagnostic diagnostic);
  // Every problem found so far, the uncounted ones included.
  std::size_t count() const { return list_.size() + dropped_; }
  // In file order; throws a ConfigError when there is any.
  void throw_if_any();

 private:
  std::vector<Diagnostic> list_;
  std::size_t dropped_ = 0;
  bool full_ = false;  // list_ was cut to the first ones: `last_` is the latest kept
  SourcePosition last_;
};

// The checks of [plugins] beyond its keys' types: each override_builtin
// entry is "kind/name" with a known kind.
void check_plugins_section(const toml::table& plugins, const std::string& file, Problems& errors);

// TOML's name of a node's type ("integer", "array", ...), and a bounded
// rendering of its value for messages (toml_values.cpp).
const char* toml_type_name(const toml::node& node);
std::string show(const toml::node& node);

// A string key's allowed values (empty: any string), as a list (param_values.cpp).
std::vector<std::string> allowed_list(const ParamSpec& spec);

// The TOML edge: a node converted to the type `spec` declares, then checked
// by check_param_value. Returns nullopt with `error` set ("<what> ...").
std::optional<ParamValue> convert_node(const toml::node& node, const ParamSpec& spec,
                                       const std::string& what, std::string& error);

}  // namespace ductile::core
