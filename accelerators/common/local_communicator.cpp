// The single-process world: every collective is a copy (or nothing) run on
// the stream in order, with no MPI at all.
#include "local_communicator.hpp"

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "checked_communicator.hpp"
#include "completion.hpp"
#include "host_stream.hpp"

namespace ductile::accel {
namespace {

class LocalCommunicator final : public CheckedCommunicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }

 protected:
  std::shared_ptr<CollectiveHandle> do_all_gather(const void* send, void* recv, std::size_t count,
                                                  DataType type, Stream& stream) override {
    return copy(stream, "all_gather", send, recv, count * size_of(type));
  }
  std::shared_ptr<CollectiveHandle> do_all_gather_coalesced(std::span<const GatherItem> items,
                                                            std::size_t, Stream& stream) override {
    std::vector<GatherItem> list(items.begin(), items.end());
    return post(stream, "all_gather_coalesced", [list = std::move(list)] {
      for (const GatherItem& item : list) {
        std::size_t bytes = item.count * size_of(item.type);
        if (bytes && item.send != item.recv) std::memmove(item.recv, item.send, bytes);
      }
    });
  }
  std::shared_ptr<CollectiveHandle> do_reduce_scatter(const void* send, void* recv,
                                                      std::size_t count, DataType type, ReduceOp,
                                                      Stream& stream) override {
    return copy(stream, "reduce_scatter", send, recv, count * size_of(type));
  }
  std::shared_ptr<CollectiveHandle> do_all_reduce(const void* send, void* recv, std::size_t count,
                                                  DataType type, ReduceOp,
                                                  Stream& stream) override {
    return copy(stream, "all_reduce", send, recv, count * size_of(type));
  }
  std::shared_ptr<CollectiveHandle> do_broadcast(void*, std::size_t, DataType, int,
                                                 Stream& stream) override {
    return post(stream, "broadcast", nullptr);
  }
  std::shared_ptr<CollectiveHandle> do_barrier(Stream& stream) override {
    return post(stream, "barrier", nullptr);
  }

 private:
  // `send` to `recv` (`bytes`), unless they are the same buffer.
  static std::shared_ptr<CollectiveHandle> copy(Stream& stream, const char* call, const void* send,
                                                void* recv, std::size_t bytes) {
    return post(stream, call, [=] {
      if (bytes && send != recv) std::memmove(recv, send, bytes);
    });
  }

  static std::shared_ptr<CollectiveHandle> post(Stream& stream, const char* call,
                                                std::function<void()> work) {
    HostStream& host_stream = as_host_stream(stream, call);
    auto handle = std::make_shared<Completion>();
    host_stream.enqueue([call, work = std::move(work), handle](bool failed) {
      if (failed) {
        handle->fail(std::string(call) + " was skipped: earlier work on its stream failed");
        return;
      }
      if (work) work();
      handle->complete();
    });
    return std::make_shared<CompletionHandle>(handle);
  }
};

}  // namespace

std::shared_ptr<Communicator> make_local_communicator() {
  return std::make_shared<LocalCommunicator>();
}

}  // namespace ductile::accel
