// A ductile::Communicator over a Python object: the host framework's
// communicator (ductile.torch.zero3's TorchWorld, over torch.distributed's
// process group), offered to the accelerator as its world
// (ductile::HostWorld), so that the C++ coordinator's gathers run on it.
//
// The Python object provides `rank` and `size` (ints, read once), and
// all_gather_at(send, recv, count, dtype), all_gather_coalesced_at([(send,
// recv, count, dtype), ...]), reduce_scatter_at(send, recv, count, dtype,
// op), all_reduce_at(send, recv, count, dtype, op), broadcast_at(buffer,
// count, dtype, root) and barrier_async(), each issuing the collective and
// returning a handle with query() (never blocks) and wait(). Buffers cross
// as addresses (int); dtype and op are names ("float32", "sum").
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
// Planned gathers: when the object also has gather_plan(items) and
// `gather_collective` and `group` (TorchWorld does), a coalesced gather on
// host streams is issued here, not in Python: gather_plan is asked once per distinct item list and
// returns, per collective, (send, sends, recv, outs, sizes, total, clone) tensors over the
// coordinator's buffers (see TorchWorld.gather_plan); each time those items come again, the send
// (`sends` joined with torch.cat, or cloned) is gathered with gather_collective(out, send,
// group=group, async_op=True) into `recv`, or into a scratch buffer copied out into `outs` (torch's
// split_with_sizes_copy) once the work completes (query() true or wait()).
// With one rank each run is a copy of the send into `recv` (none when they
// are the same memory), done before the call returns. The plans are kept by item list (4096 at
// most: the coordinator reuses a few buffers); a handle in flight keeps its plan.
//
// Threading: any thread; every call takes the GIL for the Python part and
// releases it while it synchronises a stream. Errors: a Python exception
// becomes ductile::Error(communication) naming the call. Ownership: holds
// a reference to the Python object; handles hold their work objects, and
// both are dropped under the GIL (or leaked once the interpreter is
// finalising).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include <pybind11/pybind11.h>

#include "ductile/accelerator.hpp"

namespace ductile::python {

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
// python/ductile/torch/zero3/_direct_exchange.py says why): `send` (a
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

// `streams` may be null; it must outlive the communicator. `waits` (may be
// null) counts the planned gathers' waits.
std::shared_ptr<Communicator> make_host_world(pybind11::object world, NativeStreamHandles* streams,
                                              std::shared_ptr<HostWorldWaits> waits);

}  // namespace ductile::python
