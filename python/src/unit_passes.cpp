// The zero3 step path in C++; see unit_passes.hpp.
#include "unit_passes.hpp"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ductile/error.hpp"
#include "group_state.hpp"
#include "saved_views.hpp"

namespace ductile::python {

namespace py = pybind11;

namespace {

// The torch functions the hooks call, looked up once.
struct Torch {
  py::object graph_task_id;    // torch._C._current_graph_task_id: -1 outside backward
  py::object grad_enabled;     // torch.is_grad_enabled
  py::object tensor_type;      // torch.Tensor
  py::object queue_callback;   // autograd engine's queue_callback: runs at the end of backward
  py::object multi_grad_hook;  // torch.autograd.graph.register_multi_grad_hook

  Torch() {
    const py::module_ torch = py::module_::import("torch");
    graph_task_id = torch.attr("_C").attr("_current_graph_task_id");
    grad_enabled = torch.attr("is_grad_enabled");
    tensor_type = torch.attr("Tensor");
    queue_callback =
        torch.attr("autograd").attr("Variable").attr("_execution_engine").attr("queue_callback");
    multi_grad_hook = py::module_::import("torch.autograd.graph").attr("register_multi_grad_hook");
  }
  std::int64_t task() const { return graph_task_id().cast<std::int64_t>(); }
  bool in_backward() const { return task() != -1; }
  bool grad() const { return grad_enabled().cast<bool>(); }
};

// The number of gathered copies' views a group keeps (by address): the
// coordinator's pool hands a group one of a few buffers, so after the first
// passes a materialisation builds no tensor.
constexpr Py_ssize_t kViewsKept = 8;

// Where the passes are: set by the step path when a fetch opens a pass and
// when its backward starts, by the owner at the end of the backward and of
// the pass.
enum class TrainingState {
  idle,           // no pass open
  forward,        // a pass open, its backward not started (forward running or done)
  backward,       // autograd runs the pass's backward; the end of the backward is queued
  post_backward,  // the end of the backward: the gradients left are reduced, the pass ends
};

// What the step path asks of its owner (_passes.Passes, which subclasses
// it): the behaviour that stays in Python.
class PassEvents {
 public:
  PassEvents() = default;
  PassEvents(const PassEvents&) = delete;
  PassEvents& operator=(const PassEvents&) = delete;
  virtual ~PassEvents() = default;
  // A fetch opens a pass.
  virtual void begin_pass() = 0;
  // Autograd is done with the backward of the pass.
  virtual void end_backward() = 0;
  // A unit's backward is done: reduce the gradients of a group it owns.
  virtual void reduce_gradients(py::object group) = 0;
  // (full, member views) over the gathered copy of `group` at `address`.
  virtual py::object gathered_views(py::object group, std::uintptr_t address) = 0;
};

class PyPassEvents : public PassEvents {
 public:
  void begin_pass() override { PYBIND11_OVERRIDE_PURE(void, PassEvents, begin_pass, ); }
  void end_backward() override { PYBIND11_OVERRIDE_PURE(void, PassEvents, end_backward, ); }
  void reduce_gradients(py::object group) override {
    PYBIND11_OVERRIDE_PURE(void, PassEvents, reduce_gradients, group);
  }
  py::object gathered_views(py::object group, std::uintptr_t address) override {
    PYBIND11_OVERRIDE_PURE(py::object, PassEvents, gathered_views, group, address);
  }
};

// A group of a unit: its Python object (kept alive here) and its state.
struct UnitGroup {
  py::object object;
  GroupState* state;
};

struct Unit {
  py::object name;
  std::vector<std::size_t> groups;  // indices into UnitPasses::groups_: gathered
  std::vector<std::size_t> own;     // and owned (reduced after its backward)
  std::int64_t fetched = 0;         // fetches not yet released
  std::int64_t holds = 0;           // recomputations inside backward holding it
};

void set_data(py::handle param, py::handle tensor) {
  if (PyObject_SetAttrString(param.ptr(), "data", tensor.ptr()) != 0) throw py::error_already_set();
}

class UnitPasses : public std::enable_shared_from_this<UnitPasses> {
 public:
  // The session's (the coordinator binding's) methods are bound once here;
  // `events` is held weakly, so that an engine that is dropped is freed.
  UnitPasses(const py::object& session, std::shared_ptr<LiveCopies> live, const py::object& events)
      : events_(events),
        live_(std::move(live)),
        session_fetch_(session.attr("fetch")),
        session_release_(session.attr("release")),
        session_progress_(session.attr("progress")),
        session_full_data_(session.attr("full_data")),
        session_stats_(session.attr("stats")) {
    events.cast<PassEvents&>();  // any other type raises now rather than in a hook
  }

