#include "nvme_store.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "ductile/error.hpp"

namespace ductile::zero {
namespace {

std::string errno_text(int err) {
  return std::strerror(err);
}

// Closes a descriptor on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads exactly `bytes` bytes or returns the reason it could not.
std::string read_file(const std::filesystem::path& file, std::uint64_t parameter, void* data,
                      std::size_t bytes) {
  Fd f{::open(file.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) {
    int err = errno;
    if (err == ENOENT)
      return fmt::format("NVMe shard file '{}' of parameter {} is missing (expected {} bytes)",
                         file.string(), parameter, bytes);
    return fmt::format("cannot open NVMe shard file '{}' of parameter {}: {}", file.string(),
                       parameter, errno_text(err));
  }
  struct stat st {};
  if (::fstat(f.fd, &st) != 0)
    return fmt::format("cannot stat NVMe shard file '{}' of parameter {}: {}", file.string(),
                       parameter, errno_text(errno));
  if (!S_ISREG(st.st_mode))
    return fmt::format("NVMe shard file '{}' of parameter {} is not a regular file", file.string(),
                       parameter);
  if (static_cast<std::size_t>(st.st_size) != bytes)
    return fmt::format(
        "NVMe shard file '{}' of parameter {} has {} bytes, expected {} ({})", file.string(),
        parameter, static_cast<long long>(st.st_size), bytes,
        static_cast<std::size_t>(st.st_size) < bytes ? "short file" : "file too long");
  auto* out = static_cast<char*>(data);
  std::size_t done = 0;
  while (done < bytes) {
    ssize_t n = ::pread(f.fd, out + done, bytes - done, static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return fmt::format("cannot read NVMe shard file '{}' of parameter {}: {}", file.string(),
                         parameter, errno_text(errno));
    }
    if (n == 0)
      return fmt::format("NVMe shard file '{}' of parameter {} ended after {} bytes, expected {}",
                         file.string(), parameter, done, bytes);
    done += static_cast<std::size_t>(n);
  }
  return {};
}

}  // namespace

NvmeStore::NvmeStore(std::filesystem::path root, int rank)
    : dir_(std::move(root) / fmt::format("rank{}", rank)) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec)
    throw Error(ErrorKind::io, fmt::format("[zero] nvme_path: cannot create directory '{}': {}",
                                           dir_.string(), ec.message()));
  thread_ = std::thread([this] { run(); });
}

NvmeStore::~NvmeStore() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

std::filesystem::path NvmeStore::file_of(std::uint64_t parameter) const {
  return dir_ / fmt::format("param_{}.shard", parameter);
}

void NvmeStore::create(std::uint64_t parameter, std::size_t bytes) {
  auto file = file_of(parameter);
  Fd f{::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (f.fd < 0)
    throw Error(ErrorKind::io, fmt::format("cannot create NVMe shard file '{}' of parameter {}: {}",
                                           file.string(), parameter, errno_text(errno)));
  // A sparse file reads as zeros.
  if (::ftruncate(f.fd, static_cast<off_t>(bytes)) != 0)
    throw Error(ErrorKind::io, fmt::format("cannot size NVMe shard file '{}' to {} bytes: {}",
                                           file.string(), bytes, errno_text(errno)));
}

void NvmeStore::write(std::uint64_t parameter, const void* data, std::size_t bytes) {
  auto file = file_of(parameter);
  Fd f{::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (f.fd < 0)
    throw Error(ErrorKind::io, fmt::format("cannot write NVMe shard file '{}' of parameter {}: {}",
                                           file.string(), parameter, errno_text(errno)));
  const auto* in = static_cast<const char*>(data);
  std::size_t done = 0;
  while (done < bytes) {
    ssize_t n = ::pwrite(f.fd, in + done, bytes - done, static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(ErrorKind::io,
                  fmt::format("cannot write NVMe shard file '{}' of parameter {}: {}",
                              file.string(), parameter, errno_text(errno)));
    }
    done += static_cast<std::size_t>(n);
  }
}

void NvmeStore::read(std::uint64_t parameter, void* data, std::size_t bytes) const {
  std::string error = read_file(file_of(parameter), parameter, data, bytes);
  if (!error.empty()) throw Error(ErrorKind::io, error);
}

std::shared_ptr<ReadJob> NvmeStore::submit(std::uint64_t parameter, void* data, std::size_t bytes) {
  auto job = std::make_shared<ReadJob>();
  job->file = file_of(parameter);
  job->parameter = parameter;
  job->destination = data;
  job->bytes = bytes;
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(job);
  }
  work_cv_.notify_one();
  return job;
}

void NvmeStore::wait(ReadJob& job) {
  if (!job.done.load(std::memory_order_acquire)) {
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return job.done.load(std::memory_order_acquire); });
  }
  if (!job.error.empty()) throw Error(ErrorKind::io, job.error);
}

void NvmeStore::run() {
  for (;;) {
    std::shared_ptr<ReadJob> job;
    {
      std::unique_lock lock(mutex_);
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job->error = read_file(job->file, job->parameter, job->destination, job->bytes);
    {
      std::lock_guard lock(mutex_);
      job->done.store(true, std::memory_order_release);
    }
    done_cv_.notify_all();
  }
}

}  // namespace ductile::zero
