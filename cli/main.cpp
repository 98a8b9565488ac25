// ductile: the command-line interface.
#include <iostream>
#include <optional>

#include "cli_common.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/core/text.hpp"
#include "ductile/version.hpp"

namespace {

// The first word on the command line that should have been a command but is
// not one (global options and their values skipped).
std::optional<std::string> unknown_command(CLI::App& app, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--log-level" || arg == "--plugin-path") {
      ++i;
      continue;
    }
    if (arg.starts_with("-")) continue;
    for (const auto* sub : app.get_subcommands({}))
      if (sub->get_name() == arg) return std::nullopt;
    return arg;
  }
  return std::nullopt;
}

}  // namespace

namespace ductile::cli {
void register_agent_command(CLI::App& app, CliContext& context);
}

int main(int argc, char** argv) {
  using namespace ductile::cli;
  CliContext context;
  int code = run_guarded(
      [&]() -> int {
        CLI::App app{"ductile: elastic, dynamically batched, sharded deep-learning training"};
        app.name("ductile");
        app.set_version_flag(
            "--version",
            std::string("ductile " DUCTILE_VERSION " (SDK " DUCTILE_SDK_VERSION_STRING ", ABI ") +
                std::to_string(DUCTILE_ABI_MAJOR) + "." + std::to_string(DUCTILE_ABI_MINOR) +
                ", " DUCTILE_BUILD_TAG ")");
        app.require_subcommand(1);
        app.fallthrough();
        app.add_option_function<std::string>(
               "--log-level", [&](const std::string& v) { context.log_level = v; },
               "trace, debug, info, warn, error, critical or off (default: $DUCTILE_LOG_LEVEL or "
               "info)")
            ->type_name("LEVEL");
        app.add_option("--plugin-path", context.plugin_dirs,
                       "Directory searched for plugins before all others (repeatable)")
            ->type_name("DIR");
        register_plugins_command(app, context);
        register_config_command(app, context);
        register_demo_command(app, context);
        register_elastic_command(app, context);
        register_pack_command(app, context);
        register_zero_command(app, context);
        register_agent_command(app, context);
        try {
          app.parse(argc, argv);
        } catch (const CLI::Success& e) {
          return app.exit(e);
        } catch (const CLI::ParseError& e) {
          if (auto unknown = unknown_command(app, argc, argv)) {
            std::vector<std::string> names;
            for (const auto* sub : app.get_subcommands({})) names.push_back(sub->get_name());
            std::cerr << "ductile: error: unknown command '" << *unknown << "'"
                      << ductile::core::did_you_mean(*unknown, names)
                      << "; commands: " << ductile::core::join(names)
                      << "\nRun 'ductile --help' for more information.\n";
            return kExitUserError;
          }
          app.exit(e);
          return kExitUserError;
        }
        ductile::core::init_logging(context.log_level);
        if (!context.action) return kExitUserError;
        return run_guarded(context.action, context.json);
      },
      nullptr);
  std::cout.flush();
  return code;
}
