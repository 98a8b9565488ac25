// ductile config check FILE
#include <cstdlib>
#include <iostream>
#include <optional>

#include <fmt/format.h>

#include "cli_common.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/files.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/pipeline/deepspeed_config.hpp"
#include "ductile/pipeline/json.hpp"

namespace ductile::cli {
namespace {

struct CheckOptions {
  std::string file;
  bool allow_config_plugins = false;
};

int check_config(const CliContext& context, const CheckOptions& options) {
  const std::string text = core::read_user_file(options.file, "configuration file");
  const bool deepspeed = pipeline::is_json_config(options.file, text);
  std::optional<core::ConfigDocument> document;
  if (!deepspeed) {
    document.emplace(core::ConfigDocument::from_file_text(options.file, text));
    if (!context.log_level && !std::getenv("DUCTILE_LOG_LEVEL")) {
      if (auto level = document->log_level()) core::init_logging(*level);
    }
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
  std::vector<std::string> warnings;
  // A DeepSpeed JSON config is mapped onto ductile's sections, each checked
  // as a TOML file's would be, naming the user's keys; its dynamic batching
  // block too, when it has one (as `ductile pack` reads it).
  auto runtime = deepspeed
                     ? pipeline::runtime_from_deepspeed_file(options.file, text, runtime_options,
                                                             {.read_batching = true}, &warnings)
                     : core::Runtime::from_document(*document, runtime_options);
  const auto& config = runtime.config();
  std::cout << fmt::format("{}: valid{}\n", options.file, deepspeed ? " (DeepSpeed JSON)" : "");
  for (const auto& w : warnings) std::cout << fmt::format("  warning: {}\n", w);
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
  check
      ->add_option("FILE", options->file,
                   "ductile TOML configuration, or a DeepSpeed JSON config (chosen by "
                   "extension, else by content)")
      ->required();
  check->add_flag("--allow-config-plugins", options->allow_config_plugins,
                  "Search the directories of the file's [plugins] path too, running the code of "
                  "the plugins found there (off: a file is checked without running code it "
                  "brings)");
  set_action(check, context, [&context, options] { return check_config(context, *options); });
}

}  // namespace ductile::cli
