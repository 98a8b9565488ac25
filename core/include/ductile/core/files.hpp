// Reading files that users name (configurations, data files): never block on a
// FIFO, never read a device or an unbounded file into memory.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <filesystem>
#include <optional>
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

// The key that signs zero3 checkpoints and in-memory snapshots, and that
// checks them when they are loaded or restored.
struct CheckpointKey {
  std::string bytes;     // a secret: messages give its length, never its bytes
  std::string variable;  // the environment variable that gave it
};

// The environment variables that give the key: a file's path, or the key.
inline constexpr const char* kCheckpointKeyFileVariable = "DUCTILE_CHECKPOINT_KEY_FILE";
inline constexpr const char* kCheckpointKeyVariable = "DUCTILE_CHECKPOINT_KEY";
inline constexpr std::uintmax_t kMaxCheckpointKeyFileBytes = 4096;
// Fewer bytes than this are guessable; `openssl rand -hex 32` gives 64.
inline constexpr std::size_t kMinCheckpointKeyBytes = 16;

// The key of this process's environment: the bytes of the file
// DUCTILE_CHECKPOINT_KEY_FILE names (read by read_user_file, blanks at its
// ends dropped), or of DUCTILE_CHECKPOINT_KEY; none when neither is set.
// Throws ductile::Error naming the variable: invalid_argument (both set,
// an empty path, a key shorter than kMinCheckpointKeyBytes), or
// read_user_file's not_found/io for the file.
std::optional<CheckpointKey> checkpoint_key_from_environment();

}  // namespace ductile::core
