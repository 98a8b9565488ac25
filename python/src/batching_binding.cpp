// _ductile.batching: reading length files, packing a lengths buffer with a
// sampler plugin (zero-copy in, numpy arrays out), per-step learning rates
// through the variable-batch schedule and an lr plugin, and the DeepSpeed
// JSON mapping of dynamic batching.
#include <chrono>
#include <type_traits>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include "bindings.hpp"
#include "ductile/batch_sampler.hpp"
#include "ductile/lr_scaling_rule.hpp"
#include "ductile/pipeline/deepspeed_batching.hpp"
#include "ductile/pipeline/lengths.hpp"
#include "ductile/pipeline/lr_schedule.hpp"
#include "ductile/pipeline/pack_plan.hpp"

namespace ductile::python {

namespace {

// Hands a vector to numpy without copying: the array owns it through a capsule.
template <class T>
py::array_t<T> to_numpy(std::vector<T>&& values) {
  auto* owned = new std::vector<T>(std::move(values));
  py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>({static_cast<py::ssize_t>(owned->size())},
                        {static_cast<py::ssize_t>(sizeof(T))}, owned->data(), owner);
}

std::string buffer_dtype(const py::buffer_info& info) {
  return "format '" + info.format + "', " + std::to_string(info.itemsize) + "-byte items";
}

// A read-only view of a 1-D, contiguous int64 buffer (numpy int64 array,
// torch tensor through numpy(), array.array('q'), memoryview). The view
// borrows the buffer: keep `info` alive while using the span.
std::span<const std::int64_t> int64_view(const py::buffer_info& info, const std::string& what) {
  const bool int64 = info.itemsize == 8 && !info.format.empty() &&
                     (info.format.back() == 'q' || info.format.back() == 'l') &&
                     info.format.find_first_of(">!") == std::string::npos;
  if (!int64)
    throw Error(ErrorKind::invalid_argument,
                what + ": need a 1-D array of int64 (native byte order), got " +
                    buffer_dtype(info) +
                    "; convert it with numpy.asarray(values, dtype=numpy.int64)");
  if (info.ndim != 1)
    throw Error(ErrorKind::invalid_argument,
                what + ": need a 1-D array, got " + std::to_string(info.ndim) + " dimensions");
  if (info.shape[0] > 1 && info.strides[0] != 8)
    throw Error(ErrorKind::invalid_argument, what + ": need a contiguous array, got a stride of " +
                                                 std::to_string(info.strides[0]) +
                                                 " bytes; pass numpy.ascontiguousarray(values)");
  return {static_cast<const std::int64_t*>(info.ptr), static_cast<std::size_t>(info.shape[0])};
}

pipeline::LrScheduleSpec schedule_spec(const std::string& kind, double base_lr, double min_lr,
                                       std::int64_t warmup_steps, std::int64_t total_steps) {
  pipeline::LrScheduleSpec spec;
  spec.kind = pipeline::parse_lr_schedule_kind(kind);
  spec.base_lr = base_lr;
  spec.min_lr = min_lr;
  spec.warmup_steps = warmup_steps;
  spec.total_steps = total_steps;
  pipeline::check_lr_schedule(spec);
  return spec;
}

std::shared_ptr<RuntimeHandle> runtime_or_plain(const py::object& runtime,
                                                const py::object& plugin_path) {
  if (!runtime.is_none()) return runtime.cast<std::shared_ptr<RuntimeHandle>>();
  return plain_runtime(paths_from(plugin_path));
}

template <class Interface>
std::shared_ptr<Interface> create(RuntimeHandle& runtime, const std::string& name,
                                  const Params& params) {
  std::lock_guard lock(runtime.mutex);
  return runtime.runtime.create<Interface>(name, params);
}

// One learning-rate rule plugin instance, for schedules and wrapped
// torch schedulers.
struct RuleHandle {
  std::shared_ptr<RuntimeHandle> runtime;
  std::shared_ptr<LrScalingRule> rule;
  std::string name;
};

struct ScheduleHandle {
  std::shared_ptr<RuleHandle> rule;
  pipeline::VariableBatchLrSchedule schedule;
};

// The keyword arguments of ductile.batching.pack, each with the
// PackPlanOptions field it fills: one table, read by pack() (Python -> C++,
// in this order, so the first bad argument is the one reported) and by
// settings() (C++ -> Python: the options a configuration gives).
template <class Options, class Visit>
void for_each_option(Options& o, Visit&& visit) {
  visit("sampler", o.sampler);
  visit("max_tokens", o.max_tokens);
  visit("order", o.order);
  visit("seed", o.seed);
  visit("min_batch_size", o.min_batch_size);
  visit("max_batch_size", o.max_batch_size);
  visit("effective_batch_size", o.effective_batch_size);
  visit("same_size_microbatches", o.same_size_microbatches);
  visit("budget", o.budget);
  visit("params", o.sampler_params);
  visit("ranks", o.ranks);
  visit("lr_rule", o.lr_rule);
  visit("lr_params", o.lr_params);
  visit("base_batch_size", o.base_batch_size);
  visit("schedule", o.schedule.kind);
  visit("base_lr", o.schedule.base_lr);
  visit("min_lr", o.schedule.min_lr);
  visit("warmup_steps", o.schedule.warmup_steps);
  visit("total_steps", o.schedule.total_steps);
}

// The keys of for_each_option that mean nothing without an lr rule.
constexpr const char* kScheduleKeys[] = {"lr_params", "base_batch_size", "schedule",   "base_lr",
                                         "min_lr",    "warmup_steps",    "total_steps"};

// One keyword argument converted strictly (bindings.hpp), named by its
// keyword in errors; None (or absent) leaves the field as it is.
struct ReadOption {
  const py::dict& kwargs;

