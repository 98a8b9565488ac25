// The MPI communicator over host memory: MpiCommunicator posts non-blocking
// MPI collectives through the MpiEngine. (The single-process world, without
// MPI, is the local communicator: local_communicator.hpp.)
//
// A collective is enqueued on a HostStream: when the stream reaches it, the
// operation is handed to the engine (which posts it in issue order) and the
// stream waits for it to complete before running later work, so later work on
// the stream sees its output. The returned handle completes at the same time.
// Arguments are checked by CheckedCommunicator before the do_* hooks run.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "accel_export.hpp"
#include "checked_communicator.hpp"
#include "completion.hpp"
#include "ductile/accelerator.hpp"
#include "host_stream.hpp"
#include "mpi_engine.hpp"

namespace ductile::accel {

class DUCTILE_ACCEL_API MpiCommunicator final : public CheckedCommunicator {
 public:
  // Up to this many ranks an all-gather is a point-to-point exchange;
  // beyond it, MPI_Iallgather (whose algorithms scale in the rank count).
  static constexpr int kDefaultExchangeMaxRanks = 32;

  // Collective over all ranks. `timeout_seconds` bounds each collective
  // (0: no bound).
  MpiCommunicator(std::string backend, double timeout_seconds,
                  int exchange_max_ranks = kDefaultExchangeMaxRanks);
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

 protected:
  std::shared_ptr<CollectiveHandle> do_all_gather(const void* send, void* recv, std::size_t count,
                                                  DataType type, Stream& stream) override;
  std::shared_ptr<CollectiveHandle> do_all_gather_coalesced(std::span<const GatherItem> items,
                                                            std::size_t total_bytes,
                                                            Stream& stream) override;
  std::shared_ptr<CollectiveHandle> do_reduce_scatter(const void* send, void* recv,
                                                      std::size_t count, DataType type, ReduceOp op,
                                                      Stream& stream) override;
  std::shared_ptr<CollectiveHandle> do_all_reduce(const void* send, void* recv, std::size_t count,
                                                  DataType type, ReduceOp op,
                                                  Stream& stream) override;
  std::shared_ptr<CollectiveHandle> do_broadcast(void* buffer, std::size_t count, DataType type,
                                                 int root, Stream& stream) override;
  std::shared_ptr<CollectiveHandle> do_barrier(Stream& stream) override;

 private:
  // `prepare` runs on the stream before posting, `finish` after completion
  // (both optional).
  std::shared_ptr<CollectiveHandle> post(Stream& stream, const char* call, MpiStart start,
                                         std::function<void()> prepare = nullptr,
                                         std::function<void()> finish = nullptr);

  std::string backend_;
  int id_ = -1;
  int rank_ = 0, size_ = 1;
  int exchange_max_ranks_;
};

}  // namespace ductile::accel
