// The functions of libm that the `ductile` program and the built-in plugins
// call, each loading libm.so.6 on its first call (--wrap=<name>,
// DUCTILE_LAZY_LIBM_FUNCTIONS in static_runtime/CMakeLists.txt): only a
// cosine LR schedule, DeepSpeed's schedules (log warm-up, cycles), TOML++ printing a number and a
// square-root scaling of a negative value call them, and mapping libm at start-up costs a command
// about 30 µs (docs/architecture.md, "Start-up"). A function of libm that is
// not wrapped here brings libm back into the program's needed libraries,
// which tests/python/test_wheel.py reports.
#include "lazy_library.hpp"

namespace {

using Unary = double (*)(double);
using Binary = double (*)(double, double);

template <typename Function = Unary>
Function libm_function(const char* name) noexcept {
  static void* const libm = ductile::static_runtime::lazy_library("libm.so.6");
  return reinterpret_cast<Function>(ductile::static_runtime::lazy_symbol(libm, "libm.so.6", name));
}

}  // namespace

extern "C" {

double __wrap_cos(double x) {
  static const Unary cos = libm_function("cos");
  return cos(x);
}

double __wrap_fmod(double x, double y) {
  static const Binary fmod = libm_function<Binary>("fmod");
  return fmod(x, y);
}

double __wrap_log(double x) {
  static const Unary log = libm_function("log");
  return log(x);
}

double __wrap_log10(double x) {
  static const Unary log10 = libm_function("log10");
  return log10(x);
}

double __wrap_sqrt(double x) {
  static const Unary sqrt = libm_function("sqrt");
  return sqrt(x);
}

}  // extern "C"
