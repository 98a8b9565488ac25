// The command line of a ductile program: the global options, the commands it
// offers, parsing, and the exit-code policy. `ductile` and its agent program
// (lib/ductile/ductile-agent, see main.cpp) both run through run_cli().
#pragma once

#include <optional>
#include <span>
#include <string_view>

#include "cli_common.hpp"

namespace ductile::cli {

// One command of a program: its name on the command line and the function
// that adds it (its options and action) to the application.
struct Command {
  std::string_view name;
  void (*add)(CLI::App& app, CliContext& context);
};

// The first word of the command line that is not a global option or a
// global option's value: the command the user asked for (it may be no
// command at all, or a misspelt one). nullopt when there is none.
std::optional<std::string_view> command_word(int argc, char** argv);

// Parses the command line and runs the selected command. Only the command
// the command line names is added to the parser: building the options of
// every command costs more than the rest of a quick command's start-up. All
// of them are added when the line names none of them (`ductile --help`, a
// misspelt command), so that help and errors list every command.
// Returns the process's exit code (0 ok, 2 user error, 1 bug).
int run_cli(int argc, char** argv, std::span<const Command> commands);

}  // namespace ductile::cli
