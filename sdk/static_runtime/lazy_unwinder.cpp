// The unwinder, libgcc_s.so.1, loaded when the process throws its first
// exception rather than when it starts.
//
// Every module of a process must unwind an exception with one copy of the
// unwinder: a personality routine works on the unwind context through the
// unwinder's functions, and a copy that did not start the unwind aborts on a
// context of another (its register table is set up by the copy that starts
// an unwind). libgcc_s.so.1 is that one copy for every shared C++ library
// (libstdc++.so.6 needs it). The modules built with the static runtime, the
// `ductile` program and the built-in plugins, call it through these wrappers
// (--wrap=_Unwind_..., DUCTILE_LAZY_UNWINDER_FUNCTIONS in
// static_runtime/CMakeLists.txt) and so do not list it as needed: a command
// that throws nothing never maps it, about 30 µs of start-up saved
// (docs/architecture.md, "Start-up").
#include <unwind.h>

#include "lazy_library.hpp"

namespace {

struct Unwinder {
  decltype(&::_Unwind_RaiseException) raise_exception;
  decltype(&::_Unwind_ForcedUnwind) forced_unwind;
  decltype(&::_Unwind_DeleteException) delete_exception;
  decltype(&::_Unwind_Resume) resume;
  decltype(&::_Unwind_Resume_or_Rethrow) resume_or_rethrow;
  decltype(&::_Unwind_Backtrace) backtrace;
  decltype(&::_Unwind_GetGR) get_gr;
  decltype(&::_Unwind_SetGR) set_gr;
  decltype(&::_Unwind_GetIP) get_ip;
  decltype(&::_Unwind_GetIPInfo) get_ip_info;
  decltype(&::_Unwind_SetIP) set_ip;
  decltype(&::_Unwind_GetCFA) get_cfa;
  decltype(&::_Unwind_GetLanguageSpecificData) get_language_specific_data;
  decltype(&::_Unwind_GetRegionStart) get_region_start;
  decltype(&::_Unwind_GetDataRelBase) get_data_rel_base;
  decltype(&::_Unwind_GetTextRelBase) get_text_rel_base;
  decltype(&::_Unwind_FindEnclosingFunction) find_enclosing_function;
};

template <class Function>
void resolve(Function& function, void* library, const char* name) noexcept {
  function = reinterpret_cast<Function>(
      ductile::static_runtime::lazy_symbol(library, "libgcc_s.so.1", name));
}

// Every function at once, on the first call of any (a throw, or a
// backtrace): no lookup then runs inside a personality routine, in the
// middle of an unwind.
const Unwinder& unwinder() noexcept {
  static const Unwinder table = [] {
    void* library = ductile::static_runtime::lazy_library("libgcc_s.so.1");
    Unwinder u{};
    resolve(u.raise_exception, library, "_Unwind_RaiseException");
    resolve(u.forced_unwind, library, "_Unwind_ForcedUnwind");
    resolve(u.delete_exception, library, "_Unwind_DeleteException");
    resolve(u.resume, library, "_Unwind_Resume");
    resolve(u.resume_or_rethrow, library, "_Unwind_Resume_or_Rethrow");
    resolve(u.backtrace, library, "_Unwind_Backtrace");
    resolve(u.get_gr, library, "_Unwind_GetGR");
    resolve(u.set_gr, library, "_Unwind_SetGR");
    resolve(u.get_ip, library, "_Unwind_GetIP");
    resolve(u.get_ip_info, library, "_Unwind_GetIPInfo");
    resolve(u.set_ip, library, "_Unwind_SetIP");
    resolve(u.get_cfa, library, "_Unwind_GetCFA");
    resolve(u.get_language_specific_data, library, "_Unwind_GetLanguageSpecificData");
    resolve(u.get_region_start, library, "_Unwind_GetRegionStart");
    resolve(u.get_data_rel_base, library, "_Unwind_GetDataRelBase");
    resolve(u.get_text_rel_base, library, "_Unwind_GetTextRelBase");
    resolve(u.find_enclosing_function, library, "_Unwind_FindEnclosingFunction");
    return u;
  }();
  return table;
}

}  // namespace

extern "C" {

_Unwind_Reason_Code __wrap__Unwind_RaiseException(_Unwind_Exception* exception) {
  return unwinder().raise_exception(exception);
}

_Unwind_Reason_Code __wrap__Unwind_ForcedUnwind(_Unwind_Exception* exception, _Unwind_Stop_Fn stop,
                                                void* stop_argument) {
  return unwinder().forced_unwind(exception, stop, stop_argument);
}

void __wrap__Unwind_DeleteException(_Unwind_Exception* exception) {
  unwinder().delete_exception(exception);
}

[[noreturn]] void __wrap__Unwind_Resume(_Unwind_Exception* exception) {
  unwinder().resume(exception);
  __builtin_unreachable();
}

_Unwind_Reason_Code __wrap__Unwind_Resume_or_Rethrow(_Unwind_Exception* exception) {
  return unwinder().resume_or_rethrow(exception);
}

_Unwind_Reason_Code __wrap__Unwind_Backtrace(_Unwind_Trace_Fn trace, void* trace_argument) {
  return unwinder().backtrace(trace, trace_argument);
}

_Unwind_Word __wrap__Unwind_GetGR(_Unwind_Context* context, int index) {
  return unwinder().get_gr(context, index);
}

void __wrap__Unwind_SetGR(_Unwind_Context* context, int index, _Unwind_Word value) {
  unwinder().set_gr(context, index, value);
}

_Unwind_Ptr __wrap__Unwind_GetIP(_Unwind_Context* context) {
  return unwinder().get_ip(context);
}

_Unwind_Ptr __wrap__Unwind_GetIPInfo(_Unwind_Context* context, int* before_instruction) {
  return unwinder().get_ip_info(context, before_instruction);
}

void __wrap__Unwind_SetIP(_Unwind_Context* context, _Unwind_Ptr value) {
  unwinder().set_ip(context, value);
}

_Unwind_Word __wrap__Unwind_GetCFA(_Unwind_Context* context) {
  return unwinder().get_cfa(context);
}

void* __wrap__Unwind_GetLanguageSpecificData(_Unwind_Context* context) {
  return unwinder().get_language_specific_data(context);
}

_Unwind_Ptr __wrap__Unwind_GetRegionStart(_Unwind_Context* context) {
  return unwinder().get_region_start(context);
}

_Unwind_Ptr __wrap__Unwind_GetDataRelBase(_Unwind_Context* context) {
  return unwinder().get_data_rel_base(context);
}

_Unwind_Ptr __wrap__Unwind_GetTextRelBase(_Unwind_Context* context) {
  return unwinder().get_text_rel_base(context);
}

void* __wrap__Unwind_FindEnclosingFunction(void* pc) {
  return unwinder().find_enclosing_function(pc);
}

}  // extern "C"
