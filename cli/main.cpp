// ductile: the command-line interface.
//
// `ductile agent` runs in a program of its own, lib/ductile/ductile-agent,
// which this one executes in its place (same process id, same arguments).
// The agent links libductile_agent (and through it libcurl) and the shared
// core; `ductile` itself carries the core, the pipeline and the C++ runtime
// in the program (DUCTILE_STATIC_RUNTIME), so that a quick command starts in
// about the time of an empty C++ program. An agent loaded into this process
// would bring a second core, with its own logging and plugin registry.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "agent_command.hpp"
#include "cli_app.hpp"

namespace {

using namespace ductile::cli;

// The agent program: DUCTILE_AGENT_PROGRAM is its path relative to the
// directory of this one, the same in the build tree and an install prefix
// (bin/ductile, lib/ductile/ductile-agent).
std::filesystem::path agent_program() {
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return DUCTILE_AGENT_PROGRAM;
  return (self.parent_path() / DUCTILE_AGENT_PROGRAM).lexically_normal();
}

// Replaces this process with the agent program, passing the command line
// unchanged. Returns only when it cannot be executed.
int exec_agent(char** argv) {
  const std::filesystem::path program = agent_program();
  ::execv(program.c_str(), argv);
  const int error = errno;
  std::cerr << "ductile: internal error: cannot run the agent program '" << program.string()
            << "': " << std::strerror(error) << "; is ductile installed completely?\n";
  return kExitBug;
}

// `ductile --help` lists the agent with the description its own program
// gives it; the command itself never runs here.
void add_agent_entry(CLI::App& app, CliContext&) {
  app.add_subcommand("agent", kAgentDescription);
}

constexpr Command kCommands[] = {
    {"plugins", register_plugins_command},
    {"config", register_config_command},
    {"demo", register_demo_command},
    {"elastic", register_elastic_command},
    {"pack", register_pack_command},
    {"zero", register_zero_command},
    {"zero-to-fp32", register_zero_to_fp32_command},
    {"agent", add_agent_entry},
};

}  // namespace

int main(int argc, char** argv) {
  if (command_word(argc, argv) == "agent") return exec_agent(argv);
  const int code = run_cli(argc, argv, kCommands);
  std::cout.flush();
  return code;
}
