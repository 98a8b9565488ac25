#include "ductile/core/elf_symbols.hpp"

#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "ductile/core/files.hpp"

namespace ductile::core {
namespace {

static_assert(sizeof(void*) == 8, "the plugin ELF check reads ELF64 files only");
#if defined(__x86_64__)
constexpr std::uint16_t kHostMachine = EM_X86_64;
#elif defined(__aarch64__)
constexpr std::uint16_t kHostMachine = EM_AARCH64;
#elif defined(__powerpc64__)
constexpr std::uint16_t kHostMachine = EM_PPC64;
#elif defined(__riscv)
constexpr std::uint16_t kHostMachine = EM_RISCV;
#else
#error "the plugin ELF check knows no e_machine for this architecture"
#endif
constexpr unsigned char kHostByteOrder =
    std::endian::native == std::endian::little ? ELFDATA2LSB : ELFDATA2MSB;

// Whether [offset, offset + size) lies within `file_size` bytes (no sum is
// formed, so nothing can wrap).
bool within(std::uint64_t offset, std::uint64_t size, std::uint64_t file_size) {
  return size <= file_size && offset <= file_size - size;
}

ElfExport refused(std::string problem) {
  ElfExport out;
  out.problem = std::move(problem);
  return out;
}

const char* elf_type_name(std::uint16_t type) {
  switch (type) {
    case ET_REL:
      return "an object file";
    case ET_EXEC:
      return "an executable";
    case ET_CORE:
      return "a core dump";
    default:
      return "of an unknown type";
  }
}

// Reads a whole table of `size` bytes at `offset`, after the checks that
// make the read safe: within the file and under the cap.
bool read_table(const ElfBytes& read, std::uint64_t file_size, std::uint64_t offset,
                std::uint64_t size, std::vector<unsigned char>& out, const char* what,
                std::string& problem) {
  if (size > kMaxElfTableBytes) {
    problem = fmt::format("has {} of {} bytes, over the {} MiB a plugin's can have", what, size,
                          kMaxElfTableBytes >> 20);
    return false;
  }
  if (!within(offset, size, file_size)) {
    problem = fmt::format(
        "is a malformed ELF file: its {} ({} bytes at offset {}) lies outside "
        "the file of {} bytes",
        what, size, offset, file_size);
    return false;
  }
  out.resize(static_cast<std::size_t>(size));
  if (size > 0 && !read(offset, out.size(), out.data())) {
    problem = fmt::format("could not be read ({} at offset {})", what, offset);
    return false;
  }
  return true;
}

}  // namespace

ElfExport find_elf_export(const ElfBytes& read, std::uint64_t file_size, std::string_view symbol) {
  unsigned char ident[EI_NIDENT] = {};
  const auto head = static_cast<std::size_t>(std::min<std::uint64_t>(file_size, EI_NIDENT));
  if (head > 0 && !read(0, head, ident)) return refused("could not be read");
  if (head < SELFMAG || std::memcmp(ident, ELFMAG, SELFMAG) != 0) {
    std::string start;
    for (std::size_t i = 0; i < std::min<std::size_t>(head, SELFMAG); ++i)
      start += fmt::format("{}0x{:02x}", i ? " " : "", ident[i]);
    return refused(head == 0 ? "is not an ELF file (it is empty)"
                             : fmt::format("is not an ELF file (it starts with {})", start));
  }
  if (ident[EI_CLASS] != ELFCLASS64)
    return refused(ident[EI_CLASS] == ELFCLASS32
                       ? "is a 32-bit ELF file; this process is 64-bit"
                       : fmt::format("is an ELF file of unknown class {}", ident[EI_CLASS]));
  if (ident[EI_DATA] != kHostByteOrder)
    return refused("is an ELF file of the other byte order than this machine's");
  Elf64_Ehdr header;
  if (file_size < sizeof header)
    return refused(fmt::format("is an ELF file cut short: {} bytes, less than its {}-byte header",
                               file_size, sizeof header));
  if (!read(0, sizeof header, &header)) return refused("could not be read");
  if (header.e_type != ET_DYN)
    return refused(fmt::format("is an ELF file but not a shared library (e_type {}: {})",
                               header.e_type, elf_type_name(header.e_type)));
  if (header.e_machine != kHostMachine)
    return refused(
        fmt::format("is a shared library for another machine (e_machine {}; this "
                    "process runs on {})",
                    header.e_machine, kHostMachine));
  if (header.e_shoff == 0)
    return refused(
        "is a shared library without section headers (a linker writes them; this "
        "file was stripped of them or made by hand)");
  if (header.e_shentsize != sizeof(Elf64_Shdr))
    return refused(
        fmt::format("is a malformed ELF file: section headers of {} bytes (ELF64's "
                    "are {})",
                    header.e_shentsize, sizeof(Elf64_Shdr)));

  // Past 0xff00 sections, e_shnum is 0 and the count is section 0's sh_size.
  std::uint64_t count = header.e_shnum;
  if (count == 0) {
    Elf64_Shdr first;
    if (!within(header.e_shoff, sizeof first, file_size))
      return refused(
          fmt::format("is a malformed ELF file: its section headers (offset {}) lie "
                      "outside the file of {} bytes",
                      header.e_shoff, file_size));
    if (!read(header.e_shoff, sizeof first, &first)) return refused("could not be read");
    count = first.sh_size;
  }
  if (count > kMaxElfTableBytes / sizeof(Elf64_Shdr))
    return refused(fmt::format("has {} sections, more than a plugin can have", count));
  std::string problem;
  std::vector<unsigned char> table;
  if (!read_table(read, file_size, header.e_shoff, count * sizeof(Elf64_Shdr), table,
                  "section header table", problem))
    return refused(std::move(problem));
  std::vector<Elf64_Shdr> sections(static_cast<std::size_t>(count));
  if (!sections.empty()) std::memcpy(sections.data(), table.data(), table.size());

  ElfExport out;
  out.loadable = true;
  const auto dynsym = std::find_if(sections.begin(), sections.end(),
                                   [](const Elf64_Shdr& s) { return s.sh_type == SHT_DYNSYM; });
  if (dynsym == sections.end()) return out;  // exports nothing
  if (dynsym->sh_entsize != sizeof(Elf64_Sym))
    return refused(
        fmt::format("is a malformed ELF file: dynamic symbols of {} bytes (ELF64's are "
                    "{})",
                    dynsym->sh_entsize, sizeof(Elf64_Sym)));
  if (dynsym->sh_link >= sections.size())
    return refused(
        fmt::format("is a malformed ELF file: its dynamic symbols name string table "
                    "{} of {} sections",
                    dynsym->sh_link, sections.size()));
  const Elf64_Shdr& strtab = sections[dynsym->sh_link];
  if (strtab.sh_type != SHT_STRTAB)
    return refused(
        fmt::format("is a malformed ELF file: the strings of its dynamic symbols are "
                    "in a section of type {}, not a string table",
                    strtab.sh_type));
  std::vector<unsigned char> symbols, strings;
  if (!read_table(read, file_size, dynsym->sh_offset, dynsym->sh_size, symbols,
                  "dynamic symbol table", problem) ||
      !read_table(read, file_size, strtab.sh_offset, strtab.sh_size, strings,
                  "dynamic string table", problem))
    return refused(std::move(problem));

  for (std::size_t at = 0; at + sizeof(Elf64_Sym) <= symbols.size(); at += sizeof(Elf64_Sym)) {
    Elf64_Sym sym;
    std::memcpy(&sym, symbols.data() + at, sizeof sym);
    // The name and its terminating NUL must lie within the strings.
    if (sym.st_name >= strings.size() || strings.size() - sym.st_name <= symbol.size()) continue;
    const unsigned char* name = strings.data() + sym.st_name;
    if (std::memcmp(name, symbol.data(), symbol.size()) != 0 || name[symbol.size()] != '\0')
      continue;
    const unsigned bind = ELF64_ST_BIND(sym.st_info);
    const unsigned visibility = ELF64_ST_VISIBILITY(sym.st_other);
    if (sym.st_shndx != SHN_UNDEF && ELF64_ST_TYPE(sym.st_info) == STT_FUNC &&
        (bind == STB_GLOBAL || bind == STB_WEAK) &&
        (visibility == STV_DEFAULT || visibility == STV_PROTECTED)) {
      out.exported = true;
      break;
    }
  }
  return out;
}

ElfExport find_elf_export_in_image(std::span<const std::uint8_t> image, std::string_view symbol) {
  auto read = [image](std::uint64_t offset, std::size_t size, void* out) {
    if (!within(offset, size, image.size())) return false;
    if (size > 0) std::memcpy(out, image.data() + offset, size);
    return true;
  };
  return find_elf_export(read, image.size(), symbol);
}

ElfExport find_elf_export_in_file(const std::filesystem::path& file, std::string_view symbol) {
  const int fd = open_for_reading(file);
  if (fd < 0) return refused(fmt::format("cannot be opened: {}", std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    return refused(fmt::format("cannot be read: {}", std::strerror(errno)));
  if (auto problem =
          regular_file_problem(st, std::numeric_limits<std::uintmax_t>::max(), "shared library");
      !problem.empty())
    return refused(std::move(problem));
  auto read = [fd](std::uint64_t offset, std::size_t size, void* out) {
    auto* bytes = static_cast<unsigned char*>(out);
    std::size_t done = 0;
    while (done < size) {
      if (offset + done > static_cast<std::uint64_t>(std::numeric_limits<off_t>::max()))
        return false;
      const auto n = ::pread(fd, bytes + done, size - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;  // an error, or the file shrank
      done += static_cast<std::size_t>(n);
    }
    return true;
  };
  return find_elf_export(read, static_cast<std::uint64_t>(st.st_size), symbol);
}

}  // namespace ductile::core
