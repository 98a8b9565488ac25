// Shard files for NVMe offload: one file per parameter under
// <nvme_path>/rank<r>/, written synchronously and read either synchronously
// or ahead of time by one background I/O thread.
//
// The rank's folder is ductile's own: created with mode 0700, or, when it
// exists, accepted only as a real directory (not a symbolic link) owned by
// the process's user and writable by nobody else. Every shard file is then
// opened relative to that folder's descriptor, never following a symbolic
// link and never waiting on a FIFO, and accepted only as a regular file of
// the process's user: a link planted there cannot redirect the parameters'
// writes onto another file, and a FIFO cannot hang a read or a write.
//
// Threading: create/write/read run on the caller's thread; submitted reads
// run on the store's I/O thread. The store is not safe for concurrent
// create/write calls on the same parameter.
// Errors: Error(io) naming the file or folder, what is wrong and what to do.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

namespace ductile::zero {

// One asynchronous read. `done` flips to true once the reader has finished
// (successfully or not); `error` is then set for a failure.
struct ReadJob {
  std::filesystem::path file;
  std::uint64_t parameter = 0;
  void* destination = nullptr;
  std::size_t bytes = 0;
  std::atomic<bool> done{false};
  std::string error;
};

class NvmeStore {
 public:
  // Creates <root> (with its parents) and <root>/rank<rank>/. Throws
  // Error(io) naming the folder when it cannot be created or is refused.
  NvmeStore(std::filesystem::path root, int rank);
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  std::filesystem::path file_of(std::uint64_t parameter) const;

  // Creates a zero-filled file of `bytes` bytes. Throws Error(io).
  void create(std::uint64_t parameter, std::size_t bytes);
  // Replaces the file's content. Throws Error(io).
  void write(std::uint64_t parameter, const void* data, std::size_t bytes);
  // Reads exactly `bytes` bytes. Throws Error(io) for a missing, short,
  // long or unreadable file.
  void read(std::uint64_t parameter, void* data, std::size_t bytes) const;

  // Queues a read for the I/O thread.
  std::shared_ptr<ReadJob> submit(std::uint64_t parameter, void* data, std::size_t bytes);
  // Blocks until `job` is done; throws Error(io) with its error.
  void wait(ReadJob& job);

 private:
  void run();
  // "" when `bytes` were read into `data`, else what went wrong.
  std::string read_file(std::uint64_t parameter, void* data, std::size_t bytes) const;
  // Opens the parameter's shard file with `flags` (plus no-follow,
  // non-blocking, close-on-exec) into `fd` and checks it is a regular file
  // of this user: "" when it is (the caller closes `fd`), else what is wrong
  // (`fd` is then -1). `verb` says what was being done ("write");
  // `missing_note` ends the message of a missing file.
  std::string open_shard(std::uint64_t parameter, int flags, const char* verb, int& fd,
                         std::string_view missing_note = {}) const;

  std::filesystem::path dir_;
  int dir_fd_ = -1;  // the rank's folder, opened once and checked
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<std::shared_ptr<ReadJob>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace ductile::zero
