// The _ductile extension module: error translation, Params conversion, the
// runtime (configuration + plugin registry) binding. The Python package
// `ductile` wraps it; users never import _ductile directly.
#include <cstdlib>
#include <map>

#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include "bindings.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/files.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/core/text.hpp"
#include "ductile/pipeline/deepspeed_config.hpp"
#include "ductile/pipeline/json.hpp"
#include "ductile/version.hpp"
#include "host_world.hpp"

namespace ductile::python {

namespace {

// Raises the ductile._errors class for a C++ error (chosen there from the
// error's type name, else its kind), carrying the C++ message unchanged: the
// same text the CLI prints after "ductile: error: ".
void raise_translated(const Error& e) {
  py::gil_scoped_acquire gil;
  py::list diagnostics;
  if (auto* config = dynamic_cast<const core::ConfigError*>(&e))
    for (const auto& d : config->diagnostics()) diagnostics.append(d.format());
  py::object errors = py::module_::import("ductile._errors");
  // Escaped (core::printable): valid UTF-8 for Python, no control or bidi
  // character acting on a terminal.
  py::object exception = errors.attr("from_native")(to_string(e.kind()), e.type(),
                                                    core::printable(e.what()), diagnostics);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
}

}  // namespace

void register_errors(py::module_&) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      raise_translated(e);
    }
    // Anything else falls through to pybind11's own translators
    // (std::bad_alloc -> MemoryError, std::exception -> RuntimeError, ...).
  });
}

std::string python_type_name(const py::handle& value) {
  return py::str(py::type::of(value).attr("__name__")).cast<std::string>();
}

namespace {

std::string shown(const py::handle& value) {
  std::string text = py::repr(value).cast<std::string>();
  if (text.size() > 80) text = text.substr(0, 80) + "...";
  return text;
}

Error not_a(const py::handle& value, const std::string& name, const char* what, const char* hint) {
  return Error(ErrorKind::invalid_argument, name + " = " + shown(value) + " is not " + what + " (" +
                                                python_type_name(value) + "); " + hint);
}

}  // namespace

std::int64_t int_argument(const py::handle& value, const std::string& name, std::int64_t low,
                          std::int64_t high) {
  if (PyBool_Check(value.ptr()) || !PyIndex_Check(value.ptr())) {
    const bool bounded = low > std::numeric_limits<std::int64_t>::min() ||
                         high < std::numeric_limits<std::int64_t>::max();
    const std::string hint =
        bounded ? "give an int from " + std::to_string(low) + " to " + std::to_string(high)
                : std::string("give an int");
    throw not_a(value, name, "an integer", hint.c_str());
  }
  auto index = py::reinterpret_steal<py::object>(PyNumber_Index(value.ptr()));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0 || v < low || v > high)
    throw Error(ErrorKind::invalid_argument,
                name + " = " + shown(value) + " is out of range; must be between " +
                    std::to_string(low) + " and " + std::to_string(high));
  return static_cast<std::int64_t>(v);
}

double real_argument(const py::handle& value, const std::string& name) {
  if (PyBool_Check(value.ptr()) || !(PyFloat_Check(value.ptr()) || PyIndex_Check(value.ptr())))
    throw not_a(value, name, "a number", "give an int or a float");
  const double v = PyFloat_AsDouble(value.ptr());
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw Error(ErrorKind::invalid_argument,
                name + " = " + shown(value) + " is out of range for a float");
  }
  return v;
}

bool bool_argument(const py::handle& value, const std::string& name) {
  if (!PyBool_Check(value.ptr())) throw not_a(value, name, "a bool", "give True or False");
  return value.ptr() == Py_True;
}

std::string text_argument(const py::handle& value, const std::string& name) {
  if (!PyUnicode_Check(value.ptr())) throw not_a(value, name, "a string", "give a str");
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(value.ptr(), &size);
  if (utf8 == nullptr) {
    PyErr_Clear();
    throw Error(ErrorKind::invalid_argument,
                name + " = " + shown(value) +
                    " is not valid text: it holds a lone surrogate, which UTF-8 cannot encode");
  }
  return std::string(utf8, static_cast<std::size_t>(size));
}

