// See file_mappings.hpp.
#include "file_mappings.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace ductile::python {

namespace {

constexpr long kTmpfsMagic = 0x01021994;  // statfs(2)'s f_type of tmpfs and /dev/shm

// Smaller files (manifests, small shards) are written with pwrite: a
// mapping's set-up would cost more than it saves.
constexpr std::uint64_t kMinMappedBytes = 16ull << 20;

// A rank alternates between two snapshots' files; a few more cover a
// restore's and a replica's without thrashing.
constexpr std::size_t kMaxFiles = 4;

// Address space mapped past a file's end: a file that grows a little (a
// shard file's header gains a byte when the step gains a digit) is written
// through the same mapping at the same addresses. Only [0, end) is ever
// touched, and it is inside the file.
constexpr std::uint64_t kSlackBytes = 2ull << 20;

std::size_t mapped_length(std::uint64_t end) {
  return static_cast<std::size_t>((end / kSlackBytes + 2) * kSlackBytes);
}

struct Entry {
  dev_t device;
  ino_t inode;
  int fd;  // the cache's own, read-write
  unsigned char* base;
  std::size_t length;  // mapped, past the file's end
  std::uint64_t last_used;
};

std::vector<Entry>& entries() {
  static std::vector<Entry> kept;
  return kept;
}

void drop(Entry& entry) {
  munmap(entry.base, entry.length);
  close(entry.fd);
}

// Drops the entries whose file has no name left, and the least recently
// used ones past `keep`.
void trim(std::size_t keep) {
  auto& kept = entries();
  std::erase_if(kept, [](Entry& entry) {
    struct stat st {};
    if (fstat(entry.fd, &st) == 0 && st.st_nlink > 0) return false;
    drop(entry);
    return true;
  });
  while (kept.size() > keep) {
    auto oldest = std::min_element(kept.begin(), kept.end(), [](const Entry& a, const Entry& b) {
      return a.last_used < b.last_used;
    });
    drop(*oldest);
    kept.erase(oldest);
  }
}

// The file grown to `end` with every block of [0, end) allocated, so that
// no store through a mapping can meet a full tmpfs (which would be SIGBUS,
// not an error).
bool allocate(int fd, const struct stat& st, std::uint64_t end) {
  const auto size = static_cast<std::uint64_t>(st.st_size);
  const auto allocated = static_cast<std::uint64_t>(st.st_blocks) * 512;
  if (size >= end && allocated >= size) return true;
  return fallocate(fd, 0, 0, static_cast<off_t>(end)) == 0;
}

}  // namespace

FileMappings& FileMappings::instance() {
  static FileMappings cache;
  return cache;
}

FileMappings::Lease FileMappings::lease(int fd, std::uint64_t end) {
  Lease lease;
  if (end < kMinMappedBytes) return lease;
  lease.lock_ = std::unique_lock(mutex_);
  trim(kMaxFiles);
  // Only a descriptor open for plain writing: through a read-only one the
  // write must fail as pwrite's would, and O_APPEND writes at the end.
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_ACCMODE) == O_RDONLY || (flags & O_APPEND) != 0) return lease;
  struct statfs fs {};
  struct stat st {};
  if (fstatfs(fd, &fs) != 0 || fs.f_type != kTmpfsMagic || fstat(fd, &st) != 0 ||
      !S_ISREG(st.st_mode) || !allocate(fd, st, end))
    return lease;
  static std::uint64_t clock = 0;
  auto& kept = entries();
  auto found = std::find_if(kept.begin(), kept.end(), [&](const Entry& entry) {
    return entry.device == st.st_dev && entry.inode == st.st_ino;
  });
  if (found != kept.end() && found->length < end) {
    // Grown past the slack: moving the mapping keeps its pages mapped,
    // where a new one would fault every page in again.
    void* grown = mremap(found->base, found->length, mapped_length(end), MREMAP_MAYMOVE);
    if (grown != MAP_FAILED) {
      found->base = static_cast<unsigned char*>(grown);
      found->length = mapped_length(end);
    } else {
      drop(*found);
      kept.erase(found);
      found = kept.end();
    }
  }
  if (found == kept.end()) {
    // The caller's descriptor may be write-only, and a shared writable
    // mapping needs one opened for reading too.
    const std::string self = "/proc/self/fd/" + std::to_string(fd);
    const int own = open(self.c_str(), O_RDWR | O_CLOEXEC);
    if (own < 0) return lease;
    // MAP_POPULATE maps the file's pages and stops at its end.
    void* base = mmap(nullptr, mapped_length(end), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_POPULATE, own, 0);
    if (base == MAP_FAILED) {
      close(own);
      return lease;
    }
    trim(kMaxFiles - 1);
    kept.push_back(
        {st.st_dev, st.st_ino, own, static_cast<unsigned char*>(base), mapped_length(end), 0});
    found = kept.end() - 1;
  }
  found->last_used = ++clock;
  lease.base_ = found->base;
  return lease;
}

}  // namespace ductile::python
