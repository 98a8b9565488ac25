// Visibility and build-tag macros shared by the core and by plugins.
//
// Types across the plugin boundary. A plugin is built with hidden visibility
// and a version script that exports only `ductile_plugin_entry`, and the host
// opens it with RTLD_NOW | RTLD_LOCAL. So every plugin has its own, local copy
// of the vtables and type_info objects of the SDK types it uses (Error, the
// kind interfaces, Plugin): the addresses of typeid(ductile::Error) in the
// host and in a plugin differ (tests/core/loader/loader_test.cpp checks this).
// Catching an exception thrown by plugin code and dynamic_cast from the host
// still work, because libstdc++ compares type_info by mangled name, not by
// address, for types with external linkage (__GXX_MERGED_TYPEINFO_NAMES is 0
// on this ABI). What does not work is comparing type_info addresses, which
// UBSan's vptr check does (the sanitizer build turns it off), and relying on
// the address of a static object of an inline function being shared.
//
// The built-in plugins of a Release build also carry their own copy of the
// C++ runtime (libstdc++, fmt, spdlog's logger; DUCTILE_STATIC_RUNTIME, see
// sdk/static_runtime/). Every module still shares the one unwinder
// (libgcc_s) and the one per-thread exception state (__cxa_get_globals), so
// exceptions cross as above and std::uncaught_exceptions() stays right on
// both sides; memory is malloc's on both sides. A plugin must not rely on
// the host's std::locale::global, terminate or new handler, or iostream
// objects: those are per copy.
// DUCTILE_SDK_API marks the SDK types default-visible so that the host and
// libductile_core.so export one definition for everything outside plugins.
#pragma once

#define DUCTILE_SDK_API __attribute__((visibility("default")))

#define DUCTILE_STRINGIFY_IMPL(x) #x
#define DUCTILE_STRINGIFY(x) DUCTILE_STRINGIFY_IMPL(x)
