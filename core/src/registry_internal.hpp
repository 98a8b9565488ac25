// Internals shared by registry.cpp (the search path) and plugin_file.cpp
// (one file).
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "ductile/core/registry.hpp"
#include "ductile/plugin.hpp"

namespace ductile::core {

// Reads libductile_<kind>_<name>.so; false for any other file name.
bool split_plugin_file_name(const std::filesystem::path& file, PluginKind& kind, std::string& name);
// The same for a file name alone (no directory).
bool parse_plugin_file_name(std::string_view file_name, PluginKind& kind, std::string& name);

// load_plugin_file() for a file of a plugin directory whose resolved path,
// `real_directory`, the registry found trusted: only the file itself is
// examined, unless it is a symbolic link.
PluginInfo load_plugin_file_in(const std::filesystem::path& file,
                               const std::filesystem::path& real_directory);

// "elasticity, batching, ...".
std::string plugin_kind_list();

// What follows every refusal by the trust rule.
inline constexpr std::string_view kTrustRule =
    "plugins are loaded only from files and directories that root or the caller owns and no one "
    "else can write (see 'Trust' in docs/architecture.md)";

}  // namespace ductile::core
