// Fuzz target: the ELF reader the loader runs on every candidate plugin file
// before dlopen() (core::find_elf_export_in_image, the code path of
// find_elf_export_in_file over memory). Any bytes must give an answer: no
// read outside the input, no allocation beyond it or the table cap, and a
// reason whenever the file is refused.
#include <cstdint>

#include "ductile/core/elf_symbols.hpp"
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto found = ductile::core::find_elf_export_in_image({data, size}, "ductile_plugin_entry");
  if (found.exported && !found.loadable) __builtin_trap();
  if (!found.loadable && found.problem.empty()) __builtin_trap();
  return 0;
}
