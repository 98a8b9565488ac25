// lib/ductile/ductile-agent: the program `ductile agent` runs (see main.cpp).
// It takes the whole `ductile` command line, global options included, and
// offers the agent command only.
#include <iostream>

#include "agent_command.hpp"
#include "cli_app.hpp"

int main(int argc, char** argv) {
  using namespace ductile::cli;
  constexpr Command kCommands[] = {{"agent", register_agent_command}};
  const int code = run_cli(argc, argv, kCommands);
  std::cout.flush();
  return code;
}
