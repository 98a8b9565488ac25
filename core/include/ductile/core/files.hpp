// Reading files that users name (configurations, data files): never block on a
// FIFO, never read a device or an unbounded file into memory.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace ductile::core {

// The largest configuration file read (TOML or JSON): 16 MiB. Real
// ones are a few KiB; the cap keeps `ductile config check /dev/zero`-like
// mistakes from reading until the process is killed.
inline constexpr std::uintmax_t kMaxConfigFileBytes = std::uintmax_t{16} << 20;

// Opens `file` read-only, close-on-exec and non-blocking, so that opening a
// FIFO does not wait for a writer. Returns the descriptor (the caller closes
// it), or -1 with errno set. Thread-safe.
int open_for_reading(const std::filesystem::path& file);

// "" when `st` describes a regular file of at most `max_bytes`; otherwise
// what is wrong, for a message that the caller prefixes with the file name:
// "is a FIFO, not a regular file; give a regular file", or
// "is 20000000 bytes, over the 16 MiB cap of a configuration file".
// `role` names the file's use ("configuration file", ...).
std::string regular_file_problem(const struct stat& st, std::uintmax_t max_bytes,
                                 std::string_view role);

// The whole content of a user's configuration file: a regular file of at
// most `max_bytes`. Throws ductile::Error naming the file: not_found (no such
// file), io (a directory, FIFO, device or socket; over the cap; unreadable).
std::string read_user_file(const std::filesystem::path& file, std::string_view role,
                           std::uintmax_t max_bytes = kMaxConfigFileBytes);

}  // namespace ductile::core
