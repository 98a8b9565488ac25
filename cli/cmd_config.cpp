// ductile config check FILE
#include <cstdlib>
#include <iostream>

#include <fmt/format.h>

#include "cli_common.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/logging.hpp"

namespace ductile::cli {
namespace {

struct CheckOptions {
  std::string file;
  bool allow_config_plugins = false;
};

int check_config(const CliContext& context, const CheckOptions& options) {
  auto document = core::ConfigDocument::from_file(options.file);
  if (!context.log_level && !std::getenv("DUCTILE_LOG_LEVEL")) {
    if (auto level = document.log_level()) core::init_logging(*level);
  }
  // Every error a selected plugin can know from its parameters, with its position.
  auto runtime_options = context.runtime_options();
  runtime_options.plugin_checks = true;
  // Checking a file runs no code from the directories it names itself: a
  // bundle from elsewhere with `[plugins] path = ["."]` is only read.
  runtime_options.search_config_plugin_dirs = options.allow_config_plugins;
  runtime_options.config_dirs_note =
      "named by the file's [plugins] path; `ductile config check` loads no plugin from there "
      "unless given --allow-config-plugins";
  auto runtime = core::Runtime::from_document(document, runtime_options);
  const auto& config = runtime.config();
  std::cout << fmt::format("{}: valid\n", options.file);
  for (const auto& skipped : runtime.registry().skipped())
    std::cout << fmt::format("  not searched: '{}' ({})\n", skipped.directory.string(),
                             skipped.reason);
  for (const auto& section : config.plugin_sections()) {
    std::cout << fmt::format("  [{}] {} plugin '{}'\n", section.section, to_string(section.kind),
                             section.plugin);
    for (const auto& [key, value] : section.params.values())
      std::cout << fmt::format("    {} = {}\n", key, core::format_param_value(value));
    for (const auto& [key, value] : section.host_params.values())
      std::cout << fmt::format("    {} = {}\n", key, core::format_param_value(value));
  }
  return kExitOk;
}

}  // namespace

void register_config_command(CLI::App& app, CliContext& context) {
  auto options = std::make_shared<CheckOptions>();
  auto* config = app.add_subcommand("config", "Work with configuration files");
  config->require_subcommand(1);
  auto* check = config->add_subcommand(
      "check",
      "Validate a configuration file against the schemas of the plugins it selects "
      "(exit 0 if valid, 2 with every error otherwise)");
  check->add_option("FILE", options->file, "TOML configuration file")->required();
  check->add_flag("--allow-config-plugins", options->allow_config_plugins,
                  "Search the directories of the file's [plugins] path too, running the code of "
                  "the plugins found there (off: a file is checked without running code it "
                  "brings)");
  set_action(check, context, [&context, options] { return check_config(context, *options); });
}

}  // namespace ductile::cli
