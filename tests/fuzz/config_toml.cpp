// Fuzz target: a ductile TOML configuration, parsed and validated against
// the schemas of the built-in plugins (as `ductile config check` does), and
// the scheduler's schema-free reading of its [elasticity] section.
#include <cstdint>

#include "ductile/core/config.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "fuzz_support.hpp"

namespace {

const ductile::core::PluginRegistry& registry() {
  // Scanned once: the plugins built next to the core (DUCTILE_PLUGIN_DIR).
  static const ductile::core::PluginRegistry instance(
      ductile::core::PluginRegistry::default_search_path(), ductile::core::logger());
  return instance;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::quiet_logging();
  const auto text = fuzz::as_text(data, size);
  fuzz::expect_clean([&] {
    auto document = ductile::core::ConfigDocument::from_string(text, "fuzz.toml", "/fuzz-base");
    fuzz::expect_clean([&] { (void)document.plugin_dirs(); });
    fuzz::expect_clean([&] { (void)document.log_level(); });
    auto config = ductile::core::Config::validate(document, registry());
    for (const auto& section : config.plugin_sections())
      for (const auto& [key, value] : section.params.values())
        (void)ductile::core::format_param_value(value);
  });
  fuzz::expect_clean(
      [&] { (void)ductile::pipeline::elasticity_from_toml_text(text, "fuzz.toml"); });
  return 0;
}
