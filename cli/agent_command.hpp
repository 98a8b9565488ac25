// `ductile agent`: registered by the agent program (agent_main.cpp, with
// cmd_agent.cpp) and listed by `ductile --help` (main.cpp), which runs that
// program in its place.
#pragma once

#include "cli_common.hpp"

namespace ductile::cli {

inline constexpr const char* kAgentDescription =
    "Run this node's workers as part of an elastic job: rendezvous on etcd or torchrun's c10d, "
    "static or standalone, world sizes chosen by the configuration's elasticity policy, "
    "restarts on membership changes and failures. Takes any torchrun command line (program "
    "name changed)";

void register_agent_command(CLI::App& app, CliContext& context);

}  // namespace ductile::cli
