// Open MPI is loaded only when a process asks for an MPI world
// (accelerators/common/mpi_library.cpp): a single-process world never loads
// libmpi, and without the library an MPI world fails saying what to
// install. Each case runs in a process of its own (ctest), without mpirun
// (the MPI suites load it under mpirun).
#include <dlfcn.h>
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

#include "ductile/accelerator.hpp"
#include "ductile/core/runtime.hpp"

namespace {

ductile::core::Runtime cpu_runtime(const char* communicator) {
  return ductile::core::Runtime::from_string(
      std::string("[plugins]\npath = [\"") + DUCTILE_PLUGIN_DIR +
          "\"]\n[accelerator]\nbackend = \"cpu\"\ntimeout = 60\ncommunicator = \"" + communicator +
          "\"\n",
      "mpi_library.toml");
}

bool libmpi_loaded() {
  void* handle = dlopen("libmpi.so.40", RTLD_NOW | RTLD_NOLOAD);
  if (handle != nullptr) dlclose(handle);
  return handle != nullptr;
}

}  // namespace

TEST_CASE("a single-process world does not load Open MPI") {
  REQUIRE_FALSE(libmpi_loaded());
  auto runtime = cpu_runtime("auto");
  auto accel = runtime.get<ductile::Accelerator>();
  auto world = accel->world();
  CHECK(world->size() == 1);
  CHECK_FALSE(libmpi_loaded());
}

TEST_CASE("an MPI world without Open MPI says what to install") {
  REQUIRE(setenv("DUCTILE_MPI_LIBRARY", "libmpi-absent.so.40", 1) == 0);
  auto runtime = cpu_runtime("mpi");
  auto accel = runtime.get<ductile::Accelerator>();
  try {
    accel->world();
    FAIL("world() succeeded without libmpi");
  } catch (const ductile::Error& error) {
    std::string message = error.what();
    INFO(message);
    CHECK(message.find("libmpi-absent.so.40 could not be loaded") != std::string::npos);
    CHECK(message.find("Install Open MPI") != std::string::npos);
    CHECK(message.find("communicator = \"local\"") != std::string::npos);
    CHECK(error.kind() == ductile::ErrorKind::unsupported);
  }
  CHECK_FALSE(libmpi_loaded());
}
