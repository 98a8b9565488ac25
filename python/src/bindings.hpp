// Shared pieces of the _ductile extension module: the runtime handle every
// binding creates plugins from, Params <-> Python conversion, and the
// registration functions of each part (one file each).
//
// Ownership: Python holds a RuntimeHandle through a shared_ptr; plugin
// objects handed to Python keep their library loaded on their own (see
// core/runtime.hpp), so they may outlive the handle.
// Threading: every call runs with the GIL held unless it says otherwise; the
// long-running C++ calls (packing, policy search) release it.
// Errors: C++ exceptions become the Python classes of ductile._errors (see
// module.cpp); nothing is caught and dropped here.
#pragma once

#include <limits>

#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

#include "ductile/core/runtime.hpp"
#include "ductile/params.hpp"

namespace ductile::pipeline {
struct DeepSpeedScheduleSpec;
}

namespace ductile::python {

namespace py = pybind11;

// A loaded runtime (registry + validated configuration) shared by the
// Python objects created from it.
struct RuntimeHandle {
  explicit RuntimeHandle(core::Runtime r) : runtime(std::move(r)) {}
  core::Runtime runtime;
  std::mutex mutex;  // Runtime::create is not documented as thread-safe
};

// The runtime for an empty configuration with these extra plugin
// directories (searched first, then DUCTILE_PLUGIN_PATH, then the built-in
// directory), cached per directory list and DUCTILE_PLUGIN_PATH value so
// that repeated calls do not rescan and reload the plugins.
std::shared_ptr<RuntimeHandle> plain_runtime(const std::vector<std::filesystem::path>& dirs);

// Converts a Python dict of plain values (bool, int, float, str, lists of
// those) to Params; `where` names the argument in error messages. Throws
// ductile::Error(invalid_argument) naming the key and the value's type.
Params params_from_dict(const py::dict& dict, const std::string& where);
py::dict dict_from_params(const Params& params);

// One argument of a Python call converted to C++, strictly: no bool for a
// number, no float for an integer, no number for a string. An int is a
// Python int or anything with __index__ (numpy integers), within
// [low, high]; a real is an int or a float; text is a str that encodes to
// UTF-8 (no lone surrogates). Errors are ductile::Error(invalid_argument):
// "<name> = <repr> is not an integer (float); give an int" or "<name> = <repr>
// is out of range; must be between <low> and <high>". Caller holds the GIL.
// The name of a Python value's type, for messages ("int", "list").
std::string python_type_name(const py::handle& value);

std::int64_t int_argument(const py::handle& value, const std::string& name,
                          std::int64_t low = std::numeric_limits<std::int64_t>::min(),
                          std::int64_t high = std::numeric_limits<std::int64_t>::max());
double real_argument(const py::handle& value, const std::string& name);
bool bool_argument(const py::handle& value, const std::string& name);
std::string text_argument(const py::handle& value, const std::string& name);

// Converts a Python sequence of paths (str or os.PathLike) or None.
std::vector<std::filesystem::path> paths_from(const py::object& paths);

void register_errors(py::module_& m);
void register_runtime(py::module_& m);
void register_elasticity(py::module_& m);
void register_batching(py::module_& m);
void register_zero(py::module_& m);
void register_optimizer(py::module_& m);
// _ductile.optimizer.HostBuffer (host_buffer.cpp).
void register_host_buffer(py::module_& m);
// _ductile.lr_schedules: DeepSpeed's schedulers (lr_schedules_binding.cpp),
// and a read scheduler block as {"type", "params"} (Runtime.from_deepspeed).
void register_lr_schedules(py::module_& m);
py::object deepspeed_scheduler_dict(const pipeline::DeepSpeedScheduleSpec& spec);
// _ductile.shard_io: CRC-32C and the checksummed write of shard files
// (shard_io.cpp).
void register_shard_io(py::module_& m);

}  // namespace ductile::python
