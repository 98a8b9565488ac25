// One exception state per thread for the whole process, though a plugin
// built with the static runtime carries its own copy of the C++ runtime.
//
// Exceptions cross the plugin boundary both ways: a plugin's ductile::Error
// is caught by the host. The C++ ABI keeps, per thread, the stack of caught
// exceptions and the count of uncaught ones in a __cxa_eh_globals that
// __cxa_get_globals() returns (Itanium C++ ABI, section 2.4.2). With one copy
// per module, a throw counted by the plugin's copy would be uncounted by the
// host's when the host catches it, and std::uncaught_exceptions() in the host
// would stay off by one after every such error (an ostream with unitbuf then
// stops flushing). A plugin is linked with --wrap for both entry points
// (static_runtime/CMakeLists.txt), so that its copy's throws and catches use
// the state of the runtime the process already has:
//   - the one the host program exports (the `ductile` program built with the
//     static runtime exports __cxa_get_globals for this);
//   - else libstdc++.so, when the process has loaded it (a Python process,
//     any program linked against libductile_core.so);
//   - else this copy's own.
#include <dlfcn.h>

#include <cxxabi.h>
#include <atomic>

using abi::__cxa_eh_globals;
using GetGlobals = __cxa_eh_globals* (*)() noexcept;

extern "C" {
__cxa_eh_globals* __real___cxa_get_globals() noexcept;
__cxa_eh_globals* __real___cxa_get_globals_fast() noexcept;
__cxa_eh_globals* __wrap___cxa_get_globals() noexcept;
__cxa_eh_globals* __wrap___cxa_get_globals_fast() noexcept;
}

namespace {

GetGlobals find_process_globals() noexcept {
  if (void* symbol = ::dlsym(RTLD_DEFAULT, "__cxa_get_globals"))
    return reinterpret_cast<GetGlobals>(symbol);
  // A library opened with RTLD_LOCAL is not in the default scope; opening it
  // again with RTLD_NOLOAD finds it without loading anything.
  if (void* library = ::dlopen("libstdc++.so.6", RTLD_LAZY | RTLD_NOLOAD)) {
    void* symbol = ::dlsym(library, "__cxa_get_globals");
    ::dlclose(library);
    if (symbol) return reinterpret_cast<GetGlobals>(symbol);
  }
  return &__real___cxa_get_globals;
}

// Looked up on the first exception the plugin throws or catches; a race
// between threads finds the same function twice.
std::atomic<GetGlobals> process_globals{nullptr};

__cxa_eh_globals* globals() noexcept {
  GetGlobals get = process_globals.load(std::memory_order_acquire);
  if (get == nullptr) {
    get = find_process_globals();
    process_globals.store(get, std::memory_order_release);
  }
  return get();
}

}  // namespace

extern "C" __cxa_eh_globals* __wrap___cxa_get_globals() noexcept {
  return globals();
}

extern "C" __cxa_eh_globals* __wrap___cxa_get_globals_fast() noexcept {
  return globals();
}
