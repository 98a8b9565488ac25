// Whether a shared library exports a symbol, read from its file without
// loading it.
//
// The loader asks this of every candidate plugin before dlopen(), so that no
// constructor of a library that is not a ductile plugin (or not one for this
// machine) ever runs. The reader trusts nothing in the file: every offset,
// size and count is checked against the file's size without overflow, and
// the tables it reads are capped (kMaxElfTableBytes), so a malformed or
// hostile file costs at most a few bounded reads and gets a reason.
//
// It reads the section headers' dynamic symbol table (.dynsym), which is
// what linkers write and what dlsym() finds in every library a toolchain
// builds. It is a check against accidents (a library that is not a plugin
// on the search path), not against an attacker who crafts a file whose
// section headers and dynamic segment disagree: the ownership and
// permission rule (plugin_trust.hpp) is what keeps other users' files out.
//
// Threading: pure functions; safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>

namespace ductile::core {

// The most bytes of one table the reader reads (section headers, dynamic
// symbols, their strings): 64 MiB. A plugin's are a few KiB; libraries with
// tables this large are not plugins.
inline constexpr std::uint64_t kMaxElfTableBytes = std::uint64_t{64} << 20;

struct ElfExport {
  // An ELF shared object of this process's class, byte order and machine,
  // with section headers that lie within the file.
  bool loadable = false;
  // ...which defines `symbol` as a global (or weak), default- or
  // protected-visibility function in its dynamic symbol table.
  bool exported = false;
  // When !loadable, why, as a phrase to follow the file's name: "is not an
  // ELF file (it starts with 0x74 0x68 0x69 0x73)", "is an ELF file for
  // another machine (e_machine 183; this process runs on 62)".
  std::string problem;
};

// Copies `size` bytes at `offset` of the file into `out`; false when the file
// does not hold them all (or cannot be read).
using ElfBytes = std::function<bool(std::uint64_t offset, std::size_t size, void* out)>;

// Looks `symbol` up in the ELF file of `file_size` bytes that `read` reads.
ElfExport find_elf_export(const ElfBytes& read, std::uint64_t file_size, std::string_view symbol);

// The same over an image in memory (the fuzz target's entry point).
ElfExport find_elf_export_in_image(std::span<const std::uint8_t> image, std::string_view symbol);

// The same for a file: opened read-only without following a FIFO's wait,
// read with pread(). A file that is not a regular file, or cannot be opened
// or read, is not loadable (problem says why); nothing throws but
// std::bad_alloc.
ElfExport find_elf_export_in_file(const std::filesystem::path& file, std::string_view symbol);

}  // namespace ductile::core
