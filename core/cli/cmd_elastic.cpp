// ductile elastic: placeholder until its issue lands (registers nothing yet).
#include "cli_common.hpp"

namespace ductile::cli {

void register_elastic_command(CLI::App&, CliContext&) {}

void demo_elasticity(DemoContext&) {}

}  // namespace ductile::cli
