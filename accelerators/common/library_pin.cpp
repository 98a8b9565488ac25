#include "library_pin.hpp"

#include <dlfcn.h>

namespace ductile::accel {

bool pin_library_of(const void* address) noexcept {
  Dl_info info{};
  if (dladdr(address, &info) == 0 || info.dli_fname == nullptr) return false;
  // RTLD_NOLOAD: only adds a reference to the already loaded library, which
  // RTLD_NODELETE then makes permanent. The handle is deliberately kept.
  void* handle = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
  return handle != nullptr;
}

}  // namespace ductile::accel
