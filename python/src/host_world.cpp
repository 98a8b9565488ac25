// The host-supplied world communicator; see host_world.hpp.
#include "host_world.hpp"

#include <Python.h>

#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <pybind11/stl.h>

namespace ductile::python {

namespace py = pybind11;

namespace {

template <std::size_t N>
const char* name_of(auto value, const char* const (&names)[N], const char* what) {
  const auto index = static_cast<std::size_t>(value);
  if (index >= N)
    throw Error(ErrorKind::invalid_argument, fmt::format("host world: unknown {} {}", what, index));
  return names[index];
}

const char* type_name(DataType type) {
  return name_of(type, kDataTypeNames, "element type");
}

const char* op_name(ReduceOp op) {
  return name_of(op, kReduceOpNames, "reduce op");
}

std::uintptr_t address(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}

bool interpreter_alive() {
  return Py_IsInitialized() != 0 && _Py_IsFinalizing() == 0;
}

// A Python object dropped under the GIL, or leaked when Python is gone.
void drop(py::object& object) {
  if (!object) return;
  if (interpreter_alive()) {
    py::gil_scoped_acquire gil;
    object = py::object();
  } else {
    object.release();
  }
}

[[noreturn]] void rethrow(const std::string& what, py::error_already_set& e) {
  std::string message = what + ": " + e.what();
  e.restore();
  PyErr_Clear();
  throw Error(ErrorKind::communication, message);
}

// Runs `f` with the GIL held; a Python exception becomes the ductile::Error
// of rethrow().
template <class F>
auto with_gil(const std::string& what, F&& f) {
  py::gil_scoped_acquire gil;
  try {
    return f();
  } catch (py::error_already_set& e) {
    rethrow(what, e);
  }
}

// The HostWork a call returned, as a handle: `work` must be one (a bug of
// the Python world otherwise). The GIL held.
HostWork& host_work(const py::object& work, const std::string& what) {
  if (!py::isinstance<HostWork>(work))
    throw Error(ErrorKind::communication,
                fmt::format("{}: the host world returned a {}, not a HostWork", what,
                            Py_TYPE(work.ptr())->tp_name));
  return work.cast<HostWork&>();
}

class HostHandle final : public CollectiveHandle {
 public:
  HostHandle(py::object work, std::string what)
      : work_(std::move(work)), what_(std::move(what)), host_(&host_work(work_, what_)) {}
  ~HostHandle() override { drop(work_); }
  HostHandle(const HostHandle&) = delete;
  HostHandle& operator=(const HostHandle&) = delete;

  bool query() override {
    if (!done_) done_ = with_gil(what_, [&] { return host_->query(); });
    return done_;
  }

  void wait() override {
    if (done_) return;
    with_gil(what_, [&] { host_->wait(); });
    done_ = true;
  }

