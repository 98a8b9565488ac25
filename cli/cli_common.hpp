// Shared plumbing of the `ductile` subcommands: global options, loading a
// runtime, running a command with the exit-code policy (0 ok, 2 user error,
// 1 internal error) and machine-readable errors.
#pragma once

#include <filesystem>
#include <functional>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "ductile/core/registry.hpp"
#include "ductile/core/runtime.hpp"

namespace ductile::cli {

constexpr int kExitOk = 0;
constexpr int kExitBug = 1;
constexpr int kExitUserError = 2;

struct CliContext {
  std::optional<std::string> log_level;
  std::vector<std::string> plugin_dirs;  // --plugin-path, searched first

  // Set by the selected subcommand's callback; run by main().
  std::function<int()> action;
  // When the selected command was given --json, errors go to stdout as
  // {"error": {"type", "message"}}.
  const bool* json = nullptr;

  core::PluginRegistry make_registry(
      const std::vector<std::filesystem::path>& config_dirs = {}) const;
  core::Runtime load_runtime(const std::filesystem::path& config_file) const;
  // The same for a configuration file the command has read already.
  core::Runtime load_runtime(const core::ConfigDocument& document) const;
  core::RuntimeOptions runtime_options() const;
};

// Registers `command` as the action of `sub` (run after parsing succeeds).
void set_action(CLI::App* sub, CliContext& context, std::function<int()> command,
                const bool* json = nullptr);

// Error type name for JSON output: Error::type() or a name derived from the kind.
std::string error_type_name(const std::exception& e);

// Prints {"error": {"type", "message"}} and a newline.
void print_json_error(std::ostream& out, const std::string& type, const std::string& message);

// Runs `body`, mapping exceptions to exit codes and messages.
int run_guarded(const std::function<int()>& body, const bool* json);

// Subcommand registration, one per file in cli/.
void register_plugins_command(CLI::App& app, CliContext& context);
void register_config_command(CLI::App& app, CliContext& context);
void register_demo_command(CLI::App& app, CliContext& context);
void register_elastic_command(CLI::App& app, CliContext& context);
void register_pack_command(CLI::App& app, CliContext& context);
void register_zero_command(CLI::App& app, CliContext& context);
void register_zero_to_fp32_command(CLI::App& app, CliContext& context);

// Parts of `ductile demo`, one per capability; each prints what it did to
// `out`. A part for a kind the config does not select prints nothing.
struct DemoContext {
  core::Runtime& runtime;
  std::ostream& out;
};
void demo_elasticity(DemoContext& demo);
void demo_batching(DemoContext& demo);

}  // namespace ductile::cli
