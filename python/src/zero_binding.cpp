// _ductile.zero: the configured ZeRO-3 parameter coordinator and the world
// communicator of its accelerator, for ductile.torch.zero3. Buffers cross as
// addresses (int) and byte counts: the Python side owns the torch tensors
// behind them and keeps them alive until the operation using them is done;
// this module never owns a Python buffer. Blocking calls release the GIL.
#include <cstdint>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "ductile/accelerator.hpp"
#include "ductile/parameter_coordinator.hpp"
#include "group_gradients.hpp"
#include "host_world.hpp"
#include "saved_views.hpp"
#include "unit_passes.hpp"

namespace ductile::python {

namespace {

// The enum value Python's `name` stands for (its index in `names`).
template <class Enum, std::size_t N>
Enum named(const std::string& name, const char* const (&names)[N], const char* what,
           const char* refusal) {
  for (std::size_t i = 0; i < N; ++i)
    if (name == names[i]) return static_cast<Enum>(i);
  throw Error(ErrorKind::invalid_argument, fmt::format("zero: {} '{}' {}; valid: {}", what, name,
                                                       refusal, fmt::join(names, ", ")));
}

DataType data_type(const std::string& name) {
  return named<DataType>(name, kDataTypeNames, "element type", "is not supported");
}

ReduceOp reduce_op(const std::string& name) {
  return named<ReduceOp>(name, kReduceOpNames, "reduce op", "is unknown");
}

void* address(std::uintptr_t value) {
  return reinterpret_cast<void*>(value);
}

// A collective in flight, as Python sees it.
struct Pending {
  std::shared_ptr<CollectiveHandle> handle;
  void wait() {
    py::gil_scoped_release release;
    handle->wait();
  }
  bool query() { return handle->query(); }
};

py::dict stats_dict(const CoordinatorStats& s) {
  py::dict d;
  d["trace_mode"] = to_string(s.trace_mode);
  d["trace_length"] = s.trace_length;
  d["step"] = s.step;
  d["passes"] = s.passes;
  d["live_numel"] = s.live_numel;
  d["idle_numel"] = s.idle_numel;
  d["active_numel"] = s.active_numel;
  d["persistent_numel"] = s.persistent_numel;
  d["peak_live_numel"] = s.peak_live_numel;
  d["peak_idle_numel"] = s.peak_idle_numel;
  d["max_live_numel"] = s.max_live_numel;
  d["largest_module_numel"] = s.largest_module_numel;
  d["gathers"] = s.gathers;
  d["demand_gathered_params"] = s.demand_gathered_params;
  d["prefetched_params"] = s.prefetched_params;
  d["gathered_numel"] = s.gathered_numel;
  d["inflight_gathers"] = s.inflight_gathers;
  d["peak_inflight_gathers"] = s.peak_inflight_gathers;
  d["released_params"] = s.released_params;
  d["retained_params"] = s.retained_params;
  d["fetch_wait_ns"] = s.fetch_wait_ns;
  d["trace_invalidations"] = s.trace_invalidations;
  d["trace_warnings"] = s.trace_warnings;
  d["nvme_reads"] = s.nvme_reads;
  d["nvme_prefetch_reads"] = s.nvme_prefetch_reads;
  d["nvme_writes"] = s.nvme_writes;
  d["nvme_buffers_in_use"] = s.nvme_buffers_in_use;
  return d;
}

// The coordinator of a runtime's [zero] section, its accelerator, the
// accelerator's world communicator and one stream for the collectives
// issued from Python (gradient reduce-scatters, all-reduces). A host world
// (a Python communicator, see host_world.hpp) is offered to the accelerator
// before anything else uses it; host_world says whether it was taken.
class ZeroSession {
 public:
  ZeroSession(std::shared_ptr<RuntimeHandle> runtime, py::object host_world)
      : runtime_(std::move(runtime)) {
    std::lock_guard lock(runtime_->mutex);
    auto& rt = runtime_->runtime;
    const std::string& source = rt.config().source_name();
    if (!rt.has(PluginKind::zero))
      throw Error(ErrorKind::config, source +
                                         ": no [zero] section; add one (e.g. [zero] coordinator = "
                                         "\"partitioned\") and an [accelerator] section");
    accel_ = rt.get<Accelerator>();
    if (!host_world.is_none()) {
      auto* host = dynamic_cast<HostWorld*>(accel_.get());
      if (host == nullptr)
        throw Error(ErrorKind::unsupported,
                    source + ": the " + std::string(accel_->backend()) +
                        " accelerator takes no host communicator; set [accelerator] "
                        "communicator = \"mpi\" or run without torch.distributed");
      host_world_ = host->offer_world(make_host_world(
          std::move(host_world), dynamic_cast<NativeStreamHandles*>(accel_.get()), host_waits_));
    }
    zero_ = rt.get<ParameterCoordinator>();
    world_ = accel_->world();
    stream_ = accel_->create_stream();
  }

