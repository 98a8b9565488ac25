// The host-supplied world communicator; see host_world.hpp.
#include "host_world.hpp"

#include <Python.h>

#include <optional>
#include <string>
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

class HostWorldCommunicator final : public Communicator {
 public:
  HostWorldCommunicator(py::object world, NativeStreamHandles* streams)
      : world_(std::move(world)), streams_(streams) {
    rank_ = world_.attr("rank").cast<int>();
    size_ = world_.attr("size").cast<int>();
    label_ = py::str(world_.attr("kind")).cast<std::string>();
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

  py::object world_;
  NativeStreamHandles* streams_;  // the accelerator's, or null (host streams)
  int rank_ = 0;
  int size_ = 1;
  std::string label_;
};

}  // namespace

std::shared_ptr<Communicator> make_host_world(py::object world, NativeStreamHandles* streams) {
  return std::make_shared<HostWorldCommunicator>(std::move(world), streams);
}

}  // namespace ductile::python