  std::size_t add_unit(py::object name, const py::iterable& groups, const py::iterable& own) {
    Unit unit;
    unit.name = std::move(name);
    for (py::handle g : groups) unit.groups.push_back(group_index(g));
    for (py::handle g : own) unit.own.push_back(group_index(g));
    units_.push_back(std::move(unit));
    return units_.size() - 1;
  }

  // --- fetch and release -------------------------------------------------------

  void fetch(std::size_t mid) {
    Unit& u = unit(mid);
    if (u.fetched == 0) {
      if (state == TrainingState::idle) begin_pass();
      session_fetch_(mid);
      for (std::size_t g : u.groups) materialize(groups_[g]);
    }
    ++u.fetched;
    if (!module_callback.is_none()) module_callback("fetch", u.name, session_stats_());
  }

  void release(std::size_t mid) {
    Unit& u = unit(mid);
    const std::int64_t count = u.fetched;
    if (count == 0) return;  // released already, by the end of the pass
    u.fetched = count - 1;
    // Drives the gathers in flight: on transports that progress only inside
    // MPI calls, a peer's gather advances when this rank polls.
    session_progress_();
    if (count == 1) {
      session_release_(mid);
      for (std::size_t g : u.groups) dematerialize(groups_[g]);
      if (!module_callback.is_none()) module_callback("release", u.name, session_stats_());
    }
  }

  // The end of a pass: every unit still fetched is released, and the
  // backward hooks of units whose backward did not run are dropped (a hook
  // on a tensor that outlives the pass would fire in a later one).
  void release_everything() {
    py::list hooks = std::exchange(grad_hooks_, py::list());
    for (py::handle handle : hooks) handle.attr("remove")();
    for (std::size_t mid = 0; mid < units_.size(); ++mid) {
      Unit& u = units_[mid];
      u.holds = 0;
      if (u.fetched != 0) {
        u.fetched = 1;
        release(mid);
      }
    }
  }

  // --- backward ----------------------------------------------------------------

  // From inside autograd's backward: the first call of a pass queues the
  // owner's end of the backward for when autograd is done. A backward with
  // no pass open (a retained graph differentiated again) opens one.
  void enter_backward() {
    if (state == TrainingState::backward) return;
    if (state == TrainingState::idle) begin_pass();
    state = TrainingState::backward;
    std::weak_ptr<UnitPasses> self = weak_from_this();
    torch_.queue_callback(py::cpp_function([self] {
      if (auto passes = self.lock()) passes->owner().cast<PassEvents&>().end_backward();
    }));
  }

  void pre_backward(std::size_t mid) {
    enter_backward();
    fetch(mid);
  }

  void post_backward(std::size_t mid) {
    release(mid);
    Unit& u = unit(mid);
    for (std::int64_t held = std::exchange(u.holds, 0); held > 0; --held) release(mid);
    if (u.fetched == 0 && !u.own.empty()) {
      // The unit's backward is done: its parameters' gradients are in (a
      // later use adds more, reduced at the end of the backward).
      const py::object events = owner();
      auto& on = events.cast<PassEvents&>();
      for (std::size_t g : u.own) on.reduce_gradients(groups_[g].object);
    }
  }

  // --- the hooks -----------------------------------------------------------------

  void pre_forward(std::size_t mid, const py::handle& args, const py::handle& kwargs) {
    if (torch_.in_backward()) {
      // A recomputation inside backward (non-reentrant activation
      // checkpointing): autograd keeps what it recomputes, views of the
      // gathered copy among them, until this unit's backward, so the unit
      // stays fetched until then (counted now: a recomputation that torch
      // stops early never reaches the forward hook).
      enter_backward();
      fetch(mid);
      ++unit(mid).holds;
      return;
    }
    stack_.push_back(mid);
    fetch(mid);
    if (torch_.grad()) hook_inputs(mid, args, kwargs);
  }

