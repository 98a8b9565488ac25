// MappedFile, the read-only mapping (mmap) every lengths reader reads its
// file through, in place rather than copied into a buffer. A path that is not
// a regular file, or is larger than a lengths file may be
// (kMaxLengthsFileBytes), is refused before anything is mapped.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include <fmt/format.h>

#include "batching/lengths_internal.hpp"
#include "ductile/core/files.hpp"

namespace ductile::pipeline::detail {

namespace fs = std::filesystem;

MappedFile::MappedFile(const fs::path& file) : file_(file) {
  std::error_code ec;
  if (!fs::exists(file, ec))
    throw Error(ErrorKind::not_found, fmt::format("{}: no such file", file.string()));
  // Non-blocking open: a FIFO must not wait for a writer before it is refused.
  fd_ = core::open_for_reading(file);
  if (fd_ < 0) throw io_error(file, fmt::format("cannot open: {}", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    ::close(fd_);
    throw io_error(file, fmt::format("cannot stat: {}", std::strerror(errno)));
  }
  if (auto problem = core::regular_file_problem(st, kMaxLengthsFileBytes, "lengths file");
      !problem.empty()) {
    ::close(fd_);
    throw io_error(file, problem);
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
    if (p == MAP_FAILED) {
      ::close(fd_);
      throw io_error(file, fmt::format("cannot map: {}", std::strerror(errno)));
    }
    data_ = static_cast<const unsigned char*>(p);
  }
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<unsigned char*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace ductile::pipeline::detail
