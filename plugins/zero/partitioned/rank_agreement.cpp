// Token exchange of the partitioned coordinator; see rank_agreement.hpp.
#include "rank_agreement.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ductile/error.hpp"

namespace ductile::zero {
namespace {

constexpr std::int64_t kTokenFetch = 1;
constexpr std::int64_t kTokenEnd = 2;
constexpr std::size_t kTokenBytes = 4 * sizeof(std::int64_t);

}  // namespace

RankAgreement::RankAgreement(std::shared_ptr<Accelerator> accel, std::shared_ptr<Communicator> comm,
                             std::shared_ptr<Stream> comm_stream)
    : accel_(std::move(accel)), comm_(std::move(comm)), comm_stream_(std::move(comm_stream)) {
  world_ = comm_->size();
  if (world_ == 1) return;
  read_stream_ = accel_->create_stream();
  gathered_ = accel_->create_event();
  all_.resize(4 * static_cast<std::size_t>(world_));
}

RankAgreement::~RankAgreement() {
  try {
    if (pending_) pending_->wait();
    if (read_stream_) read_stream_->synchronize();
    comm_stream_->synchronize();
  } catch (...) {
  }
  if (device_) accel_->deallocate(device_, MemoryKind::device);
}

void* RankAgreement::buffer(std::size_t bytes) {
  if (bytes > device_bytes_) {
    if (device_) {
      comm_stream_->synchronize();
      read_stream_->synchronize();
      accel_->deallocate(device_, MemoryKind::device);
      device_ = nullptr;
    }
    device_ = accel_->allocate(bytes, MemoryKind::device);
    device_bytes_ = bytes;
  }
  return device_;
}

void RankAgreement::agree_fetch(std::uint64_t module, std::uint64_t step) {
  exchange({kTokenFetch, static_cast<std::int64_t>(module), static_cast<std::int64_t>(step), 0},
           {});
}

void RankAgreement::agree_end(std::uint64_t length, std::uint64_t hash,
                              std::span<const std::int64_t> order) {
  exchange({kTokenEnd, static_cast<std::int64_t>(length), static_cast<std::int64_t>(hash), 0},
           order);
}

void RankAgreement::agree_end_later(std::uint64_t length, std::uint64_t hash,
                                    std::span<const std::int64_t> order) {
  if (world_ == 1) return;
  check_pending();
  issue({kTokenEnd, static_cast<std::int64_t>(length), static_cast<std::int64_t>(hash), 0});
  pending_order_.assign(order.begin(), order.end());
}

void RankAgreement::check_pending() {
  if (!pending_) return;
  check(pending_order_);
}

void RankAgreement::exchange(const Token& mine, std::span<const std::int64_t> order) {
  if (world_ == 1) return;
  check_pending();
  issue(mine);
  check(order);
}

// The token goes to the device and is gathered on the communication
// stream, after the gathers issued before it.
void RankAgreement::issue(const Token& mine) {
  mine_ = mine;
  auto* device = static_cast<unsigned char*>(buffer(kTokenBytes * (1 + world_)));
  accel_->copy_async(device, mine_.data(), kTokenBytes, CopyKind::host_to_device, *comm_stream_);
  pending_ = comm_->all_gather(device, device + kTokenBytes, 4, DataType::i64, *comm_stream_);
  gathered_->record(*comm_stream_);
}

// Every rank contributes what it is doing; all ranks see all contributions
// and so throw the same error.
void RankAgreement::check(std::span<const std::int64_t> order) {
  auto handle = std::move(pending_);
  handle->wait();
  read_stream_->wait_event(*gathered_);
  accel_->copy_async(all_.data(), static_cast<unsigned char*>(device_) + kTokenBytes,
                     all_.size() * sizeof(std::int64_t), CopyKind::device_to_host, *read_stream_);
  read_stream_->synchronize();
  bool same = true;
  for (int r = 1; r < world_ && same; ++r)
    same = std::equal(all_.begin(), all_.begin() + 4, all_.begin() + 4 * r);
  if (same) return;
  auto describe = [&](int r) {
    const std::int64_t* t = all_.data() + 4 * r;
    if (t[0] == kTokenFetch)
      return fmt::format("rank {} fetch(module {}) at step {}", r, t[1], t[2]);
    return fmt::format("rank {} end_step() after {} modules", r, t[1]);
  };
  bool all_end = true;
  for (int r = 0; r < world_; ++r)
    all_end = all_end && all_[4 * r] == kTokenEnd && all_[4 * r + 1] == all_[1];
  if (all_end && order.size() == static_cast<std::size_t>(all_[1])) {
    // Same length, different order: compare the orders themselves.
    const std::size_t n = order.size();
    const std::size_t bytes = n * sizeof(std::int64_t);
    auto* device = static_cast<unsigned char*>(buffer(bytes * (1 + world_)));
    accel_->copy_async(device, order.data(), bytes, CopyKind::host_to_device, *comm_stream_);
    comm_->all_gather(device, device + bytes, n, DataType::i64, *comm_stream_)->wait();
    gathered_->record(*comm_stream_);
    read_stream_->wait_event(*gathered_);
    std::vector<std::int64_t> orders(n * static_cast<std::size_t>(world_));
    accel_->copy_async(orders.data(), device + bytes, orders.size() * sizeof(std::int64_t),
                       CopyKind::device_to_host, *read_stream_);
    read_stream_->synchronize();
    for (std::size_t s = 0; s < n; ++s) {
      std::vector<std::string> parts;
      bool differ = false;
      for (int r = 0; r < world_; ++r) {
        parts.push_back(fmt::format("rank {} module {}", r, orders[r * n + s]));
        differ = differ || orders[r * n + s] != orders[s];
      }
      if (differ)
        throw Error(ErrorKind::communication,
                    fmt::format("zero: ranks recorded different module orders; first difference "
                                "at step {}: {}",
                                s, fmt::join(parts, ", ")),
                    "ZeroTraceMismatch");
    }
  }
  std::vector<std::string> parts;
  for (int r = 0; r < world_; ++r) parts.push_back(describe(r));
  throw Error(ErrorKind::communication,
              fmt::format("zero: rank-order mismatch, the ranks made different calls: {}",
                          fmt::join(parts, ", ")),
              "ZeroTraceMismatch");
}

}  // namespace ductile::zero
