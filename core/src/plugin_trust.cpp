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

}  // namespace

std::optional<std::string> untrusted_reason(const fs::path& path) {
  std::error_code ec;
  const fs::path real = fs::canonical(path, ec);
  if (ec) return fmt::format("cannot be resolved: {}", ec.message());
  const uid_t caller = ::geteuid();
  // "is ..." for the path itself (through the link it resolves to), "lies in
  // '<dir>', which is ..." for a directory above it.
  const std::string self =
      real == path ? std::string() : fmt::format("resolves to '{}', which ", real.string());
  fs::path at = real;
  for (bool first = true;; first = false) {
    struct stat st {};
    if (::lstat(at.c_str(), &st) != 0)
      return fmt::format("cannot be examined ('{}': {})", at.string(), std::strerror(errno));
    const std::string subject = first ? self : fmt::format("lies in '{}', which ", at.string());
    if (st.st_uid != 0 && st.st_uid != caller)
      return fmt::format("{}is owned by uid {}, neither root nor the caller (uid {})", subject,
                         st.st_uid, caller);
    const bool writable = st.st_mode & (S_IWGRP | S_IWOTH);
    // Others cannot rename or remove what the caller owns in a sticky
    // directory above; a plugin directory must not take their files at all.
    const bool sticky_above = !first && (st.st_mode & S_ISVTX);
    if (writable && !sticky_above)
      return fmt::format(
          "{}is writable by {} (mode {:04o}); make it writable by its owner "
          "alone (chmod go-w '{}')",
          subject, writers(st.st_mode), st.st_mode & 07777, at.string());
    const fs::path parent = at.parent_path();
    if (parent == at) return std::nullopt;  // checked "/"
    at = parent;
  }
}

}  // namespace ductile::core
