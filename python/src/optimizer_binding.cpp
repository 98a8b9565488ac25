// _ductile.optimizer: an optimizer plugin (cpu_adam, or one a user wrote
// against the SDK) stepping buffers that Python owns. Buffers cross as
// addresses (int): the Python side owns the torch tensors behind them and
// keeps them alive during the call, which returns when they are updated;
// nothing here keeps a pointer. The step releases the GIL, so Python threads
// may step disjoint shards at the same time (optimizer.hpp).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.hpp"
#include "ductile/optimizer.hpp"

namespace ductile::python {

namespace {

struct OptimizerHandle {
  std::shared_ptr<Optimizer> optimizer;
  std::string name;
};

HalfType half_type(const std::string& name) {
  if (name == "bfloat16") return HalfType::bf16;
  if (name == "float16") return HalfType::f16;
  throw Error(ErrorKind::invalid_argument, "optimizer step: copy_out_type '" + name +
                                               "' is not valid; valid: bfloat16, float16");
}

template <class T>
T* pointer(const py::handle& address, const char* name) {
  return reinterpret_cast<T*>(
      static_cast<std::uintptr_t>(int_argument(address, name, 0, INTPTR_MAX)));
}

}  // namespace

void register_optimizer(py::module_& m) {
  py::class_<OptimizerHandle, std::shared_ptr<OptimizerHandle>>(
      m, "Optimizer", "An optimizer plugin (ductile::Optimizer) stepping flat fp32 buffers.")
      .def(py::init([](const std::string& name, const py::object& params,
                       const py::object& plugin_path) {
             auto runtime = plain_runtime(paths_from(plugin_path));
             auto h = std::make_shared<OptimizerHandle>();
             h->name = name;
             const Params given =
                 params.is_none() ? Params{} : params_from_dict(params.cast<py::dict>(), "params");
             std::lock_guard lock(runtime->mutex);
             h->optimizer = runtime->runtime.create<Optimizer>(name, given);
             return h;
           }),
           py::arg("name") = "cpu_adam", py::arg("params") = py::none(),
           py::arg("plugin_path") = py::none())
      .def_property_readonly("name", [](const OptimizerHandle& h) { return h.name; })
      .def_property_readonly("state_names",
                             [](const OptimizerHandle& h) { return h.optimizer->state_names(); })
      .def_property_readonly("implementation",
                             [](const OptimizerHandle& h) { return h.optimizer->implementation(); })
      .def(
          "step",
          [](const OptimizerHandle& h, const py::object& params, const py::object& grads,
             const py::sequence& state, const py::object& numel, const py::object& step,
             const py::object& lr, const py::object& beta1, const py::object& beta2,
             const py::object& eps, const py::object& weight_decay, const py::object& adamw_mode,
             const py::object& bias_correction, const py::object& grad_scale,
             const py::object& copy_out, const std::string& copy_out_type,
             const py::object& threads) {
            std::vector<float*> states;
            for (std::size_t i = 0; i < state.size(); ++i)
              states.push_back(pointer<float>(state[i], "state"));
            OptimizerBuffers b;
            b.params = pointer<float>(params, "params");
            b.grads = pointer<const float>(grads, "grads");
            b.state = states;
            b.numel = static_cast<std::size_t>(int_argument(numel, "numel", 0));
            b.copy_out = copy_out.is_none() ? nullptr : pointer<void>(copy_out, "copy_out");
            b.copy_out_type = half_type(copy_out_type);
            b.threads = static_cast<std::size_t>(int_argument(threads, "threads", 0, 1 << 20));
            OptimizerHyperParams hyper;
            hyper.lr = real_argument(lr, "lr");
            hyper.beta1 = real_argument(beta1, "beta1");
            hyper.beta2 = real_argument(beta2, "beta2");
            hyper.eps = real_argument(eps, "eps");
            hyper.weight_decay = real_argument(weight_decay, "weight_decay");
            hyper.adamw_mode = bool_argument(adamw_mode, "adamw_mode");
            hyper.bias_correction = bool_argument(bias_correction, "bias_correction");
            hyper.grad_scale = real_argument(grad_scale, "grad_scale");
            const auto count = static_cast<std::uint64_t>(int_argument(step, "step", 0));
            py::gil_scoped_release release;
            h.optimizer->step(b, hyper, count);
          },
          py::arg("params"), py::arg("grads"), py::arg("state"), py::arg("numel"), py::arg("step"),
          py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("bias_correction"),
          py::arg("grad_scale") = 1.0, py::arg("copy_out") = py::none(),
          py::arg("copy_out_type") = "bfloat16", py::arg("threads") = 0,
          "One step over the buffers at these addresses (numel fp32 values each; copy_out: "
          "numel 16-bit values of copy_out_type, or None) on at most `threads` threads (0: as "
          "many as the plugin's parameters say). Blocks until done, without the GIL.");
}

}  // namespace ductile::python
