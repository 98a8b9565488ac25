#include "ductile/core/plugin_trust.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace ductile::core {
namespace fs = std::filesystem;

namespace {

const char* writers(mode_t mode) {
  const bool group = mode & S_IWGRP, others = mode & S_IWOTH;
  return group && others ? "its group and others" : group ? "its group" : "others";
}

// Why the file system entry `at`, described by `st`, may not be trusted;
// subject() begins the phrase. `above`: a directory above the path checked.
template <class Subject>
std::optional<std::string> entry_reason(const std::string& at, const struct stat& st,
                                        const Subject& subject, bool above) {
  // Most entries are root's: the caller's id is asked only for the others.
  if (st.st_uid != 0) {
    const uid_t caller = ::geteuid();
    if (st.st_uid != caller)
      return fmt::format("{}is owned by uid {}, neither root nor the caller (uid {})", subject(),
                         st.st_uid, caller);
  }
  const bool writable = st.st_mode & (S_IWGRP | S_IWOTH);
  // Others cannot rename or remove what the caller owns in a sticky
  // directory above; a plugin directory must not take their files at all.
  const bool sticky_above = above && (st.st_mode & S_ISVTX);
  if (writable && !sticky_above)
    return fmt::format(
        "{}is writable by {} (mode {:04o}); make it writable by its owner "
        "alone (chmod go-w '{}')",
        subject(), writers(st.st_mode), st.st_mode & 07777, at);
  return std::nullopt;
}

std::string cannot_examine(const std::string& at) {
  return fmt::format("cannot be examined ('{}': {})", at, std::strerror(errno));
}

}  // namespace

std::optional<std::string> untrusted_reason(const fs::path& path) {
  std::error_code ec;
  const fs::path real = fs::canonical(path, ec);
  if (ec) return fmt::format("cannot be resolved: {}", ec.message());
  return untrusted_reason(path, real);
}

std::optional<std::string> untrusted_reason(const fs::path& path, const fs::path& real) {
  // From `real` up to "/", one lstat() each; the phrase is made only for the
  // entry at fault: "is ..." for the path itself (through the link it
  // resolves to), "lies in '<dir>', which is ..." for a directory above it.
  std::string at = real.native();
  for (bool first = true;; first = false) {
    struct stat st {};
    if (::lstat(at.c_str(), &st) != 0) return cannot_examine(at);
    if (auto reason = entry_reason(
            at, st,
            [&] {
              if (!first) return fmt::format("lies in '{}', which ", at);
              return real == path ? std::string()
                                  : fmt::format("resolves to '{}', which ", real.string());
            },
            !first))
      return reason;
    if (at == "/") return std::nullopt;
    const auto slash = at.find_last_of('/', at.size() - 1);
    if (slash == std::string::npos) return std::nullopt;  // a relative path's top
    at.resize(slash == 0 ? 1 : slash);
  }
}

std::optional<std::string> untrusted_file_reason(const fs::path& file,
                                                 const fs::path& real_directory, fs::path& real) {
  struct stat st {};
  if (::lstat(file.c_str(), &st) != 0) return cannot_examine(file.native());
  if (S_ISLNK(st.st_mode)) {
    // It may lead anywhere: resolved and checked all the way up.
    std::error_code ec;
    real = fs::canonical(file, ec);
    if (ec) return fmt::format("cannot be resolved: {}", ec.message());
    return untrusted_reason(file, real);
  }
  real = real_directory / file.filename();
  return entry_reason(
      real.native(), st,
      [&] {
        return real == file ? std::string()
                            : fmt::format("resolves to '{}', which ", real.string());
      },
      false);
}

}  // namespace ductile::core
