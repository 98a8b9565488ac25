// ductile demo [--config FILE]: the main job of ./run.sh. Shows the plugins,
// the validated configuration, and then each capability the config selects.
#include <iostream>

#include <fmt/format.h>

#include "cli_common.hpp"
#include "ductile/core/config.hpp"

namespace ductile::cli {
namespace {

struct DemoOptions {
  std::string config = "samples/configs/demo.toml";
};

int run_demo(const CliContext& context, const DemoOptions& options) {
  auto runtime = context.load_runtime(options.config);
  std::ostream& out = std::cout;
  out << "== ductile demo: " << options.config << " ==\n\n";
  out << "-- plugins --\n";
  for (const auto& p : runtime.registry().plugins())
    out << fmt::format("  {:<12} {:<12} {:<8} {}\n", to_string(p.kind), p.name, p.version,
                       p.description);
  out << "\n-- configuration (validated) --\n";
  for (const auto& section : runtime.config().plugin_sections()) {
    out << fmt::format("  [{}] -> {} plugin '{}'\n", section.section, to_string(section.kind),
                       section.plugin);
    for (const auto& [key, value] : section.params.values())
      out << fmt::format("      {} = {}\n", key, core::format_param_value(value));
    for (const auto& [key, value] : section.host_params.values())
      out << fmt::format("      {} = {}\n", key, core::format_param_value(value));
  }
  DemoContext demo{runtime, out};
  demo_elasticity(demo);
  demo_batching(demo);
  out << std::flush;
  return kExitOk;
}

}  // namespace

void register_demo_command(CLI::App& app, CliContext& context) {
  auto options = std::make_shared<DemoOptions>();
  auto* demo =
      app.add_subcommand("demo", "Run the framework on a configuration and show what it did");
  demo->add_option("--config", options->config, "TOML configuration file")->capture_default_str();
  set_action(demo, context, [&context, options] { return run_demo(context, *options); });
}

}  // namespace ductile::cli
