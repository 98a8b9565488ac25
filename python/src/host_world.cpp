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

namespace ductile::python {

namespace py = pybind11;

namespace {

const char* type_name(DataType type) {
  switch (type) {
    case DataType::f32:
      return "float32";
    case DataType::f64:
      return "float64";
    case DataType::f16:
      return "float16";
    case DataType::bf16:
      return "bfloat16";
    case DataType::i32:
      return "int32";
    case DataType::i64:
      return "int64";
    case DataType::u8:
      return "uint8";
  }
  throw Error(ErrorKind::invalid_argument,
              fmt::format("host world: unknown element type {}", static_cast<unsigned>(type)));
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::prod:
      return "prod";
    case ReduceOp::min:
      return "min";
    case ReduceOp::max:
      return "max";
  }
  throw Error(ErrorKind::invalid_argument,
              fmt::format("host world: unknown reduce op {}", static_cast<unsigned>(op)));
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

class HostHandle final : public CollectiveHandle {
 public:
  HostHandle(py::object work, std::string what) : work_(std::move(work)), what_(std::move(what)) {}
  ~HostHandle() override { drop(work_); }
  HostHandle(const HostHandle&) = delete;
  HostHandle& operator=(const HostHandle&) = delete;

  bool query() override {
    if (done_) return true;
    py::gil_scoped_acquire gil;
    try {
      done_ = work_.attr("query")().cast<bool>();
    } catch (py::error_already_set& e) {
      rethrow(what_, e);
    }
    return done_;
  }

  void wait() override {
    if (done_) return;
    py::gil_scoped_acquire gil;
    try {
      work_.attr("wait")();
    } catch (py::error_already_set& e) {
      rethrow(what_, e);
    }
    done_ = true;
  }

 private:
  py::object work_;
  std::string what_;
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

// One run of a planned coalesced gather (see host_world.hpp): what
// TorchWorld.gather_plan returned for it, kept by the communicator.
struct GatherRun {
  py::object send;   // the shard (a tensor), or None: `sends` are joined
  py::object sends;  // the shards of several small groups (a list), or None
  py::object recv;   // the output, when `outs` is None: gathered straight into it
  py::object outs;   // else the members' places ((world, count) views), with
  py::object sizes;  // their counts: copied out of a (world, total) scratch
  std::int64_t total = 0;
  bool clone = false;  // the send lies in the output: copied first
};

// torch's functions a planned gather calls, looked up once per world.
struct GatherOps {
  py::object collective;  // all_gather_into_tensor(out, in, group=, async_op=True)
  py::object group;
  py::object cat, empty, split_copy;
  // With TorchWorld.direct_exchange (gloo), torch.distributed.group, whose
  // WORLD is the default group, looked up at each gather when `group` is
  // None (held, a ProcessGroup would outlive destroy_process_group()); else
  // None: gathered by `collective`.
  py::object groups;
  int tag = 0;
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
    py::gil_scoped_acquire gil;
    try {
      while (done_ < parts_.size()) {
        for (py::handle work : parts_[done_].works) {
          if (waits_ != nullptr) ++waits_->polls;
          if (!work.attr("is_completed")().cast<bool>()) return false;
        }
        finish(parts_[done_++]);
      }
    } catch (py::error_already_set& e) {
      rethrow(what_, e);
    }
    return true;
  }

