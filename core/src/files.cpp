#include "ductile/core/files.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "ductile/error.hpp"

namespace ductile::core {
namespace fs = std::filesystem;

int open_for_reading(const fs::path& file) {
  return ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
}

namespace {

const char* file_type(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

std::string byte_size(std::uintmax_t bytes) {
  if (bytes % (std::uintmax_t{1} << 30) == 0) return fmt::format("{} GiB", bytes >> 30);
  if (bytes % (std::uintmax_t{1} << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  return fmt::format("{} bytes", bytes);
}

}  // namespace

std::string regular_file_problem(const struct stat& st, std::uintmax_t max_bytes,
                                 std::string_view role) {
  if (!S_ISREG(st.st_mode))
    return fmt::format("is {}, not a regular file; give a regular {}", file_type(st.st_mode), role);
  const auto size = static_cast<std::uintmax_t>(st.st_size);
  if (size > max_bytes)
    return fmt::format("is {} bytes, over the {} cap of a {}", size, byte_size(max_bytes), role);
  return {};
}

std::string read_user_file(const fs::path& file, std::string_view role, std::uintmax_t max_bytes) {
  const int fd = open_for_reading(file);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT)
      throw Error(ErrorKind::not_found, fmt::format("{}: {} does not exist", file.string(), role));
    throw Error(ErrorKind::io,
                fmt::format("{}: cannot read the {}: {}", file.string(), role, std::strerror(err)));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    throw Error(ErrorKind::io, fmt::format("{}: cannot stat the {}: {}", file.string(), role,
                                           std::strerror(errno)));
  if (auto problem = regular_file_problem(st, max_bytes, role); !problem.empty())
    throw Error(ErrorKind::io, fmt::format("{}: {}", file.string(), problem));
  // A regular file: O_NONBLOCK has no effect on its reads.
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const auto n = ::read(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw Error(ErrorKind::io, fmt::format("{}: cannot read the {}: {}", file.string(), role,
                                             std::strerror(errno)));
    if (n == 0) break;  // shrank while being read: take what is there
    done += static_cast<std::size_t>(n);
  }
  text.resize(done);
  return text;
}

std::optional<CheckpointKey> checkpoint_key_from_environment() {
  const char* path = std::getenv(kCheckpointKeyFileVariable);
  const char* text = std::getenv(kCheckpointKeyVariable);
  if (path && text)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("zero3 checkpoint: both {} and {} are set; set one of them",
                            kCheckpointKeyFileVariable, kCheckpointKeyVariable));
  CheckpointKey key;
  std::string where;
  if (path) {
    if (*path == '\0')
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero3 checkpoint: {} is set but empty; give the path of a key "
                              "file, or unset it",
                              kCheckpointKeyFileVariable));
    try {
      key.bytes = read_user_file(path, "checkpoint key file", kMaxCheckpointKeyFileBytes);
    } catch (const Error& e) {
      throw Error(e.kind(), fmt::format("{} (named by {})", e.what(), kCheckpointKeyFileVariable));
    }
    // Python's bytes.strip(): ASCII blanks at both ends.
    constexpr const char* kBlanks = " \t\n\r\v\f";
    key.bytes.erase(0, key.bytes.find_first_not_of(kBlanks));
    key.bytes.erase(key.bytes.find_last_not_of(kBlanks) + 1);
    key.variable = kCheckpointKeyFileVariable;
    where = fmt::format("{} (named by {})", path, kCheckpointKeyFileVariable);
  } else if (text) {
    key.bytes = text;
    key.variable = kCheckpointKeyVariable;
    where = kCheckpointKeyVariable;
  } else {
    return std::nullopt;
  }
  if (key.bytes.size() < kMinCheckpointKeyBytes)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("zero3 checkpoint: the key of {} has {} bytes; valid: at least {} "
                            "(e.g. the 64 hex digits of `openssl rand -hex 32`), or unset {} to "
                            "save without a key",
                            where, key.bytes.size(), kMinCheckpointKeyBytes, key.variable));
  return key;
}

}  // namespace ductile::core