  template <class T>
  void operator()(const char* key, T& field) const {
    if (!kwargs.contains(key) || kwargs[key].is_none()) return;
    const py::handle value = kwargs[key];
    if constexpr (std::is_same_v<T, std::int64_t>)
      field = int_argument(value, key);
    else if constexpr (std::is_same_v<T, double>)
      field = real_argument(value, key);
    else if constexpr (std::is_same_v<T, bool>)
      field = bool_argument(value, key);
    else if constexpr (std::is_same_v<T, std::string>)
      field = text_argument(value, key);
    else if constexpr (std::is_same_v<T, Params>)
      field = params_from_dict(py::reinterpret_borrow<py::dict>(value), key);
    else if constexpr (std::is_same_v<T, pipeline::LrScheduleKind>)
      field = pipeline::parse_lr_schedule_kind(text_argument(value, key));
    else
      (*this)(key, field.emplace());  // a std::optional
  }
};

// One field as a keyword argument; an unset optional is left out.
struct WriteOption {
  py::dict& kwargs;

  template <class T>
  void operator()(const char* key, const T& field) const {
    if constexpr (std::is_same_v<T, Params>)
      kwargs[key] = dict_from_params(field);
    else if constexpr (std::is_same_v<T, pipeline::LrScheduleKind>)
      kwargs[key] = pipeline::to_string(field);
    else if constexpr (std::is_same_v<T, std::int64_t> || std::is_same_v<T, double> ||
                       std::is_same_v<T, bool> || std::is_same_v<T, std::string>)
      kwargs[key] = field;
    else if (field)
      (*this)(key, *field);
  }
};

// A PackPlan kept whole for to_json(); the numpy arrays of the Python
// PackPlan are views of its vectors, and each keeps it alive.
struct PlanHandle {
  pipeline::PackPlan plan;
};

template <class T>
py::array_t<T> view(std::vector<T>& values, const py::object& owner) {
  return py::array_t<T>({static_cast<py::ssize_t>(values.size())},
                        {static_cast<py::ssize_t>(sizeof(T))}, values.data(), owner);
}

// pipeline::pack_plan on a lengths buffer read in place. `kwargs` holds the
// keyword arguments of ductile.batching.pack (None: not given).
py::dict pack(const py::buffer& lengths_buffer, const py::dict& kwargs,
              const py::object& runtime_arg, const py::object& plugin_path) {
  auto runtime = runtime_or_plain(runtime_arg, plugin_path);
  const py::buffer_info lengths_info = lengths_buffer.request();
  const auto lengths = int64_view(lengths_info, "lengths");
  pipeline::PackPlanOptions options;
  for_each_option(options, ReadOption{kwargs});
  auto handle = std::make_shared<PlanHandle>();
  {
    py::gil_scoped_release release;
    handle->plan = pipeline::pack_plan(runtime->runtime, lengths, options);
  }
  auto& plan = handle->plan;
  const py::object owner = py::cast(handle);
  py::dict out;
  out["plan"] = owner;
  out["lrs"] = plan.lr_rule ? py::object(view(plan.lrs, owner)) : py::none();
  out["microbatch_ranks"] = view(plan.microbatch_ranks, owner);
  out["rank_microbatches"] = view(plan.rank_microbatches, owner);
  out["rank_offsets"] = view(plan.rank_offsets, owner);
  out["microbatch_offsets"] = view(plan.microbatch_offsets, owner);
  out["sample_ids"] = view(plan.sample_ids, owner);
  out["microbatch_steps"] = view(plan.microbatch_steps, owner);
  out["batch_sizes"] = view(plan.batch_sizes, owner);
  out["batch_max_seqlens"] = view(plan.batch_max_seqlens, owner);
  out["dropped_ids"] = view(plan.dropped_ids, owner);
  out["leftover_ids"] = view(plan.leftover_ids, owner);
  py::dict stats;
  stats["sequences"] = plan.stats.sequences;
  stats["tokens"] = plan.stats.tokens;
  stats["padded_tokens"] = plan.stats.padded_tokens;
  stats["token_efficiency"] = plan.stats.token_efficiency;
  stats["padded_efficiency"] = plan.stats.padded_efficiency;
  stats["seconds"] = plan.stats.seconds;
  out["stats"] = stats;
  const PackOptions& po = plan.options;
  py::dict effective;
  effective["sampler"] = plan.sampler;
  effective["lr_rule"] = plan.lr_rule ? py::cast(*plan.lr_rule) : py::none();
  effective["max_tokens"] = po.max_tokens;
  effective["min_batch_size"] = po.min_batch_size;
  effective["max_batch_size"] = po.max_batch_size;
  effective["effective_batch_size"] = po.effective_batch_size;
  effective["same_size_microbatches"] = po.same_size_microbatches;
  effective["budget"] = to_string(po.budget);
  effective["order"] = to_string(po.order);
  effective["seed"] = po.seed;
  effective["ranks"] = options.ranks;
  out["options"] = effective;
  return out;
}

// A configuration's packing settings (pipeline::PackSetup) as Python
// arguments: (keyword arguments of pack, keyword arguments of read_lengths,
// or None when the configuration names no lengths file).
py::tuple settings(const pipeline::PackSetup& setup) {
  py::dict kwargs;
  for_each_option(setup.options, WriteOption{kwargs});
  if (!setup.options.lr_rule)
    for (const char* key : kScheduleKeys)
      if (kwargs.contains(key)) PyDict_DelItemString(kwargs.ptr(), key);
  if (setup.lengths.empty()) return py::make_tuple(kwargs, py::none());
  py::dict read;
  read["file"] = setup.lengths.string();
  read["format"] = pipeline::kLengthFormatNames[static_cast<int>(setup.read.format)];
  if (!setup.read.column.empty()) read["column"] = setup.read.column;
  if (!setup.read.count_column.empty()) read["count_column"] = setup.read.count_column;
  return py::make_tuple(kwargs, read);
}

py::tuple settings_from_deepspeed(const std::string& json_text, const std::string& origin,
                                  const std::filesystem::path& base_dir,
                                  const std::shared_ptr<RuntimeHandle>& runtime) {
  std::lock_guard lock(runtime->mutex);
  return settings(
      pipeline::parse_deepspeed_batching(json_text, origin, base_dir, runtime->runtime.registry())
          .setup);
}

py::tuple settings_from_config(const std::shared_ptr<RuntimeHandle>& runtime) {
  std::lock_guard lock(runtime->mutex);
  return settings(pipeline::pack_setup_from_config(runtime->runtime.config()));
}

}  // namespace

void register_batching(py::module_& m) {
  m.def(
      "read_lengths",
      [](const std::filesystem::path& file, const std::string& format, const std::string& column,
         const std::string& count_column) {
        pipeline::LengthReadOptions options;
        options.format = pipeline::parse_length_format(format);
        options.column = column;
        options.count_column = count_column;
        std::vector<std::int64_t> lengths;
        {
          py::gil_scoped_release release;
          lengths = pipeline::read_lengths(file, options);
        }
        return to_numpy(std::move(lengths));
      },
      py::arg("file"), py::arg("format") = "auto", py::arg("column") = "",
      py::arg("count_column") = "");

  m.def("pack", &pack, py::arg("lengths"), py::arg("kwargs"), py::arg("runtime") = py::none(),
        py::arg("plugin_path") = py::none());

  m.def("settings_from_deepspeed", &settings_from_deepspeed, py::arg("json_text"),
        py::arg("origin"), py::arg("base_dir"), py::arg("runtime"));
  m.def("settings_from_config", &settings_from_config, py::arg("runtime"));

  py::class_<PlanHandle, std::shared_ptr<PlanHandle>>(m, "PackPlan", "A pipeline::PackPlan.")
      .def(
          "to_json",
          [](const PlanHandle& h, bool with_stats) {
            return pipeline::to_json(h.plan, with_stats);
          },
          py::arg("with_stats") = true, "The plan as `ductile pack --json` writes it.");

  py::class_<RuleHandle, std::shared_ptr<RuleHandle>>(m, "LrRule",
                                                      "A learning-rate scaling rule plugin.")
      .def(py::init([](const std::string& name, const py::object& params, const py::object& runtime,
                       const py::object& plugin_path) {
             auto h = std::make_shared<RuleHandle>();
             h->runtime = runtime_or_plain(runtime, plugin_path);
             h->name = name;
             h->rule = create<LrScalingRule>(
                 *h->runtime, name,
                 params.is_none() ? Params{} : params_from_dict(params.cast<py::dict>(), "params"));
             return h;
           }),
           py::arg("name"), py::arg("params") = py::none(), py::arg("runtime") = py::none(),
           py::arg("plugin_path") = py::none())
      .def_property_readonly("name", [](const RuleHandle& h) { return h.name; })
      .def(
          "scale",
          [](const RuleHandle& h, double lr, double batch_size, double base_batch_size) {
            return h.rule->scale(lr, batch_size, base_batch_size);
          },
          py::arg("lr"), py::arg("batch_size"), py::arg("base_batch_size"));

  py::class_<ScheduleHandle, std::shared_ptr<ScheduleHandle>>(
      m, "LrSchedule",
      "pipeline::VariableBatchLrSchedule: a base schedule scaled per step by a rule plugin.")
      .def(py::init([](const std::shared_ptr<RuleHandle>& rule, double base_batch_size,
                       std::vector<std::int64_t> batch_sizes, const std::string& schedule,
                       double base_lr, double min_lr, std::int64_t warmup_steps,
                       std::int64_t total_steps) {
             return std::make_shared<ScheduleHandle>(ScheduleHandle{
                 rule, pipeline::VariableBatchLrSchedule(
                           schedule_spec(schedule, base_lr, min_lr, warmup_steps, total_steps),
                           rule->rule, base_batch_size, std::move(batch_sizes))});
           }),
           py::arg("rule"), py::arg("base_batch_size"), py::arg("batch_sizes"),
           // The defaults are LrScheduleSpec's, stated there only.
           py::arg("schedule") = pipeline::to_string(pipeline::LrScheduleSpec{}.kind),
           py::arg("base_lr") = pipeline::LrScheduleSpec{}.base_lr,
           py::arg("min_lr") = pipeline::LrScheduleSpec{}.min_lr,
           py::arg("warmup_steps") = pipeline::LrScheduleSpec{}.warmup_steps,
           py::arg("total_steps") = pipeline::LrScheduleSpec{}.total_steps)
      .def_property_readonly("lr", [](const ScheduleHandle& h) { return h.schedule.lr(); })
      .def_property_readonly("step_index",
                             [](const ScheduleHandle& h) { return h.schedule.step_index(); })
      .def("step", [](ScheduleHandle& h) { return h.schedule.step(); })
      .def("lr_at",
           [](const ScheduleHandle& h, std::int64_t step) { return h.schedule.lr_at(step); })
      .def("save_state", [](const ScheduleHandle& h) { return h.schedule.save_state(); })
      .def("load_state",
           [](ScheduleHandle& h, const std::string& state) { h.schedule.load_state(state); })
      .def_property_readonly("batch_sizes",
                             [](const ScheduleHandle& h) { return h.schedule.batch_sizes(); })
      .def_property_readonly("base_batch_size",
                             [](const ScheduleHandle& h) { return h.schedule.base_batch_size(); });
}

}  // namespace ductile::python
