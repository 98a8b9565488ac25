#include "cli_app.hpp"

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "ductile/core/logging.hpp"
#include "ductile/core/text.hpp"
#include "ductile/version.hpp"

namespace ductile::cli {
namespace {

// The global options that take a value in the next word.
bool takes_value(std::string_view arg) {
  return arg == "--log-level" || arg == "--plugin-path";
}

std::string version_text() {
  return std::string("ductile " DUCTILE_VERSION " (SDK " DUCTILE_SDK_VERSION_STRING ", ABI ") +
         std::to_string(DUCTILE_ABI_VERSION) + ", " DUCTILE_BUILD_TAG ")";
}

void add_global_options(CLI::App& app, CliContext& context) {
  app.set_version_flag("--version", version_text());
  app.require_subcommand(1);
  app.fallthrough();
  app.add_option_function<std::string>(
         "--log-level", [&](const std::string& v) { context.log_level = v; },
         "trace, debug, info, warn, error, critical or off (default: $DUCTILE_LOG_LEVEL or info)")
      ->type_name("LEVEL");
  app.add_option("--plugin-path", context.plugin_dirs,
                 "Directory searched for plugins before all others (repeatable)")
      ->type_name("DIR");
}

// `ductile --version` (with global options at most): nothing to list.
bool asks_only_version(int argc, char** argv) {
  bool version = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") return false;
    version |= arg == "--version";
  }
  return version;
}

}  // namespace

std::optional<std::string_view> command_word(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (takes_value(arg)) {
      ++i;
      continue;
    }
    if (arg.starts_with("-")) continue;
    return arg;
  }
  return std::nullopt;
}

int run_cli(int argc, char** argv, std::span<const Command> commands) {
  // `ductile --version` alone prints what CLI11 would, without the exception
  // it reports the version with (the first exception loads the unwinder).
  if (argc == 2 && std::string_view(argv[1]) == "--version") {
    std::fputs((version_text() + "\n").c_str(), stdout);
    return kExitOk;
  }
  CliContext context;
  return run_guarded(
      [&]() -> int {
        CLI::App app{"ductile: elastic, dynamically batched, sharded deep-learning training"};
        app.name("ductile");
        add_global_options(app, context);
        const auto word = command_word(argc, argv);
        const Command* named = nullptr;
        for (const auto& command : commands)
          if (word && command.name == *word) named = &command;
        if (named) {
          named->add(app, context);
        } else if (word || !asks_only_version(argc, argv)) {
          for (const auto& command : commands) command.add(app, context);
        }
        try {
          app.parse(argc, argv);
        } catch (const CLI::Success& e) {
          return app.exit(e);
        } catch (const CLI::ParseError& e) {
          if (word && !named) {
            std::vector<std::string> names;
            for (const auto& command : commands) names.emplace_back(command.name);
            std::cerr << "ductile: error: unknown command '" << *word << "'"
                      << core::did_you_mean(*word, names) << "; commands: " << core::join(names)
                      << "\nRun 'ductile --help' for more information.\n";
            return kExitUserError;
          }
          app.exit(e);
          return kExitUserError;
        }
        core::init_logging(context.log_level);
        if (!context.action) return kExitUserError;
        return run_guarded(context.action, context.json);
      },
      nullptr);
}

}  // namespace ductile::cli
