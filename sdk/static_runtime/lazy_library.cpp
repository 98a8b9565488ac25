#include "lazy_library.hpp"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

namespace ductile::static_runtime {
namespace {

// stdio and no allocation: this may run while an exception is being thrown.
[[noreturn]] void cannot_load(const char* soname, const char* name) noexcept {
  const char* why = ::dlerror();
  std::fprintf(stderr, "ductile: internal error: cannot load %s%s%s: %s\n", name ? name : "",
               name ? " from " : "", soname, why ? why : "not found");
  std::abort();
}

}  // namespace

void* lazy_library(const char* soname) noexcept {
  void* library = ::dlopen(soname, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) cannot_load(soname, nullptr);
  return library;
}

void* lazy_symbol(void* library, const char* soname, const char* name) noexcept {
  void* symbol = ::dlsym(library, name);
  if (symbol == nullptr) cannot_load(soname, name);
  return symbol;
}

}  // namespace ductile::static_runtime
