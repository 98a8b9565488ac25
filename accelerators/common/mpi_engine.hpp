// The process's MPI engine: owns MPI's lifetime (when ductile started it)
// and runs a progress thread that posts non-blocking operations in each
// communicator's issue order and polls them to completion. Open MPI does not
// progress non-blocking operations on its own; this thread is what lets a
// posted collective complete while the caller computes or blocks. All of
// ductile's MPI calls are serialised by one lock. Besides the engine thread,
// a thread blocked in wait_helping() posts and polls itself (as MPI_Wait
// would), when MPI's thread level allows; the engine thread then parks.
// A submitting thread posts at once when no other thread is in MPI (the
// peers can start transferring), leaving an operation's local work (the
// copy of its own block) to the next progress round, off its thread.
//
// Scheduling: the engine thread runs as SCHED_BATCH, so being woken does
// not preempt the thread that submitted (on a shared core that thread would
// otherwise lose its core before it starts computing or blocks). While
// something is in flight and no thread waits, it polls continuously,
// yielding between polls; after 20 ms without a completion it sleeps 50 us
// between polls.
//
// Initialisation: the first get() starts the thread, which calls
// MPI_Init_thread(MPI_THREAD_MULTIPLE) unless MPI is already initialised (then
// the host must have asked for MPI_THREAD_MULTIPLE, since its own MPI calls
// run concurrently with the engine's).
// Finalisation: when ductile initialised MPI, an atexit handler stops the
// thread and calls MPI_Finalize, unless a collective is still in flight or
// one has ever timed out or failed in MPI (a peer may be dead: finalize
// would then wait forever for it; mpirun instead sees the process end
// without finalising and ends the job). A collective that failed only
// because the ranks disagreed on its size does not prevent finalising. With
// a timeout, a barrier bounded by the longest communicator timeout first
// checks that every rank reached the end, and a watchdog bounds
// MPI_Finalize itself. When the
// host initialised MPI, the engine stops from a delete callback on
// MPI_COMM_SELF, which MPI_Finalize runs first.
//
// Where the parts live: the engine's thread and progress loop in
// mpi_engine.cpp; MPI's start and end in mpi_lifetime.hpp; the
// communicator table (issue order, release, broken state) in
// mpi_comm_table.hpp; one posted operation's progress (local work, matched
// probes, requests, deadline) in mpi_operation.hpp; datatypes and the fp16
// and bf16 reduction ops in mpi_reduce_ops.hpp.
//
// One engine per process: the engine lives in the shared library
// libductile_accelerator_common.so, which every backend links (see
// accelerators/README.md).
#pragma once

#include "mpi_api.hpp"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "accel_export.hpp"
#include "completion.hpp"
#include "ductile/accelerator.hpp"

namespace ductile::accel {

// What posting one operation produced: its non-blocking MPI requests (none
// is fine), and optionally host work that is part of the operation but need
// not run on the posting thread (an all-gather's copy of the rank's own
// block). The operation completes when the work has run and every request
// has completed; the work runs in the next progress round, on the engine
// thread or a thread waiting for completion.
struct MpiPosting {
  std::vector<MPI_Request> requests;
  std::function<void()> local_work;
  // Point-to-point receives posted only once their message has arrived and
  // holds exactly `count` elements (matched probe, then MPI_Imrecv). Ranks
  // that issued different operations then fail cleanly: a pre-posted receive
  // would silently take a shorter message, and Open MPI 4.1's shared-memory
  // single-copy path writes a longer one past the end of the buffer. The
  // engine probes receives from the same source in posting order.
  struct Receive {
    void* buffer;
    int source;
    int count;
    MPI_Datatype type;
    bool matched = false;
  };
  std::vector<Receive> receives;
  MPI_Comm comm = MPI_COMM_NULL;
  int tag = 0;
};

// Posts one operation on `comm` into `posting`; returns an MPI error code.
using MpiStart = std::function<int(MPI_Comm comm, MpiPosting& posting)>;

class DUCTILE_ACCEL_API MpiEngine {
 public:
  // The engine, started on first call (MPI initialised if needed). Throws
  // Error(communication) if MPI cannot be used. Thread-safe.
  static MpiEngine& get();

  virtual int world_rank() const noexcept = 0;
  virtual int world_size() const noexcept = 0;
  // True when ductile called MPI_Init_thread (and will finalise).
  virtual bool owns_mpi() const noexcept = 0;

  // Collective over MPI_COMM_WORLD: a duplicate communicator whose
  // operations each fail after `timeout_seconds` (0: never). Blocking.
  virtual int create_comm(double timeout_seconds) = 0;
  // The communicator is freed once every sequence number handed out for it
  // has been submitted or skipped and nothing is in flight.
  virtual void release_comm(int comm) noexcept = 0;

  // Issue order: operations of a communicator are posted in the order of
  // their sequence numbers, whatever order they are submitted in.
  virtual std::uint64_t next_sequence(int comm) = 0;
  // `what` names the operation in error messages. `done` completes when
  // the MPI request completes, or fails (timeout, MPI error, broken
  // communicator, shutdown).
  virtual void submit(int comm, std::uint64_t sequence, std::string what, MpiStart start,
                      std::shared_ptr<Completion> done) = 0;
  // Consumes a sequence number without posting anything.
  virtual void skip(int comm, std::uint64_t sequence) = 0;

  // Blocks until `done` completes (rethrowing its failure). While waiting,
  // the calling thread drives MPI progress itself when MPI's thread level
  // allows it, as MPI_Wait would: no hand-off to the engine thread.
  virtual void wait_helping(Completion& done) = 0;

  // Valid after get(): fp16/bf16 use ops created by the engine (see
  // mpi_reduce_ops.hpp; mpi_datatype() gives the datatype).
  virtual MPI_Op reduce_op(DataType type, ReduceOp op) const = 0;

 protected:
  virtual ~MpiEngine() = default;
};

}  // namespace ductile::accel
