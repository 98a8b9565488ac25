// Creating a device backend: on a machine with the device it works and
// reports it; without one (as in CI here) it fails with a clear error naming
// the backend and what is missing, and the device suite skips with it.
#include <doctest/doctest.h>

#include <string>

#include "ductile/accelerator.hpp"
#include "ductile/core/runtime.hpp"

TEST_CASE("creating the " DUCTILE_TEST_BACKEND " accelerator works or fails with a clear error") {
  auto runtime = ductile::core::Runtime::from_string(
      std::string("[plugins]\npath = [\"") + DUCTILE_PLUGIN_DIR +
          "\"]\n[accelerator]\nbackend = \"" DUCTILE_TEST_BACKEND "\"\n",
      "device.toml");
  // The plugin itself loads (it was built and links), whatever the machine.
  CHECK_NOTHROW(runtime.registry().find(ductile::PluginKind::accelerator, DUCTILE_TEST_BACKEND));
  try {
    auto accel = runtime.get<ductile::Accelerator>();
    MESSAGE("a " DUCTILE_TEST_BACKEND " device is present: " << accel->device_info(0).name);
    CHECK(accel->backend() == DUCTILE_TEST_BACKEND);
    CHECK(accel->device_count() >= 1);
  } catch (const ductile::Error& error) {
    std::string message = error.what();
    INFO(message);
    CHECK(message.find(DUCTILE_TEST_BACKEND " accelerator") != std::string::npos);
    CHECK(message.find(DUCTILE_EXPECTED_REASON) != std::string::npos);
    CHECK(error.is_user_error());
  }
}
