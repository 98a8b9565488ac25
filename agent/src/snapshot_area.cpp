// This node's snapshot area and what it holds. See snapshot_area.hpp.
#include "snapshot_area.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <random>
#include <system_error>

#include <fmt/format.h>
#include <openssl/evp.h>
#include <nlohmann/json.hpp>

#include "ductile/error.hpp"

namespace ductile::agent {

namespace fs = std::filesystem;

// Not an anonymous namespace: a unity build puts several of the library's
// files into one translation unit, where their helpers' names would clash.
namespace snapshot_area_detail {

// Entries of one directory looked at: the workers' roots and the replicas
// hold a handful; a directory with more is not one the agent made.
constexpr std::size_t kMaxDirectoryEntries = 1024;

bool all_digits(std::string_view text) {
  return !text.empty() &&
         std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::optional<std::int64_t> decimal(std::string_view text) {
  if (!all_digits(text) || text.size() > 18) return std::nullopt;
  std::int64_t value = 0;
  std::from_chars(text.data(), text.data() + text.size(), value);
  return value;
}

bool lowercase_hex(std::string_view text, std::size_t size) {
  return text.size() == size && std::all_of(text.begin(), text.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

bool is_real_directory(const fs::path& path) {
  std::error_code ec;
  return fs::symlink_status(path, ec).type() == fs::file_type::directory;
}

void make_private_directory(const fs::path& path) {
  if (::mkdir(path.c_str(), 0700) != 0)
    throw Error(ErrorKind::io, fmt::format("cannot make the snapshot directory '{}': {}; give "
                                           "--snapshot-dir a writable directory",
                                           path.string(), std::strerror(errno)));
  // A umask may have taken the owner's bits: the area is the agent's alone.
  ::chmod(path.c_str(), 0700);
}

// The lock of `area` taken (never through a link); -1 when it is held (a
// live agent's) or there is none.
int take_area_lock(const fs::path& area) {
  const int fd =
      ::open((area / kSnapshotLockFile).c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return -1;
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool private_directory_of_ours(const fs::path& path) {
  struct stat info{};
  return ::lstat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode) && info.st_uid == ::geteuid() &&
         (info.st_mode & 07777) == 0700;
}

// The areas in `base` whose agents are dead (see the header); `complete`
// false when a bound stopped the search.
std::vector<fs::path> remove_dead_areas(const fs::path& base, bool& complete) {
  // A base such as /dev/shm may hold any number of other files: their names
  // are read and passed over (a directory's entries cost little to list),
  // and only areas are looked at, up to a bound of each.
  std::vector<fs::path> dead;
  std::error_code ec;
  fs::directory_iterator it(base, ec), end;
  std::size_t entries = 0, areas = 0;
  complete = true;
  for (; !ec && it != end; it.increment(ec)) {
    if (++entries > kMaxSnapshotBaseEntries) {
      complete = false;
      break;
    }
    const fs::path path = it->path();
    if (!path.filename().string().starts_with("ductile-snapshots-")) continue;
    if (++areas > kMaxSnapshotAreasSearched) {
      complete = false;
      break;
    }
    if (!private_directory_of_ours(path)) continue;
    const int lock = take_area_lock(path);
    if (lock < 0) continue;
    std::error_code removed;
    fs::remove_all(path, removed);
    ::close(lock);
    if (!removed) dead.push_back(path);
  }
  return dead;
}

}  // namespace snapshot_area_detail

using namespace snapshot_area_detail;

std::optional<std::string> read_small_file(const fs::path& file, std::uintmax_t limit) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  struct stat info{};
  std::optional<std::string> text;
  if (::fstat(fd, &info) == 0 && S_ISREG(info.st_mode) &&
      static_cast<std::uintmax_t>(info.st_size) <= limit) {
    text.emplace();
    char buffer[65536];
    for (;;) {
      const ssize_t n = ::read(fd, buffer, sizeof buffer);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        text.reset();
        break;
      }
      if (n == 0) break;
      text->append(buffer, static_cast<std::size_t>(n));
      if (text->size() > limit) {  // it grew while read
        text.reset();
        break;
      }
    }
  }
  ::close(fd);
  return text;
}

std::optional<std::int64_t> snapshot_tag_step(const std::string& tag) {
  if (!tag.starts_with("step")) return std::nullopt;
  std::string_view rest = std::string_view(tag).substr(4);
  const auto dot = rest.find('.');
  if (dot != std::string_view::npos) {
    const std::string_view copy = rest.substr(dot + 1);
    if (!all_digits(copy) || copy.size() > 9) return std::nullopt;
    rest = rest.substr(0, dot);
  }
  return decimal(rest);
}

bool snapshot_file_name(const std::string& name, std::int64_t* world) {
  if (name == kSnapshotManifest || name == kSnapshotChecksum || name == kSnapshotHmac) return true;
  if (name.size() > kMaxSnapshotFileChars || !name.starts_with("rank") || !name.ends_with(".bin"))
    return false;
  const std::string_view stem = std::string_view(name).substr(4, name.size() - 8);
  const auto of = stem.find("-of-");
  if (of == std::string_view::npos) return false;
  const auto rank = decimal(stem.substr(0, of)), size = decimal(stem.substr(of + 4));
  if (!rank || !size || *rank >= *size) return false;
  if (world) *world = *size;
  return true;
}

std::optional<std::string> file_sha256(const fs::path& file, std::uintmax_t limit) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  struct stat info{};
  std::optional<std::string> hex;
  EVP_MD_CTX* context = EVP_MD_CTX_new();
  if (context && ::fstat(fd, &info) == 0 && S_ISREG(info.st_mode) &&
      static_cast<std::uintmax_t>(info.st_size) <= limit &&
      EVP_DigestInit_ex(context, EVP_sha256(), nullptr) == 1) {
    std::string buffer(1 << 20, '\0');
    std::uintmax_t total = 0;
    bool ok = true;
    for (;;) {
      const ssize_t n = ::read(fd, buffer.data(), buffer.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        ok = n == 0;
        break;
      }
      total += static_cast<std::uintmax_t>(n);
      if (total > limit ||
          EVP_DigestUpdate(context, buffer.data(), static_cast<std::size_t>(n)) != 1) {
        ok = false;
        break;
      }
    }
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int size = 0;
    if (ok && EVP_DigestFinal_ex(context, digest, &size) == 1) {
      hex.emplace();
      for (unsigned int i = 0; i < size; ++i) *hex += fmt::format("{:02x}", digest[i]);
    }
  }
  EVP_MD_CTX_free(context);
  ::close(fd);
  return hex;
}

std::optional<std::string> read_checksum_sidecar(const fs::path& file) {
  auto text = read_small_file(file, kMaxSidecarBytes);
  if (!text) return std::nullopt;
  // sha256sum's line: "<hex>  manifest.json" (one newline at most after).
  const std::string expected_tail = std::string("  ") + kSnapshotManifest;
  std::string line = *text;
  if (line.ends_with("\n")) line.pop_back();
  if (line.size() != 64 + expected_tail.size() || !line.ends_with(expected_tail))
    return std::nullopt;
  line.resize(64);
  if (!lowercase_hex(line, 64)) return std::nullopt;
  return line;
}

std::optional<std::map<std::string, std::uintmax_t>> manifest_shard_sizes(
    const fs::path& manifest) {
  auto text = read_small_file(manifest, kMaxManifestBytes);
  if (!text) return std::nullopt;
  const auto json = nlohmann::json::parse(*text, nullptr, false);
  if (json.is_discarded() || !json.is_object() || !json.contains("shards") ||
      !json["shards"].is_array() || json["shards"].size() > kMaxSnapshotFiles)
    return std::nullopt;
  std::map<std::string, std::uintmax_t> sizes;
  for (const auto& shard : json["shards"]) {
    if (!shard.is_object() || !shard.contains("file") || !shard["file"].is_string() ||
        !shard.contains("bytes") || !shard["bytes"].is_number_unsigned())
      return std::nullopt;
    const auto name = shard["file"].get<std::string>();
    std::int64_t world = 0;
    if (!snapshot_file_name(name, &world) || !name.starts_with("rank")) return std::nullopt;
    sizes[name] = shard["bytes"].get<std::uintmax_t>();
  }
  return sizes;
}

std::optional<SnapshotCopy> read_snapshot_copy(const fs::path& folder) {
  SnapshotCopy copy;
  copy.tag = folder.filename().string();
  const auto step = snapshot_tag_step(copy.tag);
  if (!step || !is_real_directory(folder)) return std::nullopt;
  copy.step = *step;
  std::error_code ec;
  fs::directory_iterator it(folder, ec), end;
  bool manifest = false;
  std::size_t entries = 0;
  for (; !ec && it != end; it.increment(ec)) {
    if (++entries > kMaxSnapshotFiles) return std::nullopt;
    const std::string name = it->path().filename().string();
    std::int64_t world = 0;
    // Another file (a link, a name no save writes) is not part of the
    // snapshot: not listed, never served as one of its files.
    std::error_code type_ec;
    if (!snapshot_file_name(name, &world) ||
        it->symlink_status(type_ec).type() != fs::file_type::regular)
      continue;
    if (world != 0) {
      if (copy.world != 0 && copy.world != world) return std::nullopt;
      copy.world = world;
    }
    manifest = manifest || name == kSnapshotManifest;
    copy.files.push_back(name);
  }
  if (ec || !manifest || copy.world == 0) return std::nullopt;
  auto sha = read_checksum_sidecar(folder / kSnapshotChecksum);
  if (!sha) return std::nullopt;
  copy.sha256 = *sha;
  std::sort(copy.files.begin(), copy.files.end());
  return copy;
}

std::vector<SnapshotCopy> list_snapshot_copies(const fs::path& dir, bool latest) {
  std::optional<std::string> latest_name;
  std::int64_t latest_step = 0;
  if (latest) {
    // Its first line names the folder (then "sha256 <hex>").
    auto text = read_small_file(dir / kSnapshotLatest, kMaxSidecarBytes);
    if (!text) return {};
    latest_name = text->substr(0, text->find('\n'));
    auto step = snapshot_tag_step(*latest_name);
    if (!step) return {};
    latest_step = *step;
  }
  std::vector<std::pair<std::int64_t, std::string>> folders;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  std::size_t entries = 0;
  for (; !ec && it != end && ++entries <= kMaxDirectoryEntries; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const auto step = snapshot_tag_step(name);
    if (!step) continue;  // "latest", the staging folders ("<tag>.tmp")
    // A folder renamed by a save that never wrote `latest` is not
    // committed; nor is an older one of the same step (superseded).
    if (latest_name && name != *latest_name && *step >= latest_step) continue;
    folders.emplace_back(*step, name);
  }
  std::sort(folders.begin(), folders.end(), std::greater<>());
  std::vector<SnapshotCopy> copies;
  for (const auto& [step, name] : folders) {
    if (copies.size() == kMaxSnapshotCopies) break;
    if (auto copy = read_snapshot_copy(dir / name)) copies.push_back(std::move(*copy));
  }
  return copies;
}

SnapshotArea::SnapshotArea(const std::string& base, const std::string& job_id,
                           const std::string& node_id) {
  fs::path dir = base;
  std::error_code ec;
  if (dir.empty()) {
    dir = "/dev/shm";
    if (!fs::is_directory(dir, ec)) {
      dir = fs::temp_directory_path(ec);
      if (ec)
        throw Error(ErrorKind::io,
                    fmt::format("no directory for the snapshot area (/dev/shm is none, and the "
                                "temporary directory: {}): give --snapshot-dir a directory",
                                ec.message()));
    }
  } else if (!fs::is_directory(dir, ec)) {
    throw Error(ErrorKind::invalid_argument,
                fmt::format("--snapshot-dir '{}' is not a directory: give an existing directory "
                            "(default /dev/shm)",
                            base));
  }
  removed_stale_ = remove_dead_areas(dir, stale_search_complete_);
  // A name of this agent's own (two agents of one job and node id, as
  // concurrent tests and a restarted agent have, never share an area),
  // cut to fit a file name. It is made under a hidden name, locked, then
  // renamed: another agent's clean-up never sees it unlocked.
  const std::string stem =
      fmt::format("ductile-snapshots-{}-{}", job_id.substr(0, 80), node_id.substr(0, 80));
  std::random_device random;
  fs::path staging;
  for (int attempt = 0;; ++attempt) {
    const std::string name = fmt::format("{}-{}-{:08x}", stem, ::getpid(), random());
    staging = dir / ("." + name);
    root_ = dir / name;
    if (::mkdir(staging.c_str(), 0700) == 0) break;
    if (errno != EEXIST || attempt == 8)
      throw Error(ErrorKind::io,
                  fmt::format("cannot make the snapshot area '{}': {}; give --snapshot-dir a "
                              "writable directory",
                              staging.string(), std::strerror(errno)));
  }
  // A umask may have taken the owner's bits: the area is the agent's alone.
  ::chmod(staging.c_str(), 0700);
  lock_fd_ = ::open((staging / kSnapshotLockFile).c_str(),
                    O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (lock_fd_ < 0 || ::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    fs::remove_all(staging, ec);
    throw Error(ErrorKind::io,
                fmt::format("cannot lock the snapshot area '{}': {}; give --snapshot-dir a "
                            "directory of a local file system",
                            staging.string(), std::strerror(error)));
  }
  try {
    for (const char* part : {"own", "replicas", "restore"}) make_private_directory(staging / part);
  } catch (...) {
    fs::remove_all(staging, ec);
    throw;
  }
  if (::rename(staging.c_str(), root_.c_str()) != 0) {
    const int error = errno;
    fs::remove_all(staging, ec);
    throw Error(ErrorKind::io, fmt::format("cannot make the snapshot area '{}': {}; give "
                                           "--snapshot-dir a writable directory",
                                           root_.string(), std::strerror(error)));
  }
}

SnapshotArea::~SnapshotArea() {
  remove();
}

void SnapshotArea::remove() {
  if (removed_) return;
  removed_ = true;
  std::error_code ignored;
  fs::remove_all(root_, ignored);
  // Released after the removal: another agent never takes the area for
  // dead while its files are still being removed.
  if (lock_fd_ >= 0) ::close(lock_fd_);
  lock_fd_ = -1;
}

std::map<std::string, std::vector<SnapshotCopy>> SnapshotArea::replica_copies() const {
  std::map<std::string, std::vector<SnapshotCopy>> held;
  std::error_code ec;
  fs::directory_iterator it(replicas(), ec), end;
  std::size_t entries = 0;
  for (; !ec && it != end && ++entries <= kMaxDirectoryEntries; it.increment(ec)) {
    const std::string node = it->path().filename().string();
    if (!valid_node_id(node) || !is_real_directory(it->path())) continue;
    auto copies = list_snapshot_copies(it->path(), false);
    if (copies.empty()) continue;
    held[node] = std::move(copies);
    if (held.size() == kMaxReplicatedNodes) break;
  }
  return held;
}

std::optional<std::int64_t> SnapshotArea::replicas_wanted() const {
  auto text = read_small_file(own() / kSnapshotReplicasFile, 32);
  if (!text) return std::nullopt;
  if (text->ends_with("\n")) text->pop_back();
  return decimal(*text);
}

}  // namespace ductile::agent
