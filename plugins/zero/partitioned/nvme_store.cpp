#include "nvme_store.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "ductile/error.hpp"

namespace ductile::zero {
namespace {

// Closes a descriptor on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// A size no file offset can hold is refused before any file is touched.
void check_size(const std::filesystem::path& file, std::size_t bytes) {
  if (bytes > static_cast<std::size_t>(std::numeric_limits<off_t>::max()))
    throw Error(ErrorKind::io,
                fmt::format("NVMe shard file '{}': {} bytes is over the {} a file "
                            "can hold",
                            file.string(), bytes, std::numeric_limits<off_t>::max()));
}

const char* file_type(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

// The rank's folder, created 0700 or checked to be as private as that (see
// the header), opened as a directory descriptor.
int open_private_folder(const std::filesystem::path& dir) {
  const std::string shown = dir.string();
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw Error(ErrorKind::io, fmt::format("[zero] nvme_path: cannot create the shard folder "
                                           "'{}': {}; give an nvme_path this user can write",
                                           shown, std::strerror(errno)));
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    struct stat st {};
    if (::lstat(dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
      throw Error(ErrorKind::io,
                  fmt::format("[zero] nvme_path: the shard folder '{}' is {}, not a directory "
                              "of this user; remove it or give another nvme_path",
                              shown, file_type(st.st_mode)));
    throw Error(ErrorKind::io, fmt::format("[zero] nvme_path: cannot open the shard folder "
                                           "'{}': {}; give an nvme_path this user can write",
                                           shown, std::strerror(err)));
  }
  Fd owned{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    throw Error(ErrorKind::io, fmt::format("[zero] nvme_path: cannot stat the shard folder "
                                           "'{}': {}",
                                           shown, std::strerror(errno)));
  if (st.st_uid != ::geteuid())
    throw Error(ErrorKind::io,
                fmt::format("[zero] nvme_path: the shard folder '{}' is owned by user {}, not by "
                            "this process's user {}: its owner could read or replace the "
                            "parameters; remove it or give another nvme_path",
                            shown, st.st_uid, ::geteuid()));
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0)
    throw Error(ErrorKind::io,
                fmt::format("[zero] nvme_path: the shard folder '{}' has mode {:04o}, writable by "
                            "its group or by others, who could replace the parameters' files; "
                            "run chmod go-w on it, or remove it",
                            shown, st.st_mode & 07777));
  owned.fd = -1;
  return fd;
}

}  // namespace

std::string NvmeStore::open_shard(std::uint64_t parameter, int flags, const char* verb, int& fd,
                                  std::string_view missing_note) const {
  const auto file = file_of(parameter);
  const std::string name = file.filename().string();
  fd = -1;
  // O_NOFOLLOW: a link is refused, not followed onto another file.
  // O_NONBLOCK: a FIFO neither blocks the open nor any read or write.
  const int opened =
      ::openat(dir_fd_, name.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
  if (opened < 0) {
    const int err = errno;
    if (err == ENOENT)
      return fmt::format("NVMe shard file '{}' of parameter {} is missing{}", file.string(),
                         parameter, missing_note);
    struct stat st {};
    if ((err == ELOOP || err == ENXIO) &&
        ::fstatat(dir_fd_, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0)
      return fmt::format(
          "cannot {} NVMe shard file '{}' of parameter {}: it is {}, not a "
          "regular file; remove it (the folder holds ductile's shard files only)",
          verb, file.string(), parameter, file_type(st.st_mode));
    return fmt::format("cannot {} NVMe shard file '{}' of parameter {}: {}", verb, file.string(),
                       parameter, std::strerror(err));
  }
  Fd owned{opened};
  struct stat st {};
  if (::fstat(opened, &st) != 0)
    return fmt::format("cannot stat NVMe shard file '{}' of parameter {}: {}", file.string(),
                       parameter, std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    return fmt::format(
        "cannot {} NVMe shard file '{}' of parameter {}: it is {}, not a regular "
        "file; remove it (the folder holds ductile's shard files only)",
        verb, file.string(), parameter, file_type(st.st_mode));
  if (st.st_uid != ::geteuid())
    return fmt::format(
        "cannot {} NVMe shard file '{}' of parameter {}: it is owned by user {}, "
        "not by this process's user {}; remove it",
        verb, file.string(), parameter, st.st_uid, ::geteuid());
  // A regular file: O_NONBLOCK changes none of its reads or writes.
  fd = opened;
  owned.fd = -1;
  return {};
}

std::string NvmeStore::read_file(std::uint64_t parameter, void* data, std::size_t bytes) const {
  const auto file = file_of(parameter);
  Fd f;
  const std::string note = fmt::format(" (expected {} bytes)", bytes);
  if (auto problem = open_shard(parameter, O_RDONLY, "read", f.fd, note); !problem.empty())
    return problem;
  struct stat st {};
  if (::fstat(f.fd, &st) != 0)
    return fmt::format("cannot stat NVMe shard file '{}' of parameter {}: {}", file.string(),
                       parameter, std::strerror(errno));
  const auto size = static_cast<std::uintmax_t>(st.st_size);
  if (size != bytes)
    return fmt::format("NVMe shard file '{}' of parameter {} has {} bytes, expected {} ({})",
                       file.string(), parameter, size, bytes,
                       size < bytes ? "short file" : "file too long");
  auto* out = static_cast<char*>(data);
  std::size_t done = 0;
  while (done < bytes) {
    ssize_t n = ::pread(f.fd, out + done, bytes - done, static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return fmt::format("cannot read NVMe shard file '{}' of parameter {}: {}", file.string(),
                         parameter, std::strerror(errno));
    }
    if (n == 0)
      return fmt::format("NVMe shard file '{}' of parameter {} ended after {} bytes, expected {}",
                         file.string(), parameter, done, bytes);
    done += static_cast<std::size_t>(n);
  }
  return {};
}

NvmeStore::NvmeStore(std::filesystem::path root, int rank)
    : dir_(root / fmt::format("rank{}", rank)) {
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  if (ec)
    throw Error(ErrorKind::io, fmt::format("[zero] nvme_path: cannot create directory '{}': {}",
                                           root.string(), ec.message()));
  dir_fd_ = open_private_folder(dir_);
  thread_ = std::thread([this] { run(); });
}

NvmeStore::~NvmeStore() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
  ::close(dir_fd_);
}

std::filesystem::path NvmeStore::file_of(std::uint64_t parameter) const {
  return dir_ / fmt::format("param_{}.shard", parameter);
}

void NvmeStore::create(std::uint64_t parameter, std::size_t bytes) {
  auto file = file_of(parameter);
  check_size(file, bytes);
  Fd f;
  if (auto problem = open_shard(parameter, O_WRONLY | O_CREAT, "create", f.fd); !problem.empty())
    throw Error(ErrorKind::io, problem);
  // Emptied first, then sized: a sparse file of zeros, whatever it held.
  if (::ftruncate(f.fd, 0) != 0 || ::ftruncate(f.fd, static_cast<off_t>(bytes)) != 0)
    throw Error(ErrorKind::io, fmt::format("cannot size NVMe shard file '{}' to {} bytes: {}",
                                           file.string(), bytes, std::strerror(errno)));
}

void NvmeStore::write(std::uint64_t parameter, const void* data, std::size_t bytes) {
  auto file = file_of(parameter);
  check_size(file, bytes);
  Fd f;
  if (auto problem = open_shard(parameter, O_WRONLY | O_CREAT, "write", f.fd); !problem.empty())
    throw Error(ErrorKind::io, problem);
  const auto* in = static_cast<const char*>(data);
  std::size_t done = 0;
  while (done < bytes) {
    ssize_t n = ::pwrite(f.fd, in + done, bytes - done, static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(ErrorKind::io,
                  fmt::format("cannot write NVMe shard file '{}' of parameter {}: {}",
                              file.string(), parameter, std::strerror(errno)));
    }
    done += static_cast<std::size_t>(n);
  }
  // Opened without O_TRUNC (the checks come first): cut what a longer
  // content left behind.
  if (::ftruncate(f.fd, static_cast<off_t>(bytes)) != 0)
    throw Error(ErrorKind::io, fmt::format("cannot size NVMe shard file '{}' to {} bytes: {}",
                                           file.string(), bytes, std::strerror(errno)));
}

void NvmeStore::read(std::uint64_t parameter, void* data, std::size_t bytes) const {
  std::string error = read_file(parameter, data, bytes);
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
    job->error = read_file(job->parameter, job->destination, job->bytes);
    {
      std::lock_guard lock(mutex_);
      job->done.store(true, std::memory_order_release);
    }
    done_cv_.notify_all();
  }
}

}  // namespace ductile::zero
