// Internals of config.cpp shared with runtime.cpp and plugins_section.cpp.
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
};

SourcePosition position_of(const std::string& file, const toml::source_region& region);

// The checks of [plugins] beyond its keys' types: each override_builtin
// entry is "kind/name" with a known kind.
void check_plugins_section(const toml::table& plugins, const std::string& file,
                           std::vector<Diagnostic>& errors);

std::optional<ParamValue> convert_node(const toml::node& node, const ParamSpec& spec,
                                       const std::string& what, std::string& error);

}  // namespace ductile::core
