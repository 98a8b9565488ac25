// Internals of config.cpp shared with runtime.cpp.
#pragma once

#include <optional>
#include <string>

#include <toml++/toml.h>

#include "ductile/core/config.hpp"

namespace ductile::core {

SourcePosition position_of(const std::string& file, const toml::source_region& region);

std::optional<ParamValue> convert_node(const toml::node& node, const ParamSpec& spec,
                                       const std::string& what, std::string& error);

}  // namespace ductile::core
