#include "mpi_communicator.hpp"

#include "mpi_reduce_ops.hpp"

#include <climits>
#include <cstring>
#include <vector>

namespace ductile::accel {

namespace {

// The handle of a collective that completes when MPI does: waiting drives
// progress from the waiting thread.
class MpiHandle final : public CollectiveHandle {
 public:
  MpiHandle(std::shared_ptr<Completion> completion, MpiEngine* engine)
      : completion_(std::move(completion)), engine_(engine) {}
  bool query() override { return completion_->done(); }
  void wait() override { engine_->wait_helping(*completion_); }

 private:
  std::shared_ptr<Completion> completion_;
  MpiEngine* engine_;
};

// The end of a collective's stream task: waits for the posted operation,
// runs `finish` (optional) and completes `handle`, or fails it and rethrows
// (which fails the stream).
void complete_after(Completion& posted, const std::function<void()>& finish, Completion& handle) {
  try {
    posted.wait();
    if (finish) finish();
  } catch (const std::exception& e) {
    handle.fail(e.what());
    throw;
  }
  handle.complete();
}

int as_int(std::size_t count) {
  return static_cast<int>(count);
}

// An MpiStart for an MPI call that makes one request.
template <class Call>
MpiStart one_request(Call call) {
  return [call = std::move(call)](MPI_Comm comm, MpiPosting& posting) {
    return call(comm, &posting.requests.emplace_back(MPI_REQUEST_NULL));
  };
}

constexpr int kExchangeTag = 1;  // the communicator is private to the engine

// The all-gather as point-to-point messages: a receive from every peer into
// its block (posted by the engine once the message has arrived and its size
// checked), this rank's block sent to every peer, and its own block copied
// into place (`send` null: already in place) as the operation's local work,
// off the posting thread. Measured with Open MPI 4.1 on shared memory, 2
// ranks: MPI_Iallgather (libnbc) issued back to back takes 1.5-6x as long as
// the blocking MPI_Allgather for 0.5-2 MiB, while this exchange takes the
// same time (one single-copy transfer per block).
int post_exchange(const void* send, char* recv, int count, MPI_Datatype type, std::size_t block,
                  int rank, int size, MPI_Comm comm, MpiPosting& posting) {
  auto& requests = posting.requests;
  requests.reserve(2 * static_cast<std::size_t>(size - 1));
  posting.comm = comm;
  posting.tag = kExchangeTag;
  posting.receives.reserve(static_cast<std::size_t>(size - 1));
  for (int step = 1; step < size; ++step) {
    int from = (rank - step + size) % size;
    posting.receives.push_back({recv + static_cast<std::size_t>(from) * block, from, count, type});
  }
  char* own = recv + static_cast<std::size_t>(rank) * block;
  const void* mine = send != nullptr ? send : own;
  for (int step = 1; step < size; ++step) {
    int to = (rank + step) % size;
    int rc = MPI_Isend(mine, count, type, to, kExchangeTag, comm,
                       &requests.emplace_back(MPI_REQUEST_NULL));
    if (rc != MPI_SUCCESS) return rc;
  }
  if (send != nullptr && block > 0)
    posting.local_work = [own, send, block] { std::memcpy(own, send, block); };
  return MPI_SUCCESS;
}

// Posts an all-gather (`send` null: in place): the point-to-point exchange
// up to `exchange_max_ranks` ranks, else MPI_Iallgather.
int start_all_gather(const void* send, char* recv, int count, MPI_Datatype type, std::size_t block,
                     int rank, int size, int exchange_max_ranks, MPI_Comm comm,
                     MpiPosting& posting) {
  if (size <= exchange_max_ranks)
    return post_exchange(send, recv, count, type, block, rank, size, comm, posting);
  return MPI_Iallgather(send != nullptr ? send : MPI_IN_PLACE, count, type, recv, count, type, comm,
                        &posting.requests.emplace_back(MPI_REQUEST_NULL));
}

}  // namespace

// ---------------------------------------------------------------- MPI

MpiCommunicator::MpiCommunicator(std::string backend, double timeout_seconds,
                                 int exchange_max_ranks)
    : CheckedCommunicator(static_cast<std::size_t>(INT_MAX)),
      backend_(std::move(backend)),
      exchange_max_ranks_(exchange_max_ranks) {
  MpiEngine& engine = MpiEngine::get();
  id_ = engine.create_comm(timeout_seconds);
  rank_ = engine.world_rank();
  size_ = engine.world_size();
}

MpiCommunicator::~MpiCommunicator() {
  if (id_ >= 0) MpiEngine::get().release_comm(id_);
}

std::shared_ptr<CollectiveHandle> MpiCommunicator::post(Stream& stream, const char* call,
                                                        MpiStart start,
                                                        std::function<void()> prepare,
                                                        std::function<void()> finish) {
  HostStream& host_stream = as_host_stream(stream, call);
  MpiEngine* engine = &MpiEngine::get();
  auto posted = std::make_shared<Completion>();
  // Without a finishing step the handle completes when MPI does, saving a
  // thread hand-off.
  auto handle = (prepare || finish) ? std::make_shared<Completion>() : posted;
  auto collective_handle = [&]() -> std::shared_ptr<CollectiveHandle> {
    if (handle == posted) return std::make_shared<MpiHandle>(handle, engine);
    return std::make_shared<CompletionHandle>(handle);
  };
  std::uint64_t sequence = engine->next_sequence(id_);
  std::string what = std::string(call) + " (" + backend_ + " communicator, collective #" +
                     std::to_string(sequence) + ")";
  if (!prepare && host_stream.idle_and_healthy()) {
    // Fast path: nothing on the stream precedes this collective, so its
    // inputs are ready now; hand it to the engine at once (the engine
    // thread or a waiting caller posts it) and let the stream only wait for
    // its completion (saves a hand-off to the stream's worker).
    engine->submit(id_, sequence, what, std::move(start), posted);
    host_stream.enqueue_lazy([posted, finish = std::move(finish),
                              handle](bool) { complete_after(*posted, finish, *handle); },
                             posted);
    return collective_handle();
  }
  host_stream.enqueue([engine, id = id_, sequence, what, prepare = std::move(prepare),
                       start = std::move(start), finish = std::move(finish), posted,
                       handle](bool failed) {
    if (failed) {
      engine->skip(id, sequence);
      handle->fail(what + " was skipped: earlier work on its stream failed");
      return;
    }
    try {
      if (prepare) prepare();
    } catch (const std::exception& e) {
      engine->skip(id, sequence);
      handle->fail(what + " failed: " + e.what());
      throw;
    }
    engine->submit(id, sequence, what, start, posted);
    complete_after(*posted, finish, *handle);
  });
  return collective_handle();
}

std::shared_ptr<CollectiveHandle> MpiCommunicator::do_all_gather(const void* send, void* recv,
                                                                 std::size_t count, DataType type,
                                                                 Stream& stream) {
  std::size_t block = count * size_of(type);
  // Rank r's input already in place in the output: MPI_IN_PLACE.
  bool in_place =
      count > 0 && send == static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * block;
  MPI_Datatype datatype = mpi_datatype(type);
  return post(stream, "all_gather",
              [=, rank = rank_, size = size_, max_ranks = exchange_max_ranks_](
                  MPI_Comm comm, MpiPosting& posting) {
                return start_all_gather(in_place ? nullptr : send, static_cast<char*>(recv),
                                        as_int(count), datatype, block, rank, size, max_ranks, comm,
                                        posting);
              });
}

std::shared_ptr<CollectiveHandle> MpiCommunicator::do_all_gather_coalesced(
    std::span<const GatherItem> items, std::size_t total, Stream& stream) {
  if (items.size() == 1)
    return do_all_gather(items[0].send, items[0].recv, items[0].count, items[0].type, stream);
  // One gather of all tensors packed back to back; unpacked into each
  // tensor's output afterwards (two host copies, one collective).
  struct Buffers {
    std::vector<GatherItem> items;
    std::unique_ptr<char[]> send, recv;
  };
  auto buffers = std::make_shared<Buffers>();
  buffers->items.assign(items.begin(), items.end());
  int size = size_;
  auto prepare = [buffers, total, size]() {
    buffers->send = std::make_unique_for_overwrite<char[]>(total + 1);
    buffers->recv =
        std::make_unique_for_overwrite<char[]>(total * static_cast<std::size_t>(size) + 1);
    std::size_t offset = 0;
    for (const GatherItem& item : buffers->items) {
      std::size_t bytes = item.count * size_of(item.type);
      if (bytes) std::memcpy(buffers->send.get() + offset, item.send, bytes);
      offset += bytes;
    }
  };
  auto finish = [buffers, total, size]() {
    for (int r = 0; r < size; ++r) {
      std::size_t offset = static_cast<std::size_t>(r) * total;
      for (const GatherItem& item : buffers->items) {
        std::size_t bytes = item.count * size_of(item.type);
        if (bytes)
          std::memcpy(static_cast<char*>(item.recv) + static_cast<std::size_t>(r) * bytes,
                      buffers->recv.get() + offset, bytes);
        offset += bytes;
      }
    }
    buffers->send.reset();
    buffers->recv.reset();
  };
  return post(
      stream, "all_gather_coalesced",
      [buffers, total, rank = rank_, size, max_ranks = exchange_max_ranks_](MPI_Comm comm,
                                                                            MpiPosting& posting) {
        return start_all_gather(buffers->send.get(), buffers->recv.get(), as_int(total), MPI_BYTE,
                                total, rank, size, max_ranks, comm, posting);
      },
      prepare, finish);
}

std::shared_ptr<CollectiveHandle> MpiCommunicator::do_reduce_scatter(const void* send, void* recv,
                                                                     std::size_t count,
                                                                     DataType type, ReduceOp op,
                                                                     Stream& stream) {
  MPI_Datatype datatype = mpi_datatype(type);
  MPI_Op mpi_op = MpiEngine::get().reduce_op(type, op);
  return post(stream, "reduce_scatter", one_request([=](MPI_Comm comm, MPI_Request* request) {
                return MPI_Ireduce_scatter_block(send, recv, as_int(count), datatype, mpi_op, comm,
                                                 request);
              }));
}

std::shared_ptr<CollectiveHandle> MpiCommunicator::do_all_reduce(const void* send, void* recv,
                                                                 std::size_t count, DataType type,
                                                                 ReduceOp op, Stream& stream) {
  MPI_Datatype datatype = mpi_datatype(type);
  MPI_Op mpi_op = MpiEngine::get().reduce_op(type, op);
  bool in_place = send == recv;
  return post(stream, "all_reduce", one_request([=](MPI_Comm comm, MPI_Request* request) {
                return MPI_Iallreduce(in_place ? MPI_IN_PLACE : send, recv, as_int(count), datatype,
                                      mpi_op, comm, request);
              }));
}

std::shared_ptr<CollectiveHandle> MpiCommunicator::do_broadcast(void* buffer, std::size_t count,
                                                                DataType type, int root,
                                                                Stream& stream) {
  MPI_Datatype datatype = mpi_datatype(type);
  return post(stream, "broadcast", one_request([=](MPI_Comm comm, MPI_Request* request) {
                return MPI_Ibcast(buffer, as_int(count), datatype, root, comm, request);
              }));
}

std::shared_ptr<CollectiveHandle> MpiCommunicator::do_barrier(Stream& stream) {
  return post(stream, "barrier", one_request([](MPI_Comm comm, MPI_Request* request) {
                return MPI_Ibarrier(comm, request);
              }));
}

}  // namespace ductile::accel