  ParameterCoordinator& zero() { return *zero_; }
  std::string backend() const { return std::string(accel_->backend()); }
  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
  std::string shard_location(ParameterId id) const { return to_string(zero_->shard_location(id)); }
  void move_shard(ParameterId id, const std::string& where) {
    if (where != "device" && where != "host")
      throw Error(ErrorKind::invalid_argument, "zero: move_shard(" + std::to_string(id) +
                                                   ", where=\"" + where +
                                                   "\"); valid: \"device\", \"host\"");
    zero_->move_shard(id, where == "host" ? ShardLocation::host : ShardLocation::device);
  }
  void register_group(ParameterId id, const std::vector<std::size_t>& member_numels,
                      const std::string& type) {
    std::size_t numel = 0;
    for (std::size_t n : member_numels) numel += n;
    zero_->register_group({id, numel, data_type(type)}, member_numels);
  }
  bool host_world() const { return host_world_; }
  const HostWorldWaits& host_waits() const { return *host_waits_; }

  // The collectives below read tensors the framework wrote on its compute
  // stream (a gradient): with one set, they start after its work so far.
  Pending reduce_scatter(std::uintptr_t send, std::uintptr_t recv, std::size_t count,
                         const std::string& type, const std::string& op) {
    after_compute();
    return {world_->reduce_scatter(address(send), address(recv), count, data_type(type),
                                   reduce_op(op), *stream_)};
  }
  Pending all_reduce(std::uintptr_t send, std::uintptr_t recv, std::size_t count,
                     const std::string& type, const std::string& op) {
    after_compute();
    return {world_->all_reduce(address(send), address(recv), count, data_type(type), reduce_op(op),
                               *stream_)};
  }
  Pending all_gather(std::uintptr_t send, std::uintptr_t recv, std::size_t count,
                     const std::string& type) {
    after_compute();
    return {world_->all_gather(address(send), address(recv), count, data_type(type), *stream_)};
  }
  Pending broadcast(std::uintptr_t buffer, std::size_t count, const std::string& type, int root) {
    after_compute();
    return {world_->broadcast(address(buffer), count, data_type(type), root, *stream_)};
  }

  // The framework's compute stream (a native handle: torch's current CUDA
  // stream), given to the coordinator (gathers ordered with events, copies
  // freed after its work) and used to order the collectives above.
  void set_compute_stream(std::uintptr_t native) {
    auto* streams = dynamic_cast<NativeStreams*>(accel_.get());
    if (streams == nullptr)
      throw Error(ErrorKind::unsupported, "zero: the " + std::string(accel_->backend()) +
                                              " accelerator cannot wrap a framework's stream");
    if (compute_stream_ && native == compute_native_) return;
    compute_stream_ = streams->wrap_native_stream(reinterpret_cast<void*>(native));
    compute_native_ = native;
    zero_->set_compute_stream(compute_stream_);
  }

