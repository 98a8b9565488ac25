// What can be checked of a plugin's descriptor before anything reads through
// it: every pointer it holds lies inside the address ranges its library maps
// (registry_internal.hpp). A plugin whose entry point returns garbage is then
// refused with a message instead of crashing the process that lists it.
#include <dlfcn.h>
#include <link.h>

#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "registry_internal.hpp"

namespace ductile::core {

namespace {

namespace fs = std::filesystem;

// The most entries a schema or an allowed-values list may have, and the
// longest string a descriptor may point to, before its NUL.
constexpr std::size_t kMaxSchemaEntries = 4096;
constexpr std::size_t kMaxDescriptorString = 1 << 20;

class Ranges {
 public:
  Ranges(const std::vector<MappedRange>& ranges, const fs::path& file)
      : ranges_(ranges), file_(file.string()) {}

  // [address, address + size) within one readable range (no sum that wraps).
  const MappedRange* holding(const void* pointer, std::size_t size) const {
    const auto address = reinterpret_cast<std::uintptr_t>(pointer);
    for (const auto& r : ranges_)
      if (address >= r.begin && address <= r.end && size <= r.end - address) return &r;
    return nullptr;
  }

  void require(const void* pointer, std::size_t size, const std::string& field) const {
    if (!holding(pointer, size)) refuse(field, pointer, fmt::format("{} bytes", size));
  }

  // A C string (`pointer` may be null when `optional`): it starts inside a
  // range and its NUL lies there too, within kMaxDescriptorString bytes.
  void require_string(const char* pointer, const std::string& field, bool optional) const {
    if (pointer == nullptr) {
      if (optional) return;
      refuse(field, pointer, "a string");
    }
    const MappedRange* range = holding(pointer, 1);
    if (!range) refuse(field, pointer, "a string");
    const auto address = reinterpret_cast<std::uintptr_t>(pointer);
    const std::size_t span = std::min<std::uintptr_t>(range->end - address, kMaxDescriptorString);
    if (std::memchr(pointer, '\0', span) == nullptr)
      throw Error(ErrorKind::plugin,
                  fmt::format("'{}': its descriptor's {} is not a string ending inside the "
                              "library within {} bytes; the plugin was not used",
                              file_, field, span));
  }

  // A function of the library: inside a range it maps executable.
  void require_code(const void* pointer, const std::string& field) const {
    const MappedRange* range = holding(pointer, 1);
    if (!range || !range->executable) refuse(field, pointer, "code");
  }

 private:
  [[noreturn]] void refuse(const std::string& field, const void* pointer,
                           const std::string& what) const {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}': its descriptor's {} ({}, {}) lies outside what the library "
                            "maps: its entry point returned garbage; the plugin was not used",
                            file_, field, fmt::ptr(pointer), what));
  }

  const std::vector<MappedRange>& ranges_;
  std::string file_;
};

}  // namespace

std::vector<MappedRange> mapped_ranges(void* handle) {
  link_map* map = nullptr;
  if (handle == nullptr || ::dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || map == nullptr)
    return {};
  struct Search {
    const link_map* map;
    std::vector<MappedRange> ranges;
  } search{map, {}};
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        if (info->dlpi_addr != s->map->l_addr || info->dlpi_name == nullptr ||
            s->map->l_name == nullptr || std::strcmp(info->dlpi_name, s->map->l_name) != 0)
          return 0;
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& segment = info->dlpi_phdr[i];
          if (segment.p_type != PT_LOAD || !(segment.p_flags & PF_R)) continue;
          const std::uintptr_t begin = info->dlpi_addr + segment.p_vaddr;
          s->ranges.push_back({begin, begin + segment.p_memsz, (segment.p_flags & PF_X) != 0});
        }
        return 1;
      },
      &search);
  return search.ranges;
}

void check_descriptor_memory(const ductile_plugin_descriptor* d,
                             const std::vector<MappedRange>& ranges, const fs::path& file) {
  if (d == nullptr) return;  // check_plugin_descriptor reports it
  const Ranges mapped(ranges, file);
  // The ABI version first: the rest of the layout is that version's.
  mapped.require(d, sizeof(d->abi_version), "address");
  if (d->abi_version != DUCTILE_ABI_VERSION) return;  // check_plugin_descriptor reports it
  mapped.require(d, sizeof *d, "address");
  mapped.require_string(d->build_tag, "build_tag", true);
  mapped.require_string(d->name, "name", true);
  mapped.require_string(d->version, "version", true);
  mapped.require_string(d->description, "description", true);
  if (d->create != nullptr) mapped.require_code(reinterpret_cast<const void*>(d->create), "create");
  if (d->validate != nullptr)
    mapped.require_code(reinterpret_cast<const void*>(d->validate), "validate");
  if (d->param_count == 0 || d->params == nullptr) return;
  if (d->param_count > kMaxSchemaEntries)
    throw Error(ErrorKind::plugin,
                fmt::format("'{}': its descriptor declares {} parameters, more than the {} a "
                            "schema may have; the plugin was not used",
                            file.string(), d->param_count, kMaxSchemaEntries));
  mapped.require(d->params, d->param_count * sizeof(ParamSpec),
                 fmt::format("params (an array of {})", d->param_count));
  for (std::size_t i = 0; i < d->param_count; ++i) {
    const ParamSpec& p = d->params[i];
    const std::string at = fmt::format("params[{}]", i);
    mapped.require_string(p.key, at + ".key", true);
    mapped.require_string(p.default_value, at + ".default_value", true);
    mapped.require_string(p.doc, at + ".doc", true);
    if (p.allowed_values == nullptr) continue;
    for (std::size_t k = 0;; ++k) {
      if (k == kMaxSchemaEntries)
        throw Error(ErrorKind::plugin,
                    fmt::format("'{}': its descriptor's {}.allowed_values has no terminating "
                                "null within {} entries; the plugin was not used",
                                file.string(), at, kMaxSchemaEntries));
      const std::string entry = fmt::format("{}.allowed_values[{}]", at, k);
      mapped.require(p.allowed_values + k, sizeof(const char*), entry);
      if (p.allowed_values[k] == nullptr) break;
      mapped.require_string(p.allowed_values[k], entry, false);
    }
  }
}

}  // namespace ductile::core