std::vector<std::filesystem::path> paths_from(const py::object& paths) {
  std::vector<std::filesystem::path> out;
  if (paths.is_none()) return out;
  if (py::isinstance<py::str>(paths) || py::hasattr(paths, "__fspath__"))
    throw Error(ErrorKind::invalid_argument,
                "plugin_path must be a list of directories, got a single path '" +
                    py::str(paths).cast<std::string>() + "': wrap it in a list");
  if (!py::isinstance<py::iterable>(paths))
    throw not_a(paths, "plugin_path", "a list of directories", "give a list of paths");
  for (const auto& item : paths) {
    if (!py::isinstance<py::str>(item) && !py::hasattr(item, "__fspath__"))
      throw not_a(item, "plugin_path entry", "a path", "give a str or an os.PathLike");
    // A path's bytes, as the file system has them (a name that is not UTF-8
    // included).
    py::object bytes;
    try {
      bytes = py::module_::import("os").attr("fsencode")(item);
    } catch (py::error_already_set&) {
      throw Error(ErrorKind::invalid_argument,
                  "plugin_path entry " + shown(item) +
                      " holds a lone surrogate, which no file name can hold");
    }
    out.emplace_back(bytes.cast<std::string>());
  }
  return out;
}

std::shared_ptr<RuntimeHandle> plain_runtime(const std::vector<std::filesystem::path>& dirs) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<RuntimeHandle>> cache;
  std::string key;
  for (const auto& d : dirs) key += d.string() + '\n';
  const char* env = std::getenv("DUCTILE_PLUGIN_PATH");
  key += "\nDUCTILE_PLUGIN_PATH=";
  key += env ? env : "";
  std::lock_guard lock(mutex);
  auto& slot = cache[key];
  if (!slot) {
    core::RuntimeOptions options;
    options.extra_plugin_dirs = dirs;
    slot = std::make_shared<RuntimeHandle>(
        core::Runtime::from_string("", "python", std::move(options)));
  }
  return slot;
}

Params params_from_dict(const py::dict& dict, const std::string& where) {
  Params params;
  for (auto item : dict) {
    const std::string key = py::str(item.first).cast<std::string>();
    py::handle v = item.second;
    auto bad = [&]() {
      return Error(ErrorKind::invalid_argument,
                   where + ": parameter '" + key + "' has a value of type " + python_type_name(v) +
                       " (" + py::repr(v).cast<std::string>() +
                       "); valid: bool, int, float, str, or a list of int, float or str");
    };
    if (py::isinstance<py::bool_>(v)) {
      params.set(key, v.cast<bool>());
    } else if (py::isinstance<py::int_>(v)) {
      params.set(key, v.cast<std::int64_t>());
    } else if (py::isinstance<py::float_>(v)) {
      params.set(key, v.cast<double>());
    } else if (py::isinstance<py::str>(v)) {
      params.set(key, v.cast<std::string>());
    } else if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
      py::sequence seq = py::reinterpret_borrow<py::sequence>(v);
      bool all_int = true, all_number = true, all_str = true;
      for (auto e : seq) {
        const bool is_bool = py::isinstance<py::bool_>(e);
        const bool is_int = py::isinstance<py::int_>(e) && !is_bool;
        all_int &= is_int;
        all_number &= is_int || py::isinstance<py::float_>(e);
        all_str &= py::isinstance<py::str>(e);
      }
      if (all_int)
        params.set(key, seq.cast<std::vector<std::int64_t>>());
      else if (all_number)
        params.set(key, seq.cast<std::vector<double>>());
      else if (all_str)
        params.set(key, seq.cast<std::vector<std::string>>());
      else
        throw bad();
    } else {
      throw bad();
    }
  }
  return params;
}

py::dict dict_from_params(const Params& params) {
  py::dict out;
  for (const auto& entry : params.values())
    std::visit([&](const auto& v) { out[py::str(entry.first)] = py::cast(v); }, entry.second);
  return out;
}

