#include "bootstrap.hpp"

#include <cstdint>
#include <cstring>

namespace ductile::accel {

CommunicatorBootstrap::CommunicatorBootstrap(std::shared_ptr<Communicator> communicator,
                                             std::string backend)
    : communicator_(std::move(communicator)), stream_(std::move(backend)) {}

std::vector<std::byte> CommunicatorBootstrap::broadcast(std::span<const std::byte> blob, int root) {
  std::lock_guard lock(mutex_);
  if (root < 0 || root >= communicator_->size())
    throw Error(ErrorKind::invalid_argument, "Bootstrap::broadcast: root " + std::to_string(root) +
                                                 " is not a rank (0.." +
                                                 std::to_string(communicator_->size() - 1) + ")");
  bool is_root = communicator_->rank() == root;
  std::uint64_t length = is_root ? blob.size() : 0;
  communicator_->broadcast(&length, 1, DataType::i64, root, stream_)->wait();
  std::vector<std::byte> result(length);
  if (is_root && length) std::memcpy(result.data(), blob.data(), length);
  // Sent in chunks below the MPI count limit.
  constexpr std::uint64_t kChunk = 1u << 30;
  for (std::uint64_t offset = 0; offset < length; offset += kChunk) {
    std::uint64_t n = std::min(kChunk, length - offset);
    communicator_->broadcast(result.data() + offset, n, DataType::u8, root, stream_)->wait();
  }
  return result;
}

void CommunicatorBootstrap::barrier() {
  std::lock_guard lock(mutex_);
  communicator_->barrier(stream_)->wait();
}

}  // namespace ductile::accel
