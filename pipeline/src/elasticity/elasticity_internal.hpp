// Shared by the elasticity sources of the pipeline (not installed).
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ductile/core/registry.hpp"
#include "ductile/pipeline/elasticity.hpp"

namespace ductile::pipeline::detail {

// Throws ductile::Error typed ElasticityConfigError (ErrorKind::config).
[[noreturn]] void elasticity_config_error(const std::string& message);

// A registry on the default search path, for the overloads given none.
core::PluginRegistry default_registry();

// Whether a JSON object is an elasticity block given alone (the form the
// scheduler's copy takes) rather than a whole config.
bool looks_like_block(const nlohmann::json& object);

// The elasticity block of a parsed DeepSpeed config (`root` an object: a
// whole config or the block itself), typed by its policy's schema; nullopt
// when it has none. Throws as elasticity_from_deepspeed_json does.
std::optional<ElasticitySource> elasticity_of_deepspeed(const nlohmann::json& root,
                                                        std::string_view origin,
                                                        const core::PluginRegistry& registry);

}  // namespace ductile::pipeline::detail
