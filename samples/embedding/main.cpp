// A training framework's view of ductile: load the job's configuration and use
// the learning-rate rule it selects, without the CLI.
//
//   embed job.toml base_lr base_batch batch...
#include <cstdlib>
#include <iostream>
#include <string>

#include <ductile/core/logging.hpp>
#include <ductile/core/runtime.hpp>
#include <ductile/lr_scaling_rule.hpp>

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: embed CONFIG BASE_LR BASE_BATCH BATCH...\n";
    return 2;
  }
  try {
    ductile::core::init_logging("warn");
    auto runtime = ductile::core::Runtime::from_file(argv[1]);
    auto rule = runtime.get<ductile::LrScalingRule>();
    const double base_lr = std::stod(argv[2]);
    const double base_batch = std::stod(argv[3]);
    for (int i = 4; i < argc; ++i) {
      double batch = std::stod(argv[i]);
      std::cout << batch << " " << rule->scale(base_lr, batch, base_batch) << "\n";
    }
    return 0;
  } catch (const ductile::Error& e) {
    std::cerr << "embed: " << e.what() << "\n";
    return e.is_user_error() ? 2 : 1;
  } catch (const std::exception& e) {
    std::cerr << "embed: " << e.what() << "\n";
    return 2;
  }
}
