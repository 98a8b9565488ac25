// DeepSpeed's dynamic batching read as ductile's [batching] and [lr]
// sections: the one mapping (deepspeed_config.hpp, require_batching), the
// sections validated as a TOML file's, the packing options taken from them
// as from a TOML file's (pack_setup_from_config).
#include "ductile/pipeline/deepspeed_batching.hpp"

#include "ductile/core/config.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/pipeline/deepspeed_config.hpp"
#include "ductile/pipeline/pack_plan.hpp"

namespace ductile::pipeline {

DeepSpeedBatching parse_deepspeed_batching(std::string_view text, std::string_view source,
                                           const std::filesystem::path& base_dir) {
  const core::PluginRegistry registry(core::PluginRegistry::default_search_path(), nullptr);
  return parse_deepspeed_batching(text, source, base_dir, registry);
}

DeepSpeedBatching parse_deepspeed_batching(std::string_view text, std::string_view source,
                                           const std::filesystem::path& base_dir,
                                           const core::PluginRegistry& registry) {
  auto mapped = deepspeed_sections(text, source, base_dir, registry, {.require_batching = true});
  const auto config = core::Config::validate(mapped.document, registry, /*plugin_checks=*/true);
  DeepSpeedBatching out{mapped.batching_enabled, pack_setup_from_config(config)};
  try {
    check_lr_schedule(out.setup.options.schedule);
  } catch (const Error& e) {
    throw Error(ErrorKind::config, std::string(source) + ": scheduler: " + e.what());
  }
  return out;
}

}  // namespace ductile::pipeline
