// The NVMe shard files alone (plugins/zero/partitioned/nvme_store.cpp,
// compiled into this test) on real files: a symbolic link planted as a shard
// file is refused and its target left as it was, a FIFO fails at once rather
// than blocking, and the rank's folder is refused unless it is the user's own
// and writable by nobody else.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "ductile/error.hpp"
#include "nvme_store.hpp"
#include "temp_dir.hpp"

using ductile::Error;
using ductile::ErrorKind;
using ductile::zero::NvmeStore;
namespace fs = std::filesystem;

namespace {

std::string content_of(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <typename F>
std::string io_error_of(F&& call) {
  try {
    call();
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::io);
    return e.what();
  }
  FAIL("no error");
  return {};
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("NvmeStore: shards written, read back, recreated as zeros, a wrong size naming both") {
  ductile::test::TempDir dir;
  NvmeStore store(dir.path() / "nvme", 0);
  struct stat st {};
  REQUIRE(::stat((dir.path() / "nvme" / "rank0").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);

  const std::vector<char> data = {'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'};
  store.write(3, data.data(), data.size());
  std::vector<char> back(data.size());
  store.read(3, back.data(), back.size());
  CHECK(back == data);
  // A shorter write leaves no tail of the longer content.
  store.write(3, data.data(), 4);
  CHECK(fs::file_size(store.file_of(3)) == 4);
  store.create(3, 6);
  CHECK(content_of(store.file_of(3)) == std::string(6, '\0'));

  const std::string message = io_error_of([&] { store.read(3, back.data(), back.size()); });
  CHECK(has(message, "has 6 bytes, expected 8 (short file)"));
  const std::string huge = io_error_of([&] { store.read(3, back.data(), std::size_t{1} << 42); });
  CHECK(has(huge, "has 6 bytes, expected 4398046511104 (short file)"));
}

TEST_CASE("NvmeStore: a symbolic link as a shard file is refused, its target unchanged") {
  ductile::test::TempDir dir;
  NvmeStore store(dir.path(), 0);
  const fs::path victim = dir.write("victim.txt", "precious");
  fs::create_symlink(victim, store.file_of(0));
  const std::vector<char> data(64, 'x');

  for (const auto& message : {io_error_of([&] { store.create(0, 64); }),
                              io_error_of([&] { store.write(0, data.data(), data.size()); })}) {
    CHECK(has(message, store.file_of(0).string()));
    CHECK(has(message, "it is a symbolic link, not a regular file; remove it"));
  }
  std::vector<char> back(8);
  CHECK(has(io_error_of([&] { store.read(0, back.data(), back.size()); }), "a symbolic link"));
  CHECK(content_of(victim) == "precious");
  CHECK(fs::is_symlink(store.file_of(0)));
}

TEST_CASE("NvmeStore: a FIFO as a shard file fails at once, read, read ahead or written") {
  ductile::test::TempDir dir;
  NvmeStore store(dir.path(), 2);
  REQUIRE(::mkfifo(store.file_of(7).c_str(), 0600) == 0);
  std::vector<char> buffer(16);
  // Each call would block forever on a blocking open of a FIFO nobody opens.
  CHECK(has(io_error_of([&] { store.read(7, buffer.data(), buffer.size()); }),
            "it is a FIFO, not a regular file"));
  auto job = store.submit(7, buffer.data(), buffer.size());
  CHECK(has(io_error_of([&] { store.wait(*job); }), "it is a FIFO, not a regular file"));
  CHECK(has(io_error_of([&] { store.write(7, buffer.data(), buffer.size()); }), "a FIFO"));
  CHECK(has(io_error_of([&] { store.create(7, 16); }), "a FIFO"));
}

TEST_CASE("NvmeStore: a rank folder that is a link, writable by others or another's is refused") {
  ductile::test::TempDir dir;
  const fs::path elsewhere = dir.path() / "elsewhere";
  fs::create_directory(elsewhere);
  fs::create_directory(dir.path() / "linked");
  fs::create_directory_symlink(elsewhere, dir.path() / "linked" / "rank0");
  const std::string linked = io_error_of([&] { NvmeStore(dir.path() / "linked", 0); });
  CHECK(has(linked, "[zero] nvme_path: the shard folder '" +
                        (dir.path() / "linked" / "rank0").string() +
                        "' is a symbolic link, not a directory of this user; remove it"));
  CHECK(fs::is_empty(elsewhere));

  fs::create_directories(dir.path() / "open" / "rank1");
  REQUIRE(::chmod((dir.path() / "open" / "rank1").c_str(), 0777) == 0);
  const std::string open = io_error_of([&] { NvmeStore(dir.path() / "open", 1); });
  CHECK(has(open, "has mode 0777, writable by its group or by others"));
  CHECK(has(open, "run chmod go-w on it, or remove it"));

  // A folder of ductile's own from an earlier run is taken as it is.
  fs::create_directories(dir.path() / "mine" / "rank0");
  REQUIRE(::chmod((dir.path() / "mine" / "rank0").c_str(), 0755) == 0);
  NvmeStore mine(dir.path() / "mine", 0);

  if (::geteuid() != 0) {
    MESSAGE("not root: a folder owned by another user cannot be made here");
    return;
  }
  const fs::path theirs = dir.path() / "theirs" / "rank0";
  fs::create_directories(theirs);
  REQUIRE(::chmod(theirs.c_str(), 0700) == 0);
  REQUIRE(::chown(theirs.c_str(), 65534, 65534) == 0);
  const std::string owned = io_error_of([&] { NvmeStore(dir.path() / "theirs", 0); });
  CHECK(has(owned, "is owned by user 65534, not by this process's user 0"));
  CHECK(has(owned, "remove it or give another nvme_path"));
}
