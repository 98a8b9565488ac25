// Which plugin files and directories the loader trusts enough to run their
// code as the calling user (docs/architecture.md, "Trust").
//
// The rule is the one ld.so applies to the libraries of a set-user-ID
// program and sudo to its plugins and policy files: the path, resolved
// through symbolic links, and every directory above it must be owned by root
// or by the caller (the effective user), and writable by no one else. Only
// then can no other user replace the library, or a directory on its way,
// between the check and dlopen(). A directory above may be writable by others
// when it has the sticky bit (/tmp): others cannot rename or remove what the
// caller owns there. A plugin directory itself may not be writable by others
// even with the sticky bit, since others could add files to it.
//
// Threading: reads the file system only; safe from any thread.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

namespace ductile::core {

// Why `path` (a plugin file or a directory searched for plugins) may not be
// trusted, as a phrase to follow its name ("is
// writable by others (mode 0777); ..."), naming the directory at fault when
// it is one above; nullopt when it may. A path that cannot be resolved is
// not trusted either.
std::optional<std::string> untrusted_reason(const std::filesystem::path& path);

// The same for a path already resolved: `real` is `path` through its links
// (std::filesystem::canonical), so that a caller that needs the resolved path
// anyway resolves it once. Only `real` and the directories above it are
// examined; `path` names the subject of the phrase.
std::optional<std::string> untrusted_reason(const std::filesystem::path& path,
                                            const std::filesystem::path& real);

// The same for a plugin file whose directory, resolved as `real_directory`,
// was found trusted already: when `file` is no symbolic link, only the file
// itself is examined (its resolved path is `real_directory` / its name).
// Sets `real` to the file's resolved path when it returns nullopt.
std::optional<std::string> untrusted_file_reason(const std::filesystem::path& file,
                                                 const std::filesystem::path& real_directory,
                                                 std::filesystem::path& real);

}  // namespace ductile::core