  void post_forward(std::size_t mid, const py::handle& output) {
    if (torch_.in_backward()) return;  // a recomputation: released after the unit's backward
    if (!stack_.empty()) stack_.pop_back();
    release(mid);
    if (torch_.grad()) hook_outputs(mid, output);
  }

  py::list module_stack() const {
    py::list names;
    for (std::size_t mid : stack_) names.append(units_[mid].name);
    return names;
  }
  void clear_stack() { stack_.clear(); }

  // The groups among `groups` whose trained parameters hold a gradient.
  static py::list groups_with_gradients(const py::iterable& groups) {
    py::list out;
    for (py::handle g : groups) {
      const GroupState& group = as_group(g);
      if (group.trained.empty()) continue;
      for (py::handle p : group.params) {
        if (!p.attr("grad").is_none()) {
          out.append(g);
          break;
        }
      }
    }
    return out;
  }

  // Drops every Python object it holds; a hook called later raises.
  void close() {
    closed_ = true;
    units_.clear();
    groups_.clear();
    index_.clear();
    stack_.clear();
    grad_hooks_ = py::list();
    module_callback = py::none();
    session_fetch_ = session_release_ = session_progress_ = session_full_data_ = session_stats_ =
        py::none();
  }

  std::int64_t graph_task() const { return torch_.task(); }

  TrainingState state = TrainingState::idle;
  py::object module_callback = py::none();

 private:
  Unit& unit(std::size_t mid) {
    if (mid >= units_.size())
      throw Error(ErrorKind::incompatible,
                  closed_ ? "zero3: the engine was shut down; its hooks no longer run"
                          : "zero3: unit " + std::to_string(mid) + " is not registered");
    return units_[mid];
  }

  // The owner (a PassEvents); the object returned keeps it alive while it is used.
  py::object owner() const {
    py::object o = events_();
    if (o.is_none())
      throw Error(ErrorKind::incompatible, "zero3: the engine of these hooks is gone");
    return o;
  }

  void begin_pass() {
    owner().cast<PassEvents&>().begin_pass();
    state = TrainingState::forward;
  }

  std::size_t group_index(py::handle g) {
    auto [at, added] = index_.try_emplace(g.ptr(), groups_.size());
    if (added) groups_.push_back(UnitGroup{py::reinterpret_borrow<py::object>(g), &as_group(g)});
    return at->second;
  }

  // The (full, member views) over the group's gathered copy at `address`:
  // kept, or made by the owner and kept (the oldest dropped past kViewsKept).
  py::object views_at(const UnitGroup& g, const py::object& address) {
    PyObject* cache = g.state->views_cache.ptr();
    PyObject* hit = PyDict_GetItemWithError(cache, address.ptr());
    if (hit != nullptr) return py::reinterpret_borrow<py::object>(hit);
    if (PyErr_Occurred() != nullptr) throw py::error_already_set();
    py::object made =
        owner().cast<PassEvents&>().gathered_views(g.object, address.cast<std::uintptr_t>());
    if (PyDict_Size(cache) >= kViewsKept) {
      Py_ssize_t at = 0;
      PyObject* oldest = nullptr;
      PyObject* value = nullptr;
      if (PyDict_Next(cache, &at, &oldest, &value) != 0) {
        const py::object key = py::reinterpret_borrow<py::object>(oldest);
        if (PyDict_DelItem(cache, key.ptr()) != 0) throw py::error_already_set();
      }
    }
    if (PyDict_SetItem(cache, address.ptr(), made.ptr()) != 0) throw py::error_already_set();
    return made;
  }