namespace {

PluginKind kind_from(const std::string& text) {
  PluginKind kind;
  if (!core::parse_plugin_kind(text, kind))
    throw Error(ErrorKind::invalid_argument, "plugin kind '" + text + "' is unknown; valid: " +
                                                 core::join(core::plugin_kind_names()));
  return kind;
}

py::dict plugin_info(const core::PluginInfo& info) {
  py::dict d;
  d["kind"] = to_string(info.kind);
  d["name"] = info.name;
  d["version"] = info.version;
  d["description"] = info.description;
  d["file"] = info.file.string();
  py::list params;
  for (const auto& p : info.params) {
    py::dict spec;
    spec["key"] = p.key;
    spec["type"] = to_string(p.type);
    spec["required"] = (p.flags & param_required) != 0;
    spec["default"] = p.default_value ? py::object(py::str(p.default_value)) : py::none();
    spec["doc"] = p.doc ? p.doc : "";
    params.append(spec);
  }
  d["params"] = params;
  return d;
}

// pipeline::DeepSpeedTraining field by field; what is not set is None.
py::dict training_dict(const pipeline::DeepSpeedTraining& t) {
  auto optional = [](const std::optional<double>& v) {
    return v ? py::object(py::float_(*v)) : py::object(py::none());
  };
  py::dict d;
  d["precision"] = t.precision;
  d["loss_scale"] = t.loss_scale;
  d["initial_scale_power"] = t.initial_scale_power;
  d["loss_scale_window"] = t.loss_scale_window;
  d["hysteresis"] = t.hysteresis;
  d["min_loss_scale"] = t.min_loss_scale;
  d["gradient_clipping"] = optional(t.gradient_clipping);
  if (t.optimizer) {
    const auto& o = *t.optimizer;
    py::dict opt;
    opt["type"] = o.type;
    opt["decoupled_weight_decay"] = o.decoupled_weight_decay;
    opt["lr"] = optional(o.lr);
    opt["eps"] = optional(o.eps);
    opt["weight_decay"] = optional(o.weight_decay);
    opt["betas"] =
        o.betas ? py::object(py::make_tuple((*o.betas)[0], (*o.betas)[1])) : py::object(py::none());
    d["optimizer"] = opt;
  } else {
    d["optimizer"] = py::none();
  }
  auto count = [](const std::optional<std::int64_t>& v) {
    return v ? py::object(py::int_(*v)) : py::object(py::none());
  };
  d["train_batch_size"] = count(t.train_batch_size);
  d["train_micro_batch_size_per_gpu"] = count(t.train_micro_batch_size_per_gpu);
  d["gradient_accumulation_steps"] = count(t.gradient_accumulation_steps);
  d["steps_per_print"] = count(t.steps_per_print);
  d["wall_clock_breakdown"] = t.wall_clock_breakdown;
  d["dataloader_drop_last"] = t.dataloader_drop_last;
  d["log_level"] = t.log_level;
  d["scheduler"] = t.scheduler ? deepspeed_scheduler_dict(*t.scheduler) : py::none();
  return d;
}

// A JSON value as Python's json module builds it (dict, list, str, int,
// float, bool, None). The depth is bounded by parse_bounded_json.
py::object python_of_json(const nlohmann::json& value) {
  switch (value.type()) {
    case nlohmann::json::value_t::object: {
      py::dict out;
      for (auto it = value.begin(); it != value.end(); ++it)
        out[py::str(it.key())] = python_of_json(it.value());
      return out;
    }
    case nlohmann::json::value_t::array: {
      py::list out;
      for (const auto& element : value) out.append(python_of_json(element));
      return out;
    }
    case nlohmann::json::value_t::string:
      return py::str(value.get_ref<const std::string&>());
    case nlohmann::json::value_t::boolean:
      return py::bool_(value.get<bool>());
    case nlohmann::json::value_t::number_integer:
      return py::int_(value.get<std::int64_t>());
    case nlohmann::json::value_t::number_unsigned:
      return py::int_(value.get<std::uint64_t>());
    case nlohmann::json::value_t::number_float:
      return py::float_(value.get<double>());
    default:
      return py::none();
  }
}

// A configuration loaded from Python runs no code from the directories its
// own [plugins] path names unless the caller consents, as `ductile config
// check` needs --allow-config-plugins: a file received from elsewhere is
// read, not run.
core::RuntimeOptions python_runtime_options(const py::object& plugin_path,
                                            bool allow_config_plugins) {
  core::RuntimeOptions options;
  options.extra_plugin_dirs = paths_from(plugin_path);
  options.search_config_plugin_dirs = allow_config_plugins;
  options.config_dirs_note =
      "named by the configuration's [plugins] path; Python loads no plugin from there unless "
      "the caller passes allow_config_plugins=True";
  return options;
}

}  // namespace

