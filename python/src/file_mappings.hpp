// Shared mappings of large files in memory (tmpfs), kept between writes.
//
// Why: a zero3 snapshot rewrites each rank's shard file in shared memory
// after every optimizer step, over the pages of the superseded snapshot's
// file. pwrite(2) finds every page of the file again on every call; a
// mapping kept from one snapshot to the next turns the rewrite into a
// memcpy, about half the time (the step pays for it).
//
// Ownership: the cache owns a descriptor of its own (opened read-write
// through /proc/self/fd) and the mapping of each file it keeps; the
// caller's descriptor is never kept or closed. A file whose last name is
// gone (st_nlink 0) is unmapped and closed at the next call, so a mapping
// never keeps a deleted snapshot's memory past that; at most kMaxFiles
// files are kept (least recently used go first).
// Threading: a Lease holds the cache's mutex; leases of any thread are
// served one at a time.
// Errors: none are thrown; a file that cannot be mapped (not on tmpfs,
// small, out of space, no read-write access) gives an empty Lease and the
// caller writes with pwrite(2), whose error then says what went wrong.
#pragma once

#include <cstdint>
#include <mutex>

namespace ductile::python {

class FileMappings {
 public:
  // Bytes [0, end) of a file, writable through memory, while it lives.
  class Lease {
   public:
    explicit operator bool() const { return base_ != nullptr; }
    unsigned char* data() const { return base_; }

   private:
    friend class FileMappings;
    std::unique_lock<std::mutex> lock_;
    unsigned char* base_ = nullptr;
  };

  // The mapping of fd's file with room for [0, end): the file is grown to
  // `end` and its blocks allocated first (so a write through the mapping
  // cannot fault for lack of space), or an empty Lease. A mapping reaches
  // a few MiB past `end`, so that a file grown a little is written at the
  // same addresses; one grown further is moved (mremap), its pages still
  // mapped.
  Lease lease(int fd, std::uint64_t end);

  // The process' cache.
  static FileMappings& instance();

 private:
  FileMappings() = default;
  std::mutex mutex_;
};

}  // namespace ductile::python
