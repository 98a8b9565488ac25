// Internals shared by registry.cpp (the search path) and plugin_file.cpp
// (one file).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "ductile/core/registry.hpp"
#include "ductile/plugin.hpp"

namespace ductile::core {

// Reads a file name (no directory) libductile_<kind>_<name>.so; false for
// any other file name.
bool parse_plugin_file_name(std::string_view file_name, PluginKind& kind, std::string& name);

// load_plugin_file() for a file of a plugin directory whose resolved path,
// `real_directory`, the registry found trusted: only the file itself is
// examined, unless it is a symbolic link.
PluginInfo load_plugin_file_in(const std::filesystem::path& file,
                               const std::filesystem::path& real_directory);

// An address range a loaded library maps (one of its PT_LOAD segments), all
// of it readable.
struct MappedRange {
  std::uintptr_t begin;
  std::uintptr_t end;
  bool executable;
};

// The readable ranges the library of `handle` (dlopen's) maps; empty when
// the handle is not known to the dynamic linker.
std::vector<MappedRange> mapped_ranges(void* handle);

// What can be checked of a descriptor without reading through a pointer
// that leads outside `ranges` (descriptor_memory.cpp): its ABI version
// first, then the whole descriptor and every pointer it holds (strings with
// their NUL, the schema and its allowed-value lists, the factory and
// validate hook, in code) lie inside them. Only for a descriptor of this ABI
// version; the rest is check_plugin_descriptor's. Throws Error(plugin)
// naming `file` and the field.
void check_descriptor_memory(const ductile_plugin_descriptor* descriptor,
                             const std::vector<MappedRange>& ranges,
                             const std::filesystem::path& file);

// "elasticity, batching, ...".
std::string plugin_kind_list();

// What follows every refusal by the trust rule.
inline constexpr std::string_view kTrustRule =
    "plugins are loaded only from files and directories that root or the caller owns and no one "
    "else can write (see 'Trust' in docs/architecture.md)";

}  // namespace ductile::core
