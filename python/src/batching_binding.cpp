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

// A keyword argument of pack() converted strictly (bindings.hpp), named by
// its keyword in errors.
template <class T>
T arg(const py::dict& d, const char* key) {
  const py::handle value = d[key];
  if constexpr (std::is_same_v<T, std::int64_t>)
    return int_argument(value, key);
  else if constexpr (std::is_same_v<T, double>)
    return real_argument(value, key);
  else if constexpr (std::is_same_v<T, bool>)
    return bool_argument(value, key);
  else
    return text_argument(value, key);
}

template <class T>
std::optional<T> opt(const py::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return std::nullopt;
  return arg<T>(d, key);
}

// pipeline::pack_plan on a lengths buffer read in place. `options` holds the
// keyword arguments of ductile.batching.pack (None: not given).
py::dict pack(const py::buffer& lengths_buffer, const py::dict& o, const py::object& runtime_arg,
              const py::object& plugin_path) {
  auto runtime = runtime_or_plain(runtime_arg, plugin_path);
  const py::buffer_info lengths_info = lengths_buffer.request();
  const auto lengths = int64_view(lengths_info, "lengths");
  pipeline::PackPlanOptions options;
  options.sampler = arg<std::string>(o, "sampler");
  options.max_tokens = opt<std::int64_t>(o, "max_tokens");
  options.order = opt<std::string>(o, "order");
  options.seed = opt<std::int64_t>(o, "seed");
  options.min_batch_size = opt<std::int64_t>(o, "min_batch_size");
  options.max_batch_size = opt<std::int64_t>(o, "max_batch_size");
  options.effective_batch_size = opt<std::int64_t>(o, "effective_batch_size");
  options.same_size_microbatches = opt<bool>(o, "same_size_microbatches");
  options.budget = opt<std::string>(o, "budget");
  if (o.contains("params") && !o["params"].is_none())
    options.sampler_params = params_from_dict(o["params"].cast<py::dict>(), "params");
  options.ranks = arg<std::int64_t>(o, "ranks");
  options.lr_rule = opt<std::string>(o, "lr_rule");
  if (o.contains("lr_params") && !o["lr_params"].is_none())
    options.lr_params = params_from_dict(o["lr_params"].cast<py::dict>(), "lr_params");
  options.base_batch_size = opt<double>(o, "base_batch_size");
  options.schedule.kind = pipeline::parse_lr_schedule_kind(arg<std::string>(o, "schedule"));
  options.schedule.base_lr = arg<double>(o, "base_lr");
  options.schedule.min_lr = arg<double>(o, "min_lr");
  options.schedule.warmup_steps = arg<std::int64_t>(o, "warmup_steps");
  options.schedule.total_steps = arg<std::int64_t>(o, "total_steps");
  pipeline::PackPlan plan;
  {
    py::gil_scoped_release release;
    plan = pipeline::pack_plan(runtime->runtime, lengths, options);
  }
  py::dict out;
  out["lrs"] = plan.lr_rule ? py::object(to_numpy(std::move(plan.lrs))) : py::none();
  out["microbatch_ranks"] = to_numpy(std::move(plan.microbatch_ranks));
  out["rank_microbatches"] = to_numpy(std::move(plan.rank_microbatches));
  out["rank_offsets"] = to_numpy(std::move(plan.rank_offsets));
  out["microbatch_offsets"] = to_numpy(std::move(plan.microbatch_offsets));
  out["sample_ids"] = to_numpy(std::move(plan.sample_ids));
  out["microbatch_steps"] = to_numpy(std::move(plan.microbatch_steps));
  out["batch_sizes"] = to_numpy(std::move(plan.batch_sizes));
  out["batch_max_seqlens"] = to_numpy(std::move(plan.batch_max_seqlens));
  out["dropped_ids"] = to_numpy(std::move(plan.dropped_ids));
  out["leftover_ids"] = to_numpy(std::move(plan.leftover_ids));
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

py::dict deepspeed_batching(const std::string& json_text, const std::string& origin,
                            const std::filesystem::path& base_dir) {
  auto runtime = plain_runtime({});
  auto ds =
      pipeline::parse_deepspeed_batching(json_text, origin, base_dir, runtime->runtime.registry());
  py::dict out;
  out["enabled"] = ds.enabled;
  out["sampler"] = ds.sampler;
  out["sampler_params"] = dict_from_params(ds.sampler_params);
  out["lr_rule"] = ds.lr_rule;
  out["lr_params"] = dict_from_params(ds.lr_params);
  out["base_batch_size"] = ds.base_batch_size;
  out["schedule"] = pipeline::to_string(ds.schedule.kind);
  out["base_lr"] = ds.schedule.base_lr;
  out["min_lr"] = ds.schedule.min_lr;
  out["warmup_steps"] = ds.schedule.warmup_steps;
  out["total_steps"] = ds.schedule.total_steps;
  out["lengths_prefix"] = ds.lengths_prefix.string();
  return out;
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

  m.def("pack", &pack, py::arg("lengths"), py::arg("options"), py::arg("runtime") = py::none(),
        py::arg("plugin_path") = py::none());

  m.def("deepspeed_batching", &deepspeed_batching, py::arg("json_text"), py::arg("origin"),
        py::arg("base_dir") = std::filesystem::path());

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
           py::arg("schedule") = "constant", py::arg("base_lr") = 1e-3, py::arg("min_lr") = 0.0,
           py::arg("warmup_steps") = 0, py::arg("total_steps") = 0)
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
