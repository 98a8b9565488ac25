// Shared by the libFuzzer targets of tests/fuzz: a quiet core, inputs
// written to temporary files for the readers that take paths, and the rule
// every target checks: hostile input may raise ductile::Error (a user error
// with a message), nothing else. Any other exception escapes
// LLVMFuzzerTestOneInput and libFuzzer reports it as a crash, as it does
// sanitizer reports and signals.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "ductile/core/logging.hpp"
#include "ductile/error.hpp"

namespace fuzz {

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Logging off once (plugins log warnings for valid but odd inputs).
inline void quiet_logging() {
  static const bool done = [] {
    ductile::core::init_logging("off");
    return true;
  }();
  (void)done;
}

// A directory of this process's own for input files, removed at exit.
inline const std::filesystem::path& scratch_dir() {
  static const struct Dir {
    std::filesystem::path path;
    Dir() {
      path =
          std::filesystem::temp_directory_path() / ("ductile_fuzz_" + std::to_string(::getpid()));
      std::filesystem::create_directories(path);
    }
    ~Dir() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  } dir;
  return dir.path;
}

// Writes bytes to scratch_dir()/name and returns the path.
inline std::filesystem::path write_file(const std::string& name, std::string_view bytes) {
  const auto path = scratch_dir() / name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

// Runs `f`; a ductile::Error is the expected answer to bad input, but it
// must carry a message.
template <class F>
void expect_clean(F&& f) {
  try {
    f();
  } catch (const ductile::Error& e) {
    if (std::string_view(e.what()).empty()) __builtin_trap();
  }
}

// Runs `f`; an exception of type `Allowed` (with a message) is the expected
// answer to bad input, any other escapes to libFuzzer as a finding.
template <class Allowed, class F>
void expect_only(F&& f) {
  try {
    f();
  } catch (const Allowed& e) {
    if (std::string_view(e.what()).empty()) __builtin_trap();
  }
}

}  // namespace fuzz