 private:
  py::object work_;
  std::string what_;
  HostWork* host_;  // work_'s
  bool done_ = false;
};

// A shared object holding Python objects, deleted under the GIL from any
// thread (or leaked once the interpreter is finalising).
template <class T>
std::shared_ptr<const T> held_by_python(T* object) {
  return std::shared_ptr<const T>(object, [](const T* p) {
    if (!interpreter_alive()) return;  // leaked: its references cannot be dropped
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// torch's functions a planned gather calls, looked up once per world.
struct GatherOps {
  py::object cat, empty, split_copy;
  // torch.distributed.group, whose WORLD is the default group, looked up at
  // each exchange when the world's group is None (held, a ProcessGroup
  // would outlive destroy_process_group()).
  py::object groups;
};

// The collectives of a planned gather in flight, a scratch buffer each
// whose output is copied out into the members' places once it completes.
class PlannedGather final : public CollectiveHandle {
 public:
  struct Part {
    py::list works;        // torch.distributed's Work: the collective, or an exchange's messages
    py::object gathered;   // the scratch buffer, or None (gathered in place)
    const GatherRun* run;  // in plan_
  };
  PlannedGather(std::vector<Part> parts, std::shared_ptr<const std::vector<GatherRun>> plan,
                std::shared_ptr<const GatherOps> ops, std::shared_ptr<HostWorldWaits> waits,
                int size, std::string what)
      : parts_(std::move(parts)),
        plan_(std::move(plan)),
        ops_(std::move(ops)),
        waits_(std::move(waits)),
        size_(size),
        what_(std::move(what)) {}
  ~PlannedGather() override {
    for (Part& part : parts_) {
      drop(part.works);
      drop(part.gathered);
    }
  }
  PlannedGather(const PlannedGather&) = delete;
  PlannedGather& operator=(const PlannedGather&) = delete;

  bool query() override {
    if (done_ == parts_.size()) return true;
    return with_gil(what_, [&] {
      while (done_ < parts_.size()) {
        for (py::handle work : parts_[done_].works) {
          if (waits_ != nullptr) ++waits_->polls;
          if (!work.attr("is_completed")().cast<bool>()) return false;
        }
        finish(parts_[done_++]);
      }
      return true;
    });
  }

  void wait() override {
    if (done_ == parts_.size()) return;
    with_gil(what_, [&] {
      while (done_ < parts_.size()) finish(parts_[done_++]);
    });
  }

 private:
  // Waits for the part (torch releases the GIL inside) and copies it out.
  void finish(Part& part) {
    for (py::handle work : part.works) {
      if (waits_ != nullptr) ++waits_->waits;
      work.attr("wait")();
    }
    if (part.gathered.is_none()) return;
    const GatherRun& run = *part.run;
    ops_->split_copy(part.gathered.attr("view")(size_, run.total), run.sizes, py::arg("dim") = 1,
                     py::arg("out") = run.outs);
    part.gathered = py::none();
  }

  std::vector<Part> parts_;
  std::size_t done_ = 0;  // parts finished, in order
  std::shared_ptr<const std::vector<GatherRun>> plan_;
  std::shared_ptr<const GatherOps> ops_;
  std::shared_ptr<HostWorldWaits> waits_;
  int size_;
  std::string what_;
};

class HostWorldCommunicator final : public Communicator {
 public:
  HostWorldCommunicator(py::object world, NativeStreamHandles* streams,
                        std::shared_ptr<HostWorldWaits> waits)
      : world_(std::move(world)),
        host_(world_.cast<HostCommunicator&>()),
        streams_(streams),
        waits_(std::move(waits)) {
    const py::module_ torch = py::module_::import("torch");
    ops_ = held_by_python(
        new GatherOps{.cat = torch.attr("cat"),
                      .empty = torch.attr("empty"),
                      .split_copy = torch.attr("split_with_sizes_copy"),
                      .groups = py::module_::import("torch.distributed").attr("group")});
  }
  ~HostWorldCommunicator() override { drop(world_); }
  HostWorldCommunicator(const HostWorldCommunicator&) = delete;
  HostWorldCommunicator& operator=(const HostWorldCommunicator&) = delete;

  int rank() const override { return host_.rank; }
  int size() const override { return host_.size; }

  std::shared_ptr<CollectiveHandle> all_gather(const void* send, void* recv, std::size_t count,
                                               DataType type, Stream& stream) override {
    check(send, count, "all_gather");
    check(recv, count, "all_gather");
    return call(stream, "all_gather", [&](const py::object& on) {
      return host_.all_gather_at(address(send), address(recv), count, type_name(type), on);
    });
  }

  std::shared_ptr<CollectiveHandle> all_gather_coalesced(std::span<const GatherItem> items,
                                                         Stream& stream) override {
    for (const GatherItem& item : items) {
      check(item.send, item.count, "all_gather_coalesced");
      check(item.recv, item.count, "all_gather_coalesced");
    }
    const std::optional<std::uintptr_t> native = ready(stream);
    py::gil_scoped_acquire gil;
    if (!native) return planned_gather(items);
    const py::object on = stream_argument(native);
    py::list list;
    for (const GatherItem& item : items)
      list.append(
          py::make_tuple(address(item.send), address(item.recv), item.count, type_name(item.type)));
    return issue("all_gather_coalesced", [&] { return host_.all_gather_coalesced_at(list, on); });
  }

  std::shared_ptr<CollectiveHandle> reduce_scatter(const void* send, void* recv, std::size_t count,
                                                   DataType type, ReduceOp op,
                                                   Stream& stream) override {
    check(send, count, "reduce_scatter");
    check(recv, count, "reduce_scatter");
    return call(stream, "reduce_scatter", [&](const py::object& on) {
      return host_.reduce_scatter_at(address(send), address(recv), count, type_name(type),
                                     op_name(op), on);
    });
  }

  std::shared_ptr<CollectiveHandle> all_reduce(const void* send, void* recv, std::size_t count,
                                               DataType type, ReduceOp op,
                                               Stream& stream) override {
    check(send, count, "all_reduce");
    check(recv, count, "all_reduce");
    return call(stream, "all_reduce", [&](const py::object& on) {
      return host_.all_reduce_at(address(send), address(recv), count, type_name(type), op_name(op),
                                 on);
    });
  }

  std::shared_ptr<CollectiveHandle> broadcast(void* buffer, std::size_t count, DataType type,
                                              int root, Stream& stream) override {
    check(buffer, count, "broadcast");
    if (root < 0 || root >= host_.size)
      throw Error(
          ErrorKind::invalid_argument,
          fmt::format("broadcast: root {} is not a rank of the {}-rank world", root, host_.size));
    return call(stream, "broadcast", [&](const py::object& on) {
      return host_.broadcast_at(address(buffer), count, type_name(type), root, on);
    });
  }

  std::shared_ptr<CollectiveHandle> barrier(Stream& stream) override {
    return call(stream, "barrier", [&](const py::object& on) { return host_.barrier_async(on); });
  }

 private:
  using PlanKey = std::vector<std::tuple<std::uintptr_t, std::uintptr_t, std::size_t, DataType>>;

  // A coalesced gather on host streams, issued here from the plan the
  // Python world made for these items the first time (the coordinator
  // gathers the same groups into the same buffers every pass): no Python
  // function of ductile's runs. The GIL held.
  std::shared_ptr<CollectiveHandle> planned_gather(std::span<const GatherItem> items) {
    std::string what = described("all_gather_coalesced");
    try {
      PlanKey key;
      key.reserve(items.size());
      for (const GatherItem& item : items)
        key.emplace_back(address(item.send), address(item.recv), item.count, item.type);
      auto at = plans_.find(key);
      if (at == plans_.end()) {
        if (plans_.size() >= kPlanLimit) plans_.clear();
        py::list list;
        for (const auto& [send, recv, count, type] : key)
          list.append(py::make_tuple(send, recv, count, type_name(type)));
        at =
            plans_.emplace(std::move(key), held_by_python(new std::vector(host_.gather_plan(list))))
                .first;
      }
      const GatherOps& ops = *ops_;
      const int size = host_.size;
      const std::shared_ptr<const std::vector<GatherRun>>& plan = at->second;
      std::vector<PlannedGather::Part> parts;
      parts.reserve(plan->size());
      for (const GatherRun& run : *plan) {
        py::object send = run.sends.is_none() ? run.send : ops.cat(run.sends);
        if (size == 1) {  // the gather is a copy, or nothing when in place
          if (!send.attr("data_ptr")().equal(run.recv.attr("data_ptr")()))
            run.recv.attr("copy_")(send);
          continue;
        }
        if (run.clone) send = send.attr("clone")();
        py::object out = run.recv;
        py::object gathered = py::none();
        if (!run.outs.is_none()) {
          gathered = ops.empty(size * run.total, py::arg("dtype") = send.attr("dtype"),
                               py::arg("device") = send.attr("device"));
          out = gathered;
        }
        parts.push_back({issue_gather(ops, out, send), std::move(gathered), &run});
      }
      return std::make_shared<PlannedGather>(std::move(parts), plan, ops_, waits_, size,
                                             std::move(what));
    } catch (py::error_already_set& e) {
      rethrow(what, e);
    }
  }

  // One gather of every rank's `send` into `out`: the world's collective,
  // or a direct exchange.
  py::list issue_gather(const GatherOps& ops, const py::object& out, const py::object& send) const {
    if (!host_.direct_exchange) {
      py::list works;
      works.append(host_.gather_collective(out, send, py::arg("group") = host_.group,
                                           py::arg("async_op") = true));
      return works;
    }
    if (waits_ != nullptr) ++waits_->exchanges;
    return issue_direct_gather(host_.group.is_none() ? ops.groups.attr("WORLD") : host_.group,
                               host_.rank, host_.size, out, send, host_.direct_tag);
  }

  // "<call> (<kind> host world, rank <r> of <n>)", for errors.
  std::string described(const char* call) const {
    return fmt::format("{} ({} host world, rank {} of {})", call, host_.kind, host_.rank,
                       host_.size);
  }

  static void check(const void* buffer, std::size_t count, const char* call) {
    if (buffer == nullptr && count != 0)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("{}: a null buffer with {} elements", call, count));
  }

  // The stream's earlier work comes first. With native stream handles (a
  // device backend) the host framework orders its collective after the
  // stream and the stream's later work after the collective: the handle
  // (an int) goes to Python and nothing waits here. Otherwise the stream
  // is synchronised when busy (GIL released while waiting) and None goes.
  std::optional<std::uintptr_t> ready(Stream& stream) {
    if (streams_ != nullptr) return address(streams_->native_handle(stream));
    if (!stream.query()) {
      if (PyGILState_Check()) {
        py::gil_scoped_release release;
        stream.synchronize();
      } else {
        stream.synchronize();
      }
    }
    return std::nullopt;
  }

  // The last argument of every Python call (the GIL held).
  static py::object stream_argument(const std::optional<std::uintptr_t>& native) {
    if (native) return py::int_(*native);
    return py::none();
  }

  template <class Issue>
  std::shared_ptr<CollectiveHandle> issue(const char* call, Issue&& make) {
    std::string what = described(call);
    try {
      py::object work = make();
      return std::make_shared<HostHandle>(std::move(work), std::move(what));
    } catch (py::error_already_set& e) {
      rethrow(what, e);
    }
  }

  // Issues `make(stream argument)` after the stream's earlier work.
  template <class Make>
  std::shared_ptr<CollectiveHandle> call(Stream& stream, const char* call, Make&& make) {
    const std::optional<std::uintptr_t> native = ready(stream);
    py::gil_scoped_acquire gil;
    const py::object on = stream_argument(native);
    return issue(call, [&] { return make(on); });
  }

  // Plans kept before the cache starts over (as the Python world's caches).
  static constexpr std::size_t kPlanLimit = 4096;

  py::object world_;
  HostCommunicator& host_;                 // world_'s
  NativeStreamHandles* streams_;           // the accelerator's, or null (host streams)
  std::shared_ptr<const GatherOps> ops_;   // torch's functions
  std::shared_ptr<HostWorldWaits> waits_;  // or null
  // By items; a handle in flight shares its plan.
  std::map<PlanKey, std::shared_ptr<const std::vector<GatherRun>>> plans_;
};

}  // namespace

py::list issue_direct_gather(const py::object& group, int rank, int size, const py::object& out,
                             const py::object& send, int tag) {
  py::list works;
  const auto count = send.attr("numel")().cast<std::int64_t>();
  if (count == 0) return works;
  const py::object own = out.attr("narrow")(0, rank * count, count);
  if (!own.attr("data_ptr")().equal(send.attr("data_ptr")())) own.attr("copy_")(send);
  const py::object send_to = group.attr("send");
  const py::object receive_from = group.attr("recv");
  for (int k = 1; k < size; ++k) {
    const int dst = (rank + k) % size;
    const int src = (rank - k + size) % size;
    works.append(send_to(py::make_tuple(own), dst, tag));
    works.append(receive_from(py::make_tuple(out.attr("narrow")(0, src * count, count)), src, tag));
  }
  return works;
}

HostCommunicator::HostCommunicator(int rank, int size, std::string kind, py::object group,
                                   py::object gather_collective, bool direct_exchange,
                                   int direct_tag)
    : rank(rank),
      size(size),
      kind(std::move(kind)),
      group(std::move(group)),
      gather_collective(std::move(gather_collective)),
      direct_exchange(direct_exchange),
      direct_tag(direct_tag) {
  if (size < 1 || rank < 0 || rank >= size)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("HostCommunicator: rank = {} with size = {} is not a rank of the "
                            "world; give a size of 1 or more and a rank in [0, size)",
                            rank, size));
}

std::shared_ptr<Communicator> make_host_world(py::object world, NativeStreamHandles* streams,
                                              std::shared_ptr<HostWorldWaits> waits) {
  if (!py::isinstance<HostCommunicator>(world))
    throw Error(ErrorKind::invalid_argument,
                fmt::format("host_world = a {} is not a host communicator; give a "
                            "_ductile.zero.HostCommunicator (ductile.torch.zero3's TorchWorld)",
                            Py_TYPE(world.ptr())->tp_name));
  return std::make_shared<HostWorldCommunicator>(std::move(world), streams, std::move(waits));
}

namespace {

// Python's overrides of HostWork's and HostCommunicator's calls.
class PyHostWork final : public HostWork {
 public:
  bool query() override { PYBIND11_OVERRIDE_PURE(bool, HostWork, query, ); }
  void wait() override { PYBIND11_OVERRIDE_PURE(void, HostWork, wait, ); }
};

class PyHostCommunicator final : public HostCommunicator {
 public:
  using HostCommunicator::HostCommunicator;