  // Points the group's parameters at its gathered copy (one more user).
  void materialize(UnitGroup& g) {
    GroupState& s = *g.state;
    if (s.users == 0) {
      const py::object address = session_full_data_(s.id);
      const py::tuple pair = views_at(g, address);
      s.full = pair[0];
      s.full_address = address.cast<std::uintptr_t>();
      const py::sequence views = pair[1];
      const std::size_t n = s.params.size();
      for (std::size_t i = 0; i < n; ++i) set_data(s.params[i], views[i]);
      live_->add(s.full_address, s.full_bytes, g.object);
    }
    ++s.users;
  }

  // One user fewer; the last one gives the placeholder back.
  void dematerialize(UnitGroup& g) {
    GroupState& s = *g.state;
    if (--s.users != 0) return;
    for (py::handle param : s.params) set_data(param, s.placeholder);
    live_->remove(s.full_address);
    // The copy may be freed now: never touch it again.
    s.full = py::none();
    s.full_address = 0;
  }

  // The distinct tensors requiring grad in (nested) tuples, lists and dicts
  // (a ModelOutput is a dict), in order of appearance.
  py::list requiring_grad(std::initializer_list<py::handle> values) const {
    py::list found;
    std::unordered_set<PyObject*> seen;
    std::vector<py::object> stack;
    for (auto it = values.end(); it != values.begin();)
      stack.push_back(py::reinterpret_borrow<py::object>(*--it));
    auto push_reversed = [&](const py::sequence& items) {
      for (std::size_t i = items.size(); i > 0; --i) stack.push_back(items[i - 1]);
    };
    while (!stack.empty()) {
      py::object value = std::move(stack.back());
      stack.pop_back();
      const int is_tensor = PyObject_IsInstance(value.ptr(), torch_.tensor_type.ptr());
      if (is_tensor < 0) throw py::error_already_set();
      if (is_tensor != 0) {
        if (py::bool_(value.attr("requires_grad")) && seen.insert(value.ptr()).second)
          found.append(value);
      } else if (PyTuple_Check(value.ptr()) || PyList_Check(value.ptr())) {
        push_reversed(py::reinterpret_borrow<py::sequence>(value));
      } else if (PyDict_Check(value.ptr())) {
        push_reversed(py::reinterpret_steal<py::list>(PyDict_Values(value.ptr())));
      }
    }
    return found;
  }

  void hook_outputs(std::size_t mid, const py::handle& output);
  void hook_inputs(std::size_t mid, const py::handle& args, const py::handle& kwargs);