  py::dict gather_memory() const {
    GatherMemoryStats m = zero_->gather_memory();
    py::dict d;
    d["allocations"] = m.allocations;
    d["reuses"] = m.reuses;
    d["frees"] = m.frees;
    d["in_use_bytes"] = m.in_use_bytes;
    d["idle_bytes"] = m.idle_bytes;
    d["high_water_bytes"] = m.high_water_bytes;
    return d;
  }
  void barrier() {
    auto handle = world_->barrier(*stream_);
    py::gil_scoped_release release;
    handle->wait();
  }

 private:
  std::shared_ptr<RuntimeHandle> runtime_;
  std::shared_ptr<Accelerator> accel_;
  std::shared_ptr<ParameterCoordinator> zero_;
  bool host_world_ = false;  // the world is the host's communicator
  std::shared_ptr<HostWorldWaits> host_waits_ = std::make_shared<HostWorldWaits>();
  void after_compute() {
    if (!compute_stream_) return;
    if (!compute_done_) compute_done_ = accel_->create_event();
    compute_done_->record(*compute_stream_);
    stream_->wait_event(*compute_done_);
  }

  std::shared_ptr<Communicator> world_;
  std::shared_ptr<Stream> stream_;
  std::shared_ptr<Stream> compute_stream_;  // the framework's (set_compute_stream)
  std::uintptr_t compute_native_ = 0;
  std::shared_ptr<Event> compute_done_;
};

// A writable memoryview over host memory the coordinator owns (cpu backend):
// torch.frombuffer() makes a tensor over it without copying.
py::memoryview host_view(std::uintptr_t pointer, std::size_t bytes) {
  if (pointer == 0) throw Error(ErrorKind::invalid_argument, "zero: host_view of a null address");
  return py::memoryview::from_memory(address(pointer), static_cast<py::ssize_t>(bytes), false);
}

}  // namespace

void register_zero(py::module_& m) {
  py::class_<Pending>(m, "Pending", "A collective in flight.")
      .def("wait", &Pending::wait, "Blocks (GIL released) until done; raises on failure.")
      .def("query", &Pending::query, "True when done; never blocks.");

  using Z = ZeroSession;
  py::class_<Z, std::shared_ptr<Z>>(
      m, "Session", "The [zero] coordinator of a runtime and its accelerator's world communicator.")
      .def(py::init<std::shared_ptr<RuntimeHandle>, py::object>(), py::arg("runtime"),
           py::arg("host_world") = py::none())
      .def_property_readonly("backend", &Z::backend)
      .def_property_readonly("host_world", &Z::host_world)
      .def_property_readonly("rank", &Z::rank)
      .def_property_readonly("size", &Z::size)
      .def("shard_location", &Z::shard_location, py::arg("id"))
      .def("move_shard", &Z::move_shard, py::arg("id"), py::arg("where"),
           py::call_guard<py::gil_scoped_release>())
      .def("register_group", &Z::register_group, py::arg("id"), py::arg("member_numels"),
           py::arg("dtype"))
      .def(
          "register_parameter",
          [](Z& z, ParameterId id, std::size_t numel, const std::string& type) {
            z.zero().register_parameter({id, numel, data_type(type)});
          },
          py::arg("id"), py::arg("numel"), py::arg("dtype"))
      .def(
          "register_module",
          [](Z& z, ModuleId id, const std::vector<ParameterId>& params) {
            z.zero().register_module(id, params);
          },
          py::arg("id"), py::arg("parameters"))
      .def("shard_numel", [](Z& z, ParameterId id) { return z.zero().shard_numel(id); })
      .def("set_shard", [](Z& z, ParameterId id, std::uintptr_t data,
                           std::size_t bytes) { z.zero().set_shard(id, address(data), bytes); })
      .def("set_full", [](Z& z, ParameterId id, std::uintptr_t data,
                          std::size_t bytes) { z.zero().set_full(id, address(data), bytes); })
      .def("read_shard", [](Z& z, ParameterId id, std::uintptr_t out,
                            std::size_t bytes) { z.zero().read_shard(id, address(out), bytes); })
      .def("shard_data",
           [](Z& z, ParameterId id) {
             return reinterpret_cast<std::uintptr_t>(z.zero().shard_data(id));
           })
      .def("shard_written", [](Z& z, ParameterId id) { z.zero().shard_written(id); })
      .def(
          "staging_bytes_bound",
          [](Z& z, std::size_t largest_shard_numel, std::size_t element_size) {
            return z.zero().staging_bytes_bound(largest_shard_numel, element_size);
          },
          py::arg("largest_shard_numel"), py::arg("element_size"))
      .def(
          "fetch", [](Z& z, ModuleId id) { z.zero().fetch(id); }, py::arg("module"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "release", [](Z& z, ModuleId id) { z.zero().release(id); }, py::arg("module"))
      .def(
          "end_step", [](Z& z) { z.zero().end_step(); }, py::call_guard<py::gil_scoped_release>())
      .def(
          "release_all", [](Z& z, bool persistent) { z.zero().release_all(persistent); },
          py::arg("include_persistent"), py::call_guard<py::gil_scoped_release>())
      .def("progress", [](Z& z) { z.zero().progress(); })
      .def("status", [](Z& z, ParameterId id) { return to_string(z.zero().status(id)); })
      .def("is_persistent", [](Z& z, ParameterId id) { return z.zero().is_persistent(id); })
      .def("full_data",
           [](Z& z, ParameterId id) {
             return reinterpret_cast<std::uintptr_t>(z.zero().full_data(id));
           })
      .def("read_full", [](Z& z, ParameterId id, std::uintptr_t out,
                           std::size_t bytes) { z.zero().read_full(id, address(out), bytes); })
      .def("trace", [](Z& z) { return z.zero().trace(); })
      .def_property_readonly("trace_mode",
                             [](Z& z) { return std::string(to_string(z.zero().trace_mode())); })
      .def("stats",
           [](Z& z) {
             py::dict d = stats_dict(z.zero().stats());
             // Waits inside the host world's planned gathers (C++: no
             // Python profiler sees them).
             d["host_world_waits"] = z.host_waits().waits.load();
             d["host_world_polls"] = z.host_waits().polls.load();
             d["host_world_exchanges"] = z.host_waits().exchanges.load();
             return d;
           })
      .def("check_invariants", [](Z& z) { z.zero().check_invariants(); })
      .def("reduce_scatter", &Z::reduce_scatter, py::arg("send"), py::arg("recv"), py::arg("count"),
           py::arg("dtype"), py::arg("op") = "sum")
      .def("all_reduce", &Z::all_reduce, py::arg("send"), py::arg("recv"), py::arg("count"),
           py::arg("dtype"), py::arg("op") = "sum")
      .def("all_gather", &Z::all_gather, py::arg("send"), py::arg("recv"), py::arg("count"),
           py::arg("dtype"))
      .def("broadcast", &Z::broadcast, py::arg("buffer"), py::arg("count"), py::arg("dtype"),
           py::arg("root") = 0)
      .def("barrier", &Z::barrier)
      .def("set_compute_stream", &Z::set_compute_stream, py::arg("native"))
      .def("gather_memory", &Z::gather_memory)
      .def("trim_gather_memory", [](Z& z) { z.zero().trim_gather_memory(); });

  register_group_state(m);
  register_saved_views(m);
  register_unit_passes(m);
  register_group_gradients(m);
  m.def("direct_gather", &issue_direct_gather, py::arg("group"), py::arg("rank"), py::arg("size"),
        py::arg("out"), py::arg("inp"), py::arg("tag"),
        "Issues an all-gather of `inp` into `out` over a torch ProcessGroup by direct exchange "
        "(sends and receives with `tag`); returns the messages' works (see host_world.hpp).");
  m.def("host_view", &host_view, py::arg("address"), py::arg("bytes"),
        "A writable memoryview over host memory owned by the coordinator (cpu backend).");
}

}  // namespace ductile::python