void register_runtime(py::module_& m) {
  py::class_<RuntimeHandle, std::shared_ptr<RuntimeHandle>>(
      m, "Runtime",
      "A ductile configuration loaded and validated against the plugins' schemas, "
      "with its plugin registry.")
      .def_static(
          "from_file",
          [](const std::filesystem::path& file, const py::object& plugin_path,
             bool allow_config_plugins) {
            return std::make_shared<RuntimeHandle>(core::Runtime::from_file(
                file, python_runtime_options(plugin_path, allow_config_plugins)));
          },
          py::arg("file"), py::arg("plugin_path") = py::none(),
          py::arg("allow_config_plugins") = false)
      .def_static(
          "from_toml",
          [](const std::string& text, const std::string& name, const py::object& plugin_path,
             bool allow_config_plugins) {
            return std::make_shared<RuntimeHandle>(core::Runtime::from_string(
                text, name, python_runtime_options(plugin_path, allow_config_plugins)));
          },
          py::arg("text"), py::arg("name") = "<string>", py::arg("plugin_path") = py::none(),
          py::arg("allow_config_plugins") = false)
      .def_static(
          "from_deepspeed",
          [](const std::string& text, const std::string& origin, const py::object& plugin_path,
             const std::string& base_dir, bool require_elasticity, bool require_zero_stage3,
             const std::string& accelerator_backend, bool read_training) {
            auto base = plain_runtime(paths_from(plugin_path));
            std::vector<std::string> warnings;
            pipeline::DeepSpeedTraining training;
            std::lock_guard lock(base->mutex);
            auto runtime = pipeline::runtime_from_deepspeed(
                base->runtime, text, origin, base_dir, /*plugin_checks=*/false,
                {.require_elasticity = require_elasticity,
                 .require_zero_stage3 = require_zero_stage3,
                 .accelerator_backend = accelerator_backend,
                 .read_training = read_training},
                &warnings, &training);
            return py::make_tuple(std::make_shared<RuntimeHandle>(std::move(runtime)), warnings,
                                  training_dict(training));
          },
          py::arg("text"), py::arg("origin"), py::arg("plugin_path") = py::none(),
          py::arg("base_dir") = "", py::arg("require_elasticity") = false,
          py::arg("require_zero_stage3") = false, py::arg("accelerator_backend") = "",
          py::arg("read_training") = false,
          "A DeepSpeed JSON config mapped onto ductile's sections and validated "
          "(pipeline::runtime_from_deepspeed): (runtime, warnings, training), training "
          "being pipeline::DeepSpeedTraining as a dict (its defaults unless read_training).")
      .def(
          "offload_optimizer",
          [](RuntimeHandle& h, const std::string& json_object, const std::string& origin) {
            std::vector<std::string> warnings;
            std::lock_guard lock(h.mutex);
            auto params = pipeline::deepspeed_offload_optimizer(json_object, origin,
                                                                h.runtime.registry(), &warnings);
            return py::make_tuple(dict_from_params(params), warnings);
          },
          py::arg("json_object"), py::arg("origin"),
          "[zero]'s optimizer offload keys of a DeepSpeed offload_optimizer object given "
          "apart from a config (pipeline::deepspeed_offload_optimizer): (keys, warnings).")
      .def_static(
          "plain",
          [](const py::object& plugin_path) { return plain_runtime(paths_from(plugin_path)); },
          py::arg("plugin_path") = py::none(),
          "The shared runtime of an empty configuration (plugins only).")
      .def_property_readonly("source_name",
                             [](RuntimeHandle& h) { return h.runtime.config().source_name(); })
      .def("has",
           [](RuntimeHandle& h, const std::string& kind) { return h.runtime.has(kind_from(kind)); })
      .def(
          "section",
          [](RuntimeHandle& h, const std::string& kind) -> py::object {
            const auto* s = h.runtime.config().section(kind_from(kind));
            if (!s) return py::none();
            py::dict d;
            d["section"] = s->section;
            d["plugin"] = s->plugin;
            d["params"] = dict_from_params(s->params);
            d["host_params"] = dict_from_params(s->host_params);
            return d;
          },
          "The validated section of a plugin kind: plugin, params, host_params (or None).")
      .def_property_readonly(
          "base_dir", [](RuntimeHandle& h) { return h.runtime.config().base_dir().string(); })
      .def(
          "plugins",
          [](RuntimeHandle& h, const py::object& kind) {
            py::list out;
            std::optional<PluginKind> only;
            if (!kind.is_none()) only = kind_from(kind.cast<std::string>());
            for (const auto& info : h.runtime.registry().plugins())
              if (!only || info.kind == *only) out.append(plugin_info(info));
            return out;
          },
          py::arg("kind") = py::none())
      .def(
          "plugin",
          [](RuntimeHandle& h, const std::string& kind, const std::string& name) {
            return plugin_info(h.runtime.registry().find(kind_from(kind), name));
          },
          py::arg("kind"), py::arg("name"))
      .def_property_readonly("search_path", [](RuntimeHandle& h) {
        py::list out;
        for (const auto& p : h.runtime.registry().search_path()) out.append(p.string());
        return out;
      });

  m.def(
      "int_argument",
      [](const py::object& value, const std::string& name, std::int64_t low, std::int64_t high) {
        return int_argument(value, name, low, high);
      },
      py::arg("value"), py::arg("name"), py::arg("low") = std::numeric_limits<std::int64_t>::min(),
      py::arg("high") = std::numeric_limits<std::int64_t>::max(),
      "The value as an int64 within [low, high]: a Python int or an object with __index__, "
      "never a bool or a float; otherwise InvalidArgumentError naming `name`.");
  m.def(
      "parse_json",
      [](const std::string& text, const std::string& origin) {
        return python_of_json(
            pipeline::parse_bounded_json(text, origin, "invalid JSON", ErrorKind::config));
      },
      py::arg("text"), py::arg("origin"),
      "A JSON text as Python objects, read by the CLI's reader (pipeline::parse_bounded_json): "
      "nesting of at most 64 levels, nothing after the value, a key once per object, a UTF-8 "
      "byte order mark skipped. ConfigError naming `origin` otherwise.");
  m.def(
      "read_user_file",
      [](const std::filesystem::path& file, const std::string& role, std::uintmax_t max_bytes) {
        std::string text;
        {
          // A slow disk must not hold up the other Python threads.
          py::gil_scoped_release released;
          text = core::read_user_file(file, role, max_bytes);
        }
        return py::bytes(text);
      },
      py::arg("file"), py::arg("role"), py::arg("max_bytes") = core::kMaxConfigFileBytes,
      "The bytes of a file a user names (core::read_user_file, as the CLI reads it): a regular "
      "file of at most max_bytes, opened without waiting on a FIFO. NotFoundError or IoError "
      "naming the file and what is wrong.");
  m.def(
      "checkpoint_key",
      []() -> py::tuple {
        std::optional<core::CheckpointKey> key;
        {
          py::gil_scoped_release released;
          key = core::checkpoint_key_from_environment();
        }
        if (!key) return py::make_tuple(py::none(), py::none());
        return py::make_tuple(py::bytes(key->bytes), key->variable);
      },
      "The key that signs and checks checkpoints (core::checkpoint_key_from_environment, as "
      "the agent reads it): (the bytes of the file DUCTILE_CHECKPOINT_KEY_FILE names, blanks "
      "at its ends dropped, or of DUCTILE_CHECKPOINT_KEY; the variable that gave them), or "
      "(None, None) when neither is set. InvalidArgumentError naming the variable (both set, "
      "empty, too short), or NotFoundError/IoError naming the file.");
  m.def(
      "init_logging",
      [](const py::object& level) {
        if (level.is_none())
          core::init_logging();
        else
          core::init_logging(level.cast<std::string>());
      },
      py::arg("level") = py::none(),
      "Sets the level of ductile's C++ loggers (stderr): trace, debug, info, warn, error, "
      "critical, off; default DUCTILE_LOG_LEVEL or info.");
}

}  // namespace ductile::python

