// Internals shared by registry.cpp (the search path) and plugin_file.cpp
// (one file).
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "ductile/plugin.hpp"

namespace ductile::core {

// Reads libductile_<kind>_<name>.so; false for any other file name.
bool split_plugin_file_name(const std::filesystem::path& file, PluginKind& kind, std::string& name);

// "elasticity, batching, ...".
std::string plugin_kind_list();

// What follows every refusal by the trust rule.
inline constexpr std::string_view kTrustRule =
    "plugins are loaded only from files and directories that root or the caller owns and no one "
    "else can write (see 'Trust' in docs/architecture.md)";

}  // namespace ductile::core