  void wait() override {
    if (done_ == parts_.size()) return;
    py::gil_scoped_acquire gil;
    try {
      while (done_ < parts_.size()) finish(parts_[done_++]);
    } catch (py::error_already_set& e) {
      rethrow(what_, e);
    }
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
      : world_(std::move(world)), streams_(streams), waits_(std::move(waits)) {
    rank_ = world_.attr("rank").cast<int>();
    size_ = world_.attr("size").cast<int>();
    label_ = py::str(world_.attr("kind")).cast<std::string>();
    if (py::hasattr(world_, "gather_plan")) {
      const py::module_ torch = py::module_::import("torch");
      auto* ops = new GatherOps{.collective = world_.attr("gather_collective"),
                                .group = world_.attr("group"),
                                .cat = torch.attr("cat"),
                                .empty = torch.attr("empty"),
                                .split_copy = torch.attr("split_with_sizes_copy"),
                                .groups = py::none()};
      if (py::getattr(world_, "direct_exchange", py::bool_(false)).cast<bool>()) {
        ops->groups = py::module_::import("torch.distributed").attr("group");
        ops->tag = world_.attr("direct_tag").cast<int>();
      }
      ops_ = held_by_python(ops);
    }
  }
  ~HostWorldCommunicator() override { drop(world_); }
  HostWorldCommunicator(const HostWorldCommunicator&) = delete;
  HostWorldCommunicator& operator=(const HostWorldCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::shared_ptr<CollectiveHandle> all_gather(const void* send, void* recv, std::size_t count,
                                               DataType type, Stream& stream) override {
    check(send, count, "all_gather");
    check(recv, count, "all_gather");
    return call(stream, "all_gather", "all_gather_at", address(send), address(recv), count,
                type_name(type));
  }

  std::shared_ptr<CollectiveHandle> all_gather_coalesced(std::span<const GatherItem> items,
                                                         Stream& stream) override {
    for (const GatherItem& item : items) {
      check(item.send, item.count, "all_gather_coalesced");
      check(item.recv, item.count, "all_gather_coalesced");
    }
    const std::optional<std::uintptr_t> native = ready(stream);
    py::gil_scoped_acquire gil;
    if (!native && ops_ != nullptr) return planned_gather(items);
    const py::object on = stream_argument(native);
    py::list list;
    for (const GatherItem& item : items)
      list.append(
          py::make_tuple(address(item.send), address(item.recv), item.count, type_name(item.type)));
    return issue("all_gather_coalesced",
                 [&] { return world_.attr("all_gather_coalesced_at")(list, on); });
  }

  std::shared_ptr<CollectiveHandle> reduce_scatter(const void* send, void* recv, std::size_t count,
                                                   DataType type, ReduceOp op,
                                                   Stream& stream) override {
    check(send, count, "reduce_scatter");
    check(recv, count, "reduce_scatter");
    return call(stream, "reduce_scatter", "reduce_scatter_at", address(send), address(recv), count,
                type_name(type), op_name(op));
  }

  std::shared_ptr<CollectiveHandle> all_reduce(const void* send, void* recv, std::size_t count,
                                               DataType type, ReduceOp op,
                                               Stream& stream) override {
    check(send, count, "all_reduce");
    check(recv, count, "all_reduce");
    return call(stream, "all_reduce", "all_reduce_at", address(send), address(recv), count,
                type_name(type), op_name(op));
  }

  std::shared_ptr<CollectiveHandle> broadcast(void* buffer, std::size_t count, DataType type,
                                              int root, Stream& stream) override {
    check(buffer, count, "broadcast");
    if (root < 0 || root >= size_)
      throw Error(
          ErrorKind::invalid_argument,
          fmt::format("broadcast: root {} is not a rank of the {}-rank world", root, size_));
    return call(stream, "broadcast", "broadcast_at", address(buffer), count, type_name(type), root);
  }

  std::shared_ptr<CollectiveHandle> barrier(Stream& stream) override {
    return call(stream, "barrier", "barrier_async");
  }

 private:
  using PlanKey = std::vector<std::tuple<std::uintptr_t, std::uintptr_t, std::size_t, DataType>>;

  // A coalesced gather on host streams, issued here from the plan the
  // Python world made for these items the first time (the coordinator
  // gathers the same groups into the same buffers every pass): no Python
  // function of ductile's runs. The GIL held.
  std::shared_ptr<CollectiveHandle> planned_gather(std::span<const GatherItem> items) {
    std::string what =
        fmt::format("all_gather_coalesced ({} host world, rank {} of {})", label_, rank_, size_);
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
        std::vector<GatherRun> runs;
        for (py::handle run : world_.attr("gather_plan")(list)) {
          const py::tuple t = py::reinterpret_borrow<py::tuple>(run);
          runs.push_back(GatherRun{t[0], t[1], t[2], t[3], t[4], t[5].cast<std::int64_t>(),
                                   t[6].cast<bool>()});
        }
        at = plans_.emplace(std::move(key), held_by_python(new std::vector(std::move(runs)))).first;
      }
      const GatherOps& ops = *ops_;
      const std::shared_ptr<const std::vector<GatherRun>>& plan = at->second;
      std::vector<PlannedGather::Part> parts;
      parts.reserve(plan->size());
      for (const GatherRun& run : *plan) {
        py::object send = run.sends.is_none() ? run.send : ops.cat(run.sends);
        if (size_ == 1) {  // the gather is a copy, or nothing when in place
          if (!send.attr("data_ptr")().equal(run.recv.attr("data_ptr")()))
            run.recv.attr("copy_")(send);
          continue;
        }
        if (run.clone) send = send.attr("clone")();
        py::object out = run.recv;
        py::object gathered = py::none();
        if (!run.outs.is_none()) {
          gathered = ops.empty(size_ * run.total, py::arg("dtype") = send.attr("dtype"),
                               py::arg("device") = send.attr("device"));
          out = gathered;
        }
        parts.push_back({issue_gather(ops, out, send), std::move(gathered), &run});
      }
      return std::make_shared<PlannedGather>(std::move(parts), plan, ops_, waits_, size_,
                                             std::move(what));
    } catch (py::error_already_set& e) {
      rethrow(what, e);
    }
  }