PYBIND11_MODULE(_ductile, m) {
  namespace dp = ductile::python;
  m.doc() = "ductile's C++ core and plugins (use the `ductile` package, not this module)";
  m.attr("__version__") = DUCTILE_SDK_VERSION_STRING;
  // The bound of [zero] log_interval (its schema, steps_per_print's), for
  // the engine's attribute.
  m.attr("MAX_LOG_INTERVAL") = ductile::pipeline::kMaxLogInterval;
  // The deepest nesting parse_json reads.
  m.attr("MAX_JSON_DEPTH") = ductile::pipeline::kMaxJsonDepth;
  dp::register_errors(m);
  dp::register_runtime(m);
  auto elasticity = m.def_submodule("elasticity");
  dp::register_elasticity(elasticity);
  auto batching = m.def_submodule("batching");
  dp::register_batching(batching);
  auto zero = m.def_submodule("zero");
  dp::register_zero(zero);
  dp::register_host_world(zero);
  auto optimizer = m.def_submodule("optimizer");
  dp::register_optimizer(optimizer);
  dp::register_host_buffer(optimizer);
  auto lr_schedules = m.def_submodule("lr_schedules");
  dp::register_lr_schedules(lr_schedules);
  auto shard_io = m.def_submodule("shard_io");
  dp::register_shard_io(shard_io);
}
