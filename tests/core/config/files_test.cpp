// core::read_user_file, the one reader of the files a user names (the CLI's
// and, through the binding, Python's): a FIFO refused without waiting for a
// writer, a device never read, a file over the cap refused unread, each
// error naming the file and what would be valid.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include "ductile/core/files.hpp"
#include "ductile/error.hpp"
#include "temp_dir.hpp"

using ductile::Error;
using ductile::ErrorKind;
using ductile::core::read_user_file;

namespace {

Error error_of(const std::filesystem::path& file, std::uintmax_t cap = 1024) {
  try {
    read_user_file(file, "configuration file", cap);
  } catch (const Error& e) {
    return e;
  }
  FAIL("no error");
  return Error(ErrorKind::internal, "unreachable");
}

}  // namespace

TEST_CASE("read_user_file: a regular file within the cap is read whole") {
  ductile::test::TempDir dir;
  const auto file = dir.write("a.json", "{\"train_batch_size\": 8}");
  CHECK(read_user_file(file, "configuration file", 1024) == "{\"train_batch_size\": 8}");
  const auto exact = dir.write("exact.toml", std::string(1024, 'x'));
  CHECK(read_user_file(exact, "configuration file", 1024).size() == 1024);
}

TEST_CASE("read_user_file: FIFO, device, directory, oversized and missing files are refused") {
  ductile::test::TempDir dir;
  const auto fifo = dir.path() / "fifo.json";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // A blocking open would wait here for a writer that never comes.
  Error at_fifo = error_of(fifo);
  CHECK(at_fifo.kind() == ErrorKind::io);
  CHECK(std::string(at_fifo.what()) ==
        fifo.string() + ": is a FIFO, not a regular file; give a regular configuration file");

  CHECK(std::string(error_of("/dev/zero").what()) ==
        "/dev/zero: is a character device, not a regular file; give a regular configuration "
        "file");
  CHECK(std::string(error_of(dir.path()).what()) ==
        dir.path().string() +
            ": is a directory, not a regular file; give a regular configuration file");

  const auto big = dir.path() / "big.json";
  { std::ofstream out(big, std::ios::binary); }
  std::filesystem::resize_file(big, 1025);
  CHECK(std::string(error_of(big).what()) ==
        big.string() + ": is 1025 bytes, over the 1024 bytes cap of a configuration file");
  std::filesystem::resize_file(big, (std::uintmax_t{16} << 20) + 1);
  CHECK(std::string(error_of(big, ductile::core::kMaxConfigFileBytes).what()) ==
        big.string() + ": is 16777217 bytes, over the 16 MiB cap of a configuration file");

  Error missing = error_of(dir.path() / "none.toml");
  CHECK(missing.kind() == ErrorKind::not_found);
  CHECK(std::string(missing.what()) ==
        (dir.path() / "none.toml").string() + ": configuration file does not exist");
}

// The checkpoint key of the environment: what signs and checks checkpoints
// (Python's saves and loads) and in-memory snapshots (the agent's copies).
TEST_CASE("checkpoint_key_from_environment: the variable or file, each error naming it") {
  using ductile::core::checkpoint_key_from_environment;
  auto kind_and_message = [] {
    try {
      checkpoint_key_from_environment();
    } catch (const Error& e) {
      return std::pair{e.kind(), std::string(e.what())};
    }
    return std::pair{ErrorKind::internal, std::string("no error")};
  };
  ::unsetenv("DUCTILE_CHECKPOINT_KEY");
  ::unsetenv("DUCTILE_CHECKPOINT_KEY_FILE");
  CHECK_FALSE(checkpoint_key_from_environment().has_value());

  ::setenv("DUCTILE_CHECKPOINT_KEY", "0123456789abcdef", 1);
  auto key = checkpoint_key_from_environment();
  REQUIRE(key.has_value());
  CHECK(key->bytes == "0123456789abcdef");
  CHECK(key->variable == "DUCTILE_CHECKPOINT_KEY");
  ::setenv("DUCTILE_CHECKPOINT_KEY", "short", 1);
  CHECK(kind_and_message() ==
        std::pair{ErrorKind::invalid_argument,
                  std::string("zero3 checkpoint: the key of DUCTILE_CHECKPOINT_KEY has 5 bytes; "
                              "valid: at least 16 (e.g. the 64 hex digits of `openssl rand -hex "
                              "32`), or unset DUCTILE_CHECKPOINT_KEY to save without a key")});

  ductile::test::TempDir dir;
  const auto file = dir.write("key", "  0123456789abcdef0123\n");
  ::setenv("DUCTILE_CHECKPOINT_KEY_FILE", file.c_str(), 1);
  CHECK(kind_and_message().second ==
        "zero3 checkpoint: both DUCTILE_CHECKPOINT_KEY_FILE and DUCTILE_CHECKPOINT_KEY are set; "
        "set one of them");
  ::unsetenv("DUCTILE_CHECKPOINT_KEY");
  key = checkpoint_key_from_environment();
  REQUIRE(key.has_value());
  CHECK(key->bytes == "0123456789abcdef0123");  // the blanks at its ends dropped
  CHECK(key->variable == "DUCTILE_CHECKPOINT_KEY_FILE");
  ::setenv("DUCTILE_CHECKPOINT_KEY_FILE", "", 1);
  CHECK(kind_and_message().second ==
        "zero3 checkpoint: DUCTILE_CHECKPOINT_KEY_FILE is set but empty; give the path of a key "
        "file, or unset it");
  const auto missing = dir.path() / "none";
  ::setenv("DUCTILE_CHECKPOINT_KEY_FILE", missing.c_str(), 1);
  CHECK(
      kind_and_message() ==
      std::pair{ErrorKind::not_found,
                missing.string() +
                    ": checkpoint key file does not exist (named by DUCTILE_CHECKPOINT_KEY_FILE)"});
  ::unsetenv("DUCTILE_CHECKPOINT_KEY_FILE");
}
