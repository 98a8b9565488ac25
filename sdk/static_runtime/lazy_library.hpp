// Loading a system library the first time one of its functions is called,
// for the `ductile` program and the built-in plugins (the static runtime):
// what a module lists as needed is mapped and relocated before main() runs,
// in every process, though most commands never call into it.
#pragma once

namespace ductile::static_runtime {

// The handle of `soname`, loaded now or found already loaded; never closed.
// Thread-safe (dlopen is). On failure, prints what is missing to stderr and
// aborts: a caller needs the function at once and cannot report an error.
void* lazy_library(const char* soname) noexcept;

// The address of `name` in `library` (from lazy_library(soname)), resolved
// as the dynamic linker would have at start-up. Aborts as lazy_library does.
void* lazy_symbol(void* library, const char* soname, const char* name) noexcept;

}  // namespace ductile::static_runtime
