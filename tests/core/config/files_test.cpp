// core::read_user_file, the one reader of the files a user names (the CLI's
// and, through the binding, Python's): a FIFO refused without waiting for a
// writer, a device never read, a file over the cap refused unread, each
// error naming the file and what would be valid.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

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
