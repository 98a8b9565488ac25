// ductile config check FILE
#include <cstdlib>
#include <iostream>
#include <optional>

#include <fmt/format.h>

#include "cli_common.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/files.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/elasticity_policy.hpp"
#include "ductile/pipeline/deepspeed_config.hpp"
#include "ductile/pipeline/elasticity.hpp"
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
  // DeepSpeedConfig's rules for an elasticity block beside the batch keys
  // (the world size aside: that is `ductile elastic --world-size`'s), checked
  // once the mapping has reported its own errors, every one of them.
  std::optional<nlohmann::json> root;
  std::string mapped_text = text;
  if (deepspeed) {
    root = pipeline::parse_bounded_json(text, options.file, "invalid JSON", ErrorKind::config,
                                        kElasticityConfigError);
    // DeepSpeed never reads a disabled block: neither is it mapped here.
    if (root->is_object() && root->contains("elasticity")) {
      const auto& block = root->at("elasticity");
      const auto enabled = block.is_object() ? block.find("enabled") : block.end();
      if (block.is_object() &&
          (enabled == block.end() || (enabled->is_boolean() && !enabled->get<bool>()))) {
        auto without = *root;
        without.erase("elasticity");
        mapped_text = without.dump();
      }
    }
  }
  // A DeepSpeed JSON config is mapped onto ductile's sections, each checked
  // as a TOML file's would be, naming the user's keys; its dynamic batching
  // block too, when it has one (as `ductile pack` reads it); and its training
  // keys by the rules ductile.deepspeed.initialize reads them with.
  auto runtime = deepspeed ? pipeline::runtime_from_deepspeed_file(
                                 options.file, mapped_text, runtime_options,
                                 {.check_training = true, .read_batching = true}, &warnings)
                           : core::Runtime::from_document(*document, runtime_options);
  std::optional<pipeline::DeepSpeedElasticityMode> mode;
  if (root) {
    mode = pipeline::deepspeed_elasticity_mode(*root, options.file);
    warnings.insert(warnings.end(), mode->warnings.begin(), mode->warnings.end());
  }
  const auto& config = runtime.config();
  // The resource scheduler's copy must match an elastic job's, as DeepSpeed
  // requires when it starts one (silent when the scheduler passed none).
  const core::PluginSection* elasticity = config.section(PluginKind::elasticity);
  if (elasticity && (!mode || mode->elastic))
    pipeline::check_scheduler_elasticity(
        pipeline::fingerprint_of(elasticity->plugin, elasticity->params), nullptr,
        runtime.registry());
  std::cout << fmt::format("{}: valid{}\n", options.file, deepspeed ? " (DeepSpeed JSON)" : "");
  for (const auto& w : warnings) std::cout << fmt::format("  warning: {}\n", w);
  if (mode && mode->has_block && !mode->elastic) {
    const auto& k = mode->batch;
    std::cout << "  elasticity disabled: a non-elastic job; DeepSpeed takes its batch from";
    if (k.train_batch_size) std::cout << fmt::format(" train_batch_size = {}", *k.train_batch_size);
    if (k.micro_batch_per_gpu)
      std::cout << fmt::format(" train_micro_batch_size_per_gpu = {}", *k.micro_batch_per_gpu);
    if (k.gradient_accumulation_steps)
      std::cout << fmt::format(" gradient_accumulation_steps = {}", *k.gradient_accumulation_steps);
    for (const auto& key : k.automatic) std::cout << fmt::format(" {} = \"auto\"", key);
    std::cout << "\n";
  }
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
