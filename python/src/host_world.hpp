// A ductile::Communicator over the host framework's communicator, which
// Python implements (ductile.torch.zero3's TorchWorld, over
// torch.distributed's process group) as a HostCommunicator, offered to the
// accelerator as its world (ductile::HostWorld), so that the C++
// coordinator's gathers run on it.
//
// The two sides meet through typed objects only: the world's facts (rank,
// size, kind, group, direct exchange) are HostCommunicator's, given once
// when Python constructs it; the calls C++ makes into Python are its
// virtual methods, overridden in Python; each returns a HostWork (query()
// never blocks, wait()), and a gather plan is a list of GatherRun. Buffers
// cross as addresses (int); dtype and op are names ("float32", "sum").
//
// Every call also gets, last, the stream it is issued on: with `streams`
// (the accelerator's NativeStreamHandles: cuda), that stream's native
// handle as an int, and the Python side orders its collective after the
// stream's work and the stream's later work after the collective (its
// outputs unpacked on that stream too), so an event recorded on the stream
// after the call marks the collective's end and the host never waits.
// Without (host streams: cpu), None: the stream is synchronised first when
// busy, and the output is complete when the handle is (query() true or
// wait() returned).
//
// Planned gathers: a coalesced gather on host streams is issued here, not
// in Python: gather_plan is asked once per distinct item list and returns
// its runs (GatherRun) over the coordinator's buffers; each time those
// items come again, each run's send (`sends` joined with torch.cat, or
// cloned) is gathered with the world's gather collective (gather_collective
// (out, send, group=group, async_op=True)), or by direct exchange, into
// `recv`, or into a scratch buffer copied out into `outs` (torch's
// split_with_sizes_copy) once the work completes (query() true or wait()).
// With one rank each run is a copy of the send into `recv` (none when they
// are the same memory), done before the call returns. The plans are kept
// by item list (4096 at most: the coordinator reuses a few buffers); a
// handle in flight keeps its plan.
//
// Threading: any thread; every call takes the GIL for the Python part and
// releases it while it synchronises a stream. Errors: a Python exception,
// or a handle that is not a HostWork, becomes ductile::Error(communication)
// naming the call. Ownership: holds
// a reference to the Python object; handles hold their work objects, and
// both are dropped under the GIL (or leaked once the interpreter is
// finalising).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

#include "ductile/accelerator.hpp"

namespace ductile::python {

// The names Python gives element types and reduce ops ("float32", "sum"),
// indexed by the enums' values.
inline constexpr const char* kDataTypeNames[] = {"float32", "float64", "float16", "bfloat16",
                                                 "int32",   "int64",   "uint8"};
inline constexpr const char* kReduceOpNames[] = {"sum", "prod", "min", "max"};

// A collective in flight that a HostCommunicator issued: Python's handles
// (zero3's Work, its exchanges, Done) subclass it as
// _ductile.zero.HostWork and override both calls.
//
// Threading: called with the GIL held. Errors: Python's, as
// py::error_already_set. Ownership: Python's object owns this one; C++
// keeps the Python object while it uses it.
class HostWork {
 public:
  HostWork() = default;
  virtual ~HostWork() = default;
  HostWork(const HostWork&) = delete;
  HostWork& operator=(const HostWork&) = delete;

  // True once the collective is complete; never blocks.
  virtual bool query() = 0;
  // Returns once the collective is complete.
  virtual void wait() = 0;
};

// One collective of a planned coalesced gather (see above), as
// HostCommunicator::gather_plan makes it (Python constructs it as
// _ductile.zero.GatherRun): tensors over the coordinator's buffers.
// Threading and ownership: Python objects, touched and dropped under the
// GIL.
struct GatherRun {
  pybind11::object send;   // this rank's shard (a tensor), or None: `sends` are joined
  pybind11::object sends;  // the shards of several small groups (a list), or None
  pybind11::object recv;   // the output, when `outs` is None: gathered straight into it
  pybind11::object outs;   // else the members' places ((world, count) views), with
  pybind11::object sizes;  // their counts (a list): copied out of a (world, total) scratch
  std::int64_t total = 0;  // elements a rank sends
  bool clone = false;      // the send lies in the output: copied first
};

// The host framework's communicator, implemented in Python
// (_ductile.zero.HostCommunicator, subclassed by TorchWorld): its facts,
// given once at construction, and the calls C++ makes into it.
//
// The *_at calls issue a collective over the coordinator's memory at once
// and return its handle, a HostWork; `stream` is the native stream handle
// (an int) or None (see above). gather_plan returns the runs of a
// coalesced gather of `items` ((send, recv, count, dtype) tuples).
//
// Threading: every call with the GIL held; the facts are read from any
// thread. Errors: construction throws ductile::Error(invalid_argument) for
// a rank outside [0, size) or a size under 1; the calls raise Python's
// exceptions (py::error_already_set). Ownership: the Python object owns
// this one; the facts' Python objects are dropped with it, under the GIL.
class HostCommunicator {
 public:
  // `group`: the torch ProcessGroup, or None for the default group (looked
  // up at each use, never held). `gather_collective`: torch's all-gather
  // into a tensor, for planned gathers. `direct_exchange`: gathers go by
  // direct exchange (issue_direct_gather) with `direct_tag`.
  HostCommunicator(int rank, int size, std::string kind, pybind11::object group,
                   pybind11::object gather_collective, bool direct_exchange, int direct_tag);
  virtual ~HostCommunicator() = default;
  HostCommunicator(const HostCommunicator&) = delete;
  HostCommunicator& operator=(const HostCommunicator&) = delete;

