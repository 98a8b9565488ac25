// The engine's communicators: for each, its MPI communicator, its timeout,
// and the operations submitted for it that wait for their turn in issue
// order. Not thread-safe by itself: every call is made under the engine's
// mutex (see mpi_engine.cpp), which also orders the engine thread's waits.
#pragma once

#include "mpi_api.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "completion.hpp"
#include "mpi_engine.hpp"

namespace ductile::accel {

// An operation submitted but not posted yet (or a skipped sequence number).
struct PendingOp {
  std::string what;
  MpiStart start;
  std::shared_ptr<Completion> done;
  bool skipped = false;
};

// An operation whose turn has come: the engine posts it outside the lock.
struct ReadyOp {
  int comm;
  MPI_Comm mpi_comm;
  double timeout;
  PendingOp op;
};

class MpiCommTable {
 public:
  // Id 0: the process's world (MPI_COMM_WORLD or a joined one; the
  // engine's own operations).
  static constexpr int kWorld = 0;

  void add_world(MPI_Comm world);
  // A new communicator without its MPI communicator yet (set_comm()).
  int add(double timeout_seconds);
  void set_comm(int id, MPI_Comm comm);
  // Marks `id` released (it is freed once nothing is left to post or in
  // flight); false for an unknown id.
  bool release(int id);
  bool contains(int id) const { return comms_.count(id) != 0; }
  // Throws Error(internal) for an unknown id.
  std::uint64_t next_sequence(int id);
  // Queues `op` (or a skip) under `sequence`; false for an unknown id.
  bool enqueue(int id, std::uint64_t sequence, PendingOp op);

  // Moves every operation that is next in its communicator's issue order
  // into `ready` (counted in flight); skips are consumed, and operations of
  // a broken communicator fail at once. Then frees released communicators
  // with nothing left.
  void take_ready(std::vector<ReadyOp>& ready);
  // An operation of `id` left flight: completed (`failure` empty) or failed,
  // which breaks the communicator.
  void finished(int id, const std::string& failure);
  // Fails every operation still waiting for its turn (`suffix` ends each
  // message).
  void fail_waiting(const std::string& why, const std::string& suffix);
  // Frees every communicator but the world and forgets them all; broken
  // ones are left to MPI (they may have requests MPI still works on).
  void free_all();

  // The longest timeout of any communicator created (0: none).
  double max_timeout() const { return max_timeout_; }

 private:
  struct Entry {
    MPI_Comm comm = MPI_COMM_NULL;
    double timeout = 0;
    std::uint64_t assigned = 0;   // sequence numbers handed out
    std::uint64_t next_post = 0;  // next sequence number to post
    std::map<std::uint64_t, PendingOp> waiting;
    int in_flight = 0;
    bool released = false;
    std::string broken;  // why the communicator can no longer be used
  };
  void free_released();

  std::map<int, Entry> comms_;
  int next_id_ = 1;
  double max_timeout_ = 0;
};

}  // namespace ductile::accel