  Torch torch_;
  py::weakref events_;
  std::shared_ptr<LiveCopies> live_;
  py::object session_fetch_, session_release_, session_progress_, session_full_data_,
      session_stats_;
  std::vector<UnitGroup> groups_;
  std::unordered_map<PyObject*, std::size_t> index_;  // group object -> index (held in groups_)
  std::vector<Unit> units_;
  std::vector<std::size_t> stack_;  // units in forward, innermost last
  py::list grad_hooks_;             // this pass's tensor hook handles
  bool closed_ = false;
};

// A unit's module hooks, called by torch.
struct PreForwardHook {
  std::shared_ptr<UnitPasses> passes;
  std::size_t mid;
  py::object operator()(const py::handle&, const py::handle& args, const py::handle& kwargs) {
    passes->pre_forward(mid, args, kwargs);
    return py::none();
  }
};

struct PostForwardHook {
  std::shared_ptr<UnitPasses> passes;
  std::size_t mid;
  py::object operator()(const py::handle&, const py::handle&, const py::handle&,
                        const py::handle& output) {
    passes->post_forward(mid, output);
    return py::none();
  }
};

// A tensor hook that acts at its first call in each backward (a retained
// graph may be differentiated again): the start of a unit's backward (on
// its outputs) or the end (on its one input).
struct OnceAHook {
  std::shared_ptr<UnitPasses> passes;
  std::size_t mid;
  bool starts;
  std::optional<std::int64_t> last_task;
  py::object operator()(const py::handle&) {
    const std::int64_t task = passes->graph_task();
    if (last_task != task) {
      last_task = task;
      if (starts)
        passes->pre_backward(mid);
      else
        passes->post_backward(mid);
    }
    return py::none();
  }
};

// The end of a unit's backward when several inputs take part: a multi-grad
// hook (mode "all") calls it once their gradients are all in.
struct AllInputsHook {
  std::shared_ptr<UnitPasses> passes;
  std::size_t mid;
  py::object operator()(const py::handle&) {
    passes->post_backward(mid);
    return py::none();
  }
};

void UnitPasses::hook_outputs(std::size_t mid, const py::handle& output) {
  const py::list tensors = requiring_grad({output});
  if (tensors.empty()) return;  // no backward will reach the module
  py::object hook = py::cast(OnceAHook{shared_from_this(), mid, true, std::nullopt});
  for (py::handle t : tensors) grad_hooks_.append(t.attr("register_hook")(hook));
}

void UnitPasses::hook_inputs(std::size_t mid, const py::handle& args, const py::handle& kwargs) {
  const py::list tensors = requiring_grad({args, kwargs});
  // None: the release then waits for the end of the pass.
  if (tensors.empty()) return;
  if (tensors.size() == 1) {
    grad_hooks_.append(
        tensors[0].attr("register_hook")(OnceAHook{shared_from_this(), mid, false, std::nullopt}));
    return;
  }
  grad_hooks_.append(torch_.multi_grad_hook(tensors, AllInputsHook{shared_from_this(), mid},
                                            py::arg("mode") = "all"));
}

}  // namespace

void register_unit_passes(py::module_& zero) {
  py::class_<PreForwardHook>(zero, "PreForwardHook", "A unit's forward pre-hook (with kwargs).")
      .def("__call__", &PreForwardHook::operator());
  py::class_<PostForwardHook>(zero, "PostForwardHook", "A unit's forward hook (with kwargs).")
      .def("__call__", &PostForwardHook::operator());
  py::class_<OnceAHook>(zero, "UnitTensorHook",
                        "A tensor hook starting or ending a unit's backward.")
      .def("__call__", &OnceAHook::operator());
  py::class_<AllInputsHook>(zero, "UnitInputsHook", "A multi-grad hook ending a unit's backward.")
      .def("__call__", &AllInputsHook::operator());
  py::enum_<TrainingState>(zero, "TrainingState",
                           "Where the passes of a zero3 engine are (UnitPasses.state).")
      .value("IDLE", TrainingState::idle, "No pass open.")
      .value("FORWARD", TrainingState::forward,
             "A pass open, its backward not started (forward running or done).")
      .value("BACKWARD", TrainingState::backward, "Autograd runs the backward of the pass.")
      .value("POST_BACKWARD", TrainingState::post_backward,
             "The end of the backward: the gradients left are reduced, the pass ends.");
  py::class_<PassEvents, PyPassEvents>(
      zero, "PassEvents",
      "What the step path asks of its owner: begin_pass(), end_backward(), "
      "reduce_gradients(group), gathered_views(group, address) -> (full, member views). "
      "Subclassed in Python (the engine's Passes), which defines them.")
      .def(py::init<>());
  using P = UnitPasses;
  py::class_<P, std::shared_ptr<P>>(zero, "UnitPasses",
                                    "The zero3 step path: unit hooks, fetch and release counts, "
                                    "materialisation of groups.")
      .def(py::init<const py::object&, std::shared_ptr<LiveCopies>, const py::object&>(),
           py::arg("session"), py::arg("live"), py::arg("events"))
      .def("add_unit", &P::add_unit, py::arg("name"), py::arg("groups"), py::arg("own"),
           "Registers a unit gathering `groups` and owning `own`; returns its id.")
      .def("release_everything", &P::release_everything)
      .def(
          "pre_forward_hook",
          [](const std::shared_ptr<P>& p, std::size_t mid) {
            return PreForwardHook{p, mid};
          },
          py::arg("unit"))
      .def(
          "post_forward_hook",
          [](const std::shared_ptr<P>& p, std::size_t mid) {
            return PostForwardHook{p, mid};
          },
          py::arg("unit"))
      .def_property_readonly("module_stack", &P::module_stack)
      .def("clear_stack", &P::clear_stack)
      .def_static("groups_with_gradients", &P::groups_with_gradients, py::arg("groups"))
      .def("close", &P::close)
      .def_readwrite("state", &P::state)
      .def_readwrite("module_callback", &P::module_callback);
}

}  // namespace ductile::python
