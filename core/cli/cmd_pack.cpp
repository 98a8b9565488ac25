// ductile pack: placeholder until its issue lands (registers nothing yet).
#include "cli_common.hpp"

namespace ductile::cli {

void register_pack_command(CLI::App&, CliContext&) {}

void demo_batching(DemoContext&) {}

}  // namespace ductile::cli