  py::object all_gather_at(std::uintptr_t send, std::uintptr_t recv, std::size_t count,
                           const char* dtype, py::object stream) override {
    PYBIND11_OVERRIDE_PURE(py::object, HostCommunicator, all_gather_at, send, recv, count, dtype,
                           stream);
  }
  py::object all_gather_coalesced_at(py::list items, py::object stream) override {
    PYBIND11_OVERRIDE_PURE(py::object, HostCommunicator, all_gather_coalesced_at, items, stream);
  }
  py::object reduce_scatter_at(std::uintptr_t send, std::uintptr_t recv, std::size_t count,
                               const char* dtype, const char* op, py::object stream) override {
    PYBIND11_OVERRIDE_PURE(py::object, HostCommunicator, reduce_scatter_at, send, recv, count,
                           dtype, op, stream);
  }
  py::object all_reduce_at(std::uintptr_t send, std::uintptr_t recv, std::size_t count,
                           const char* dtype, const char* op, py::object stream) override {
    PYBIND11_OVERRIDE_PURE(py::object, HostCommunicator, all_reduce_at, send, recv, count, dtype,
                           op, stream);
  }
  py::object broadcast_at(std::uintptr_t buffer, std::size_t count, const char* dtype, int root,
                          py::object stream) override {
    PYBIND11_OVERRIDE_PURE(py::object, HostCommunicator, broadcast_at, buffer, count, dtype, root,
                           stream);
  }
  py::object barrier_async(py::object stream) override {
    PYBIND11_OVERRIDE_PURE(py::object, HostCommunicator, barrier_async, stream);
  }
  std::vector<GatherRun> gather_plan(py::list items) override {
    PYBIND11_OVERRIDE_PURE(std::vector<GatherRun>, HostCommunicator, gather_plan, items);
  }
};

}  // namespace

void register_host_world(py::module_& m) {
  py::class_<HostWork, PyHostWork>(
      m, "HostWork",
      "A collective in flight that a HostCommunicator issued; subclasses define query() (never "
      "blocks) and wait().")
      .def(py::init<>());

  py::class_<GatherRun>(m, "GatherRun",
                        "One collective of a planned coalesced gather (HostCommunicator."
                        "gather_plan); see python/src/host_world.hpp.")
      .def(py::init([](py::object send, py::object sends, py::object recv, py::object outs,
                       py::object sizes, std::int64_t total, bool clone) {
             return GatherRun{std::move(send),
                              std::move(sends),
                              std::move(recv),
                              std::move(outs),
                              std::move(sizes),
                              total,
                              clone};
           }),
           py::kw_only(), py::arg("send") = py::none(), py::arg("sends") = py::none(),
           py::arg("recv") = py::none(), py::arg("outs") = py::none(),
           py::arg("sizes") = py::none(), py::arg("total"), py::arg("clone") = false)
      .def_readonly("send", &GatherRun::send)
      .def_readonly("sends", &GatherRun::sends)
      .def_readonly("recv", &GatherRun::recv)
      .def_readonly("outs", &GatherRun::outs)
      .def_readonly("sizes", &GatherRun::sizes)
      .def_readonly("total", &GatherRun::total)
      .def_readonly("clone", &GatherRun::clone);

  py::class_<HostCommunicator, PyHostCommunicator>(
      m, "HostCommunicator",
      "The host framework's communicator offered to the coordinator as its world: its facts, "
      "given once here, and the calls the coordinator makes (all_gather_at, "
      "all_gather_coalesced_at, reduce_scatter_at, all_reduce_at, broadcast_at, barrier_async, "
      "gather_plan), which subclasses define; see python/src/host_world.hpp.")
      .def(py::init<int, int, std::string, py::object, py::object, bool, int>(), py::kw_only(),
           py::arg("rank"), py::arg("size"), py::arg("kind"), py::arg("group"),
           py::arg("gather_collective"), py::arg("direct_exchange"), py::arg("direct_tag"))
      .def_readonly("rank", &HostCommunicator::rank)
      .def_readonly("size", &HostCommunicator::size)
      .def_readonly("kind", &HostCommunicator::kind)
      .def_readonly("group", &HostCommunicator::group)
      .def_readonly("direct_exchange", &HostCommunicator::direct_exchange)
      .def_readonly("direct_tag", &HostCommunicator::direct_tag);
}

}  // namespace ductile::python