  virtual pybind11::object all_gather_at(std::uintptr_t send, std::uintptr_t recv,
                                         std::size_t count, const char* dtype,
                                         pybind11::object stream) = 0;
  virtual pybind11::object all_gather_coalesced_at(pybind11::list items,
                                                   pybind11::object stream) = 0;
  virtual pybind11::object reduce_scatter_at(std::uintptr_t send, std::uintptr_t recv,
                                             std::size_t count, const char* dtype, const char* op,
                                             pybind11::object stream) = 0;
  virtual pybind11::object all_reduce_at(std::uintptr_t send, std::uintptr_t recv,
                                         std::size_t count, const char* dtype, const char* op,
                                         pybind11::object stream) = 0;
  virtual pybind11::object broadcast_at(std::uintptr_t buffer, std::size_t count, const char* dtype,
                                        int root, pybind11::object stream) = 0;
  virtual pybind11::object barrier_async(pybind11::object stream) = 0;
  virtual std::vector<GatherRun> gather_plan(pybind11::list items) = 0;

  const int rank;
  const int size;
  const std::string kind;  // shown in errors: "torch.distributed (gloo)"
  const pybind11::object group;
  const pybind11::object gather_collective;
  const bool direct_exchange;
  const int direct_tag;
};

// The host's waits inside planned gathers, which no Python profiler sees:
// `waits`, the works waited for (Work.wait(): a collective's, or each
// message of a direct exchange); `polls`, the completion checks
// (Work.is_completed()); `exchanges`, the gathers issued as direct
// exchanges instead of collectives (TorchWorld.direct_exchange). Written by
// any thread.
struct HostWorldWaits {
  std::atomic<std::uint64_t> waits{0};
  std::atomic<std::uint64_t> polls{0};
  std::atomic<std::uint64_t> exchanges{0};
};

// A gather by direct exchange (TorchWorld.direct_exchange, gloo;
// python/ductile/torch/zero3/_world.py says why): `send` (a
// tensor of n elements) is copied into its place in `out` (a 1-D tensor of
// size x n, rank order) unless it lies there, then sent from there to every
// other rank, and theirs are received into their places, over `group` (a
// torch ProcessGroup, whose ranks address the messages) with `tag`.
// Returns the messages' Work objects (a send and a receive a peer; none
// when n is 0); the gather is complete once each was waited for. Every
// rank issues its gathers in the same order. The one implementation of the
// exchange: the planned gathers here and DirectGather (bound as
// _ductile.zero.direct_gather) both call it.
//
// Threading: the GIL held. Errors: Python's, as py::error_already_set.
// Ownership: the works keep the tensors alive until they complete; `out`
// and `send` must not be written until then.
pybind11::list issue_direct_gather(const pybind11::object& group, int rank, int size,
                                   const pybind11::object& out, const pybind11::object& send,
                                   int tag);

// `world` must be a HostCommunicator (else ductile::Error(invalid_argument)
// naming its type). `streams` may be null; it must outlive the
// communicator. `waits` (may be null) counts the planned gathers' waits.
std::shared_ptr<Communicator> make_host_world(pybind11::object world, NativeStreamHandles* streams,
                                              std::shared_ptr<HostWorldWaits> waits);

// _ductile.zero.HostWork, GatherRun and HostCommunicator.
void register_host_world(pybind11::module_& m);

}  // namespace ductile::python
