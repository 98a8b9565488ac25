// ductile zero: placeholder until its issue lands (registers nothing yet).
#include "cli_common.hpp"

namespace ductile::cli {

void register_zero_command(CLI::App&, CliContext&) {}

}  // namespace ductile::cli