  // One gather of every rank's `send` into `out`: the collective, or a
  // direct exchange.
  py::list issue_gather(const GatherOps& ops, const py::object& out, const py::object& send) const {
    if (ops.groups.is_none()) {
      py::list works;
      works.append(
          ops.collective(out, send, py::arg("group") = ops.group, py::arg("async_op") = true));
      return works;
    }
    if (waits_ != nullptr) ++waits_->exchanges;
    return issue_direct_gather(ops.group.is_none() ? ops.groups.attr("WORLD") : ops.group, rank_,
                               size_, out, send, ops.tag);
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
    std::string what = fmt::format("{} ({} host world, rank {} of {})", call, label_, rank_, size_);
    try {
      py::object work = make();
      return std::make_shared<HostHandle>(std::move(work), std::move(what));
    } catch (py::error_already_set& e) {
      rethrow(what, e);
    }
  }

  template <class... Args>
  std::shared_ptr<CollectiveHandle> call(Stream& stream, const char* call, const char* method,
                                         Args&&... args) {
    const std::optional<std::uintptr_t> native = ready(stream);
    py::gil_scoped_acquire gil;
    const py::object on = stream_argument(native);
    return issue(call, [&] { return world_.attr(method)(std::forward<Args>(args)..., on); });
  }

  // Plans kept before the cache starts over (as the Python world's caches).
  static constexpr std::size_t kPlanLimit = 4096;

  py::object world_;
  NativeStreamHandles* streams_;           // the accelerator's, or null (host streams)
  std::shared_ptr<const GatherOps> ops_;   // null: the world makes no plans
  std::shared_ptr<HostWorldWaits> waits_;  // or null
  // By items; a handle in flight shares its plan.
  std::map<PlanKey, std::shared_ptr<const std::vector<GatherRun>>> plans_;
  int rank_ = 0;
  int size_ = 1;
  std::string label_;
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

std::shared_ptr<Communicator> make_host_world(py::object world, NativeStreamHandles* streams,
                                              std::shared_ptr<HostWorldWaits> waits) {
  return std::make_shared<HostWorldCommunicator>(std::move(world), streams, std::move(waits));
}

}  // namespace ductile::python
