// The ELF reader the loader runs before dlopen(), on the fuzz corpus's tiny
// shared libraries (tests/fuzz/corpus/elf_symbols) and on malformed copies
// of one: every verdict as expected, every refusal with its reason.
#include <elf.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include <doctest/doctest.h>

#include "ductile/core/elf_symbols.hpp"

namespace fs = std::filesystem;
using ductile::core::ElfExport;
using ductile::core::find_elf_export_in_file;
using ductile::core::find_elf_export_in_image;

namespace {

const fs::path kCorpus = fs::path(DUCTILE_SOURCE_DIR) / "tests/fuzz/corpus/elf_symbols";
constexpr const char* kEntry = "ductile_plugin_entry";

std::vector<std::uint8_t> bytes_of(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

ElfExport lookup(const std::vector<std::uint8_t>& image) {
  return find_elf_export_in_image(image, kEntry);
}

template <class T>
T read_at(const std::vector<std::uint8_t>& image, std::size_t offset) {
  T value;
  REQUIRE(offset + sizeof value <= image.size());
  std::memcpy(&value, image.data() + offset, sizeof value);
  return value;
}

template <class T>
void write_at(std::vector<std::uint8_t>& image, std::size_t offset, const T& value) {
  REQUIRE(offset + sizeof value <= image.size());
  std::memcpy(image.data() + offset, &value, sizeof value);
}

// The offset of the section header of the first section of `type`.
std::size_t section_header_of(const std::vector<std::uint8_t>& image, Elf64_Word type) {
  const auto header = read_at<Elf64_Ehdr>(image, 0);
  for (std::size_t i = 0; i < header.e_shnum; ++i) {
    const std::size_t at = header.e_shoff + i * sizeof(Elf64_Shdr);
    if (read_at<Elf64_Shdr>(image, at).sh_type == type) return at;
  }
  FAIL("no section of type " << type);
  return 0;
}

}  // namespace

TEST_CASE("the corpus libraries: only a defined, default-visible function is the entry") {
  auto exported = lookup(bytes_of(kCorpus / "exports_entry.so"));
  CHECK(exported.loadable);
  CHECK(exported.exported);
  CHECK(exported.problem.empty());
  CHECK(find_elf_export_in_file(kCorpus / "exports_entry.so", kEntry).exported);
  for (const char* name :
       {"exports_other.so", "entry_hidden.so", "entry_is_data.so", "entry_imported.so"}) {
    auto found = lookup(bytes_of(kCorpus / name));
    CHECK_MESSAGE(found.loadable, name);
    CHECK_MESSAGE(!found.exported, name);
  }
  // The name must match whole: a prefix of it is another symbol.
  CHECK_FALSE(
      find_elf_export_in_image(bytes_of(kCorpus / "exports_entry.so"), "ductile_plugin").exported);
  auto text = lookup(bytes_of(kCorpus / "text.txt"));
  CHECK_FALSE(text.loadable);
  CHECK(text.problem == "is not an ELF file (it starts with 0x74 0x68 0x69 0x73)");
}

TEST_CASE("a file that is not regular, or missing, is refused with the reason") {
  CHECK(find_elf_export_in_file(kCorpus, kEntry).problem ==
        "is a directory, not a regular file; give a regular shared library");
  CHECK(find_elf_export_in_file(kCorpus / "missing.so", kEntry).problem ==
        "cannot be opened: No such file or directory");
}

TEST_CASE("malformed section tables are refused or read within bounds") {
  const auto good = bytes_of(kCorpus / "exports_entry.so");
  const auto header = read_at<Elf64_Ehdr>(good, 0);

  SUBCASE("section headers past the end") {
    auto image = good;
    write_at<Elf64_Off>(image, offsetof(Elf64_Ehdr, e_shoff), image.size() - 8);
    CHECK(lookup(image).problem.find("its section header table") != std::string::npos);
  }
  SUBCASE("a section count no table can hold (extended numbering)") {
    auto image = good;
    write_at<Elf64_Half>(image, offsetof(Elf64_Ehdr, e_shnum), 0);
    write_at<Elf64_Xword>(image, header.e_shoff + offsetof(Elf64_Shdr, sh_size), ~0ull);
    CHECK(lookup(image).problem ==
          "has 18446744073709551615 sections, more than a plugin can have");
  }
  SUBCASE("a section header size that is not ELF64's") {
    auto image = good;
    write_at<Elf64_Half>(image, offsetof(Elf64_Ehdr, e_shentsize), 40);
    CHECK(lookup(image).problem ==
          "is a malformed ELF file: section headers of 40 bytes (ELF64's are 64)");
  }
  SUBCASE("a dynamic symbol table whose size would wrap the offset") {
    auto image = good;
    const std::size_t dynsym = section_header_of(image, SHT_DYNSYM);
    write_at<Elf64_Off>(image, dynsym + offsetof(Elf64_Shdr, sh_offset), ~0ull - 8);
    write_at<Elf64_Xword>(image, dynsym + offsetof(Elf64_Shdr, sh_size), 48);
    CHECK(lookup(image).problem.find("its dynamic symbol table (48 bytes at offset "
                                     "18446744073709551607) lies outside") != std::string::npos);
  }
  SUBCASE("a dynamic symbol table over the cap") {
    auto image = good;
    const std::size_t dynsym = section_header_of(image, SHT_DYNSYM);
    write_at<Elf64_Xword>(image, dynsym + offsetof(Elf64_Shdr, sh_size), 1ull << 40);
    CHECK(lookup(image).problem.find("over the 64 MiB a plugin's can have") != std::string::npos);
  }
  SUBCASE("strings linked to a section that does not exist, or is not a string table") {
    auto image = good;
    const std::size_t dynsym = section_header_of(image, SHT_DYNSYM);
    write_at<Elf64_Word>(image, dynsym + offsetof(Elf64_Shdr, sh_link), 1000);
    CHECK(lookup(image).problem.find("name string table 1000 of") != std::string::npos);
    write_at<Elf64_Word>(image, dynsym + offsetof(Elf64_Shdr, sh_link), 0);
    CHECK(lookup(image).problem.find("not a string table") != std::string::npos);
  }
  SUBCASE("a string table cut before the entry's name ends") {
    auto image = good;
    const std::size_t dynstr = section_header_of(image, SHT_STRTAB);
    const auto strings = read_at<Elf64_Shdr>(image, dynstr);
    const std::string table(image.begin() + strings.sh_offset,
                            image.begin() + strings.sh_offset + strings.sh_size);
    const auto name = table.find(kEntry);
    REQUIRE(name != std::string::npos);
    // Ends just before the NUL: the name is not whole, so not the entry.
    write_at<Elf64_Xword>(image, dynstr + offsetof(Elf64_Shdr, sh_size),
                          name + std::strlen(kEntry));
    auto found = lookup(image);
    CHECK(found.loadable);
    CHECK_FALSE(found.exported);
  }
  SUBCASE("every prefix of the file is answered") {
    for (std::size_t n = 0; n < good.size(); n += 7) {
      std::vector<std::uint8_t> cut(good.begin(), good.begin() + n);
      auto found = lookup(cut);
      CHECK((found.loadable || !found.problem.empty()));
    }
  }
}
