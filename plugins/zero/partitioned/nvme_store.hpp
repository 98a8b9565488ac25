// Shard files for NVMe offload: one file per parameter under
// <nvme_path>/rank<r>/, written synchronously and read either synchronously
// or ahead of time by one background I/O thread.
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

  std::filesystem::path dir_;
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<std::shared_ptr<ReadJob>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace ductile::zero
