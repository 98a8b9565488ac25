// Started by join_test.cpp without mpirun, as `ductile agent` starts workers
// (RANK, WORLD_SIZE, DUCTILE_MPI_JOIN in the environment): makes the cpu
// accelerator's world, all-reduces rank + 1 and prints
//   rank R of N: sum S
// or, on a ductile::Error, "error: MESSAGE" and exits 2.
#include <cstdio>
#include <string>

#include "ductile/accelerator.hpp"
#include "ductile/core/runtime.hpp"

int main() {
  try {
    std::string config = std::string("[plugins]\npath = [\"") + DUCTILE_PLUGIN_DIR +
                         "\"]\n[accelerator]\nbackend = \"cpu\"\ntimeout = 120\n";
    auto runtime = ductile::core::Runtime::from_string(config, "join.toml");
    auto accel = runtime.get<ductile::Accelerator>();
    auto world = accel->world();
    auto stream = accel->create_stream();
    std::int64_t value = world->rank() + 1, sum = 0;
    world->all_reduce(&value, &sum, 1, ductile::DataType::i64, ductile::ReduceOp::sum, *stream)
        ->wait();
    std::printf("rank %d of %d: sum %lld\n", world->rank(), world->size(),
                static_cast<long long>(sum));
    return 0;
  } catch (const ductile::Error& e) {
    std::printf("error: %s\n", e.what());
    return 2;
  }
}
