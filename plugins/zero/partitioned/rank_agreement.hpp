// Cross-rank agreement for the partitioned coordinator: while a trace is
// recorded, every fetch() and end_step() first all-gathers a small token
// (call, module or pass length, step or pass hash) so that ranks making
// different calls all throw the same error before any mismatched gather.
// Once the trace is complete, the end of a pass is agreed without the host
// waiting: the token's gather is issued at the end of the pass and checked
// at the next agreement (the next end_step(), or a fetch() while
// recording), so a mismatch is reported one pass late.
//
// The tokens travel through device memory (NCCL and a host framework's
// device communicator cannot read host memory) on the coordinator's
// communication stream, so that they keep their place among its gathers;
// they are read back on a stream of their own after an event, so reading
// them never waits for later gathers.
//
// Threading: the coordinator's thread. Errors: throws ductile::Error
// (communication, type "ZeroTraceMismatch") naming every rank's call, or
// whatever the communicator and the accelerator throw. Ownership: owns its
// device buffers, streams and events; the destructor waits for a pending
// gather.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "ductile/accelerator.hpp"

namespace ductile::zero {

class RankAgreement {
 public:
  RankAgreement(std::shared_ptr<Accelerator> accel, std::shared_ptr<Communicator> comm,
                std::shared_ptr<Stream> comm_stream);
  ~RankAgreement();
  RankAgreement(const RankAgreement&) = delete;
  RankAgreement& operator=(const RankAgreement&) = delete;

  // All ranks call fetch(module) at `step` (checks a pending agreement first).
  void agree_fetch(std::uint64_t module, std::uint64_t step);
  // All ranks end a pass of `length` modules with the same order: the hash
  // is compared first; on a mismatch with equal lengths the orders
  // themselves (`order`, module ids) are exchanged to name the first
  // differing step.
  void agree_end(std::uint64_t length, std::uint64_t hash, std::span<const std::int64_t> order);
  // The same agreement, issued now and checked by the next call here.
  void agree_end_later(std::uint64_t length, std::uint64_t hash,
                       std::span<const std::int64_t> order);
  // Checks the agreement agree_end_later() issued, if any (waits for it).
  void check_pending();

 private:
  using Token = std::array<std::int64_t, 4>;
  void issue(const Token& mine);
  void check(std::span<const std::int64_t> order);
  void exchange(const Token& mine, std::span<const std::int64_t> order);
  void* buffer(std::size_t bytes);

  std::shared_ptr<Accelerator> accel_;
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Stream> comm_stream_;
  std::shared_ptr<Stream> read_stream_;
  std::shared_ptr<Event> gathered_;
  int world_ = 1;
  void* device_ = nullptr;  // this rank's token, then every rank's
  std::size_t device_bytes_ = 0;
  Token mine_{};
  std::vector<std::int64_t> all_;
  std::shared_ptr<CollectiveHandle> pending_;
  std::vector<std::int64_t> pending_order_;
};

}  // namespace ductile::zero
