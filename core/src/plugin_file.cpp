// One plugin file: the checks before anything of it runs (trust, ELF), the
// dlopen, and the checks of the descriptor it exports (registry.hpp).
//
// Boost.DLL on std::filesystem: the core then needs no Boost library at run
// time (one shared object fewer to map and relocate at every start).
#define BOOST_DLL_USE_STD_FS 1
#include <cmath>
#include <cstddef>
#include <mutex>
#include <system_error>

#include <fmt/format.h>
#include <boost/dll/shared_library.hpp>

#include "ductile/core/elf_symbols.hpp"
#include "ductile/core/plugin_trust.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/core/text.hpp"
#include "registry_internal.hpp"

namespace ductile::core {

class LoadedLibrary {
 public:
  explicit LoadedLibrary(boost::dll::shared_library library) : library_(std::move(library)) {}

 private:
  boost::dll::shared_library library_;
};

namespace {

namespace fs = std::filesystem;

const char* interface_name(PluginKind kind) {
  switch (kind) {
    case PluginKind::elasticity:
      return "ElasticityPolicy";
    case PluginKind::batching:
      return "BatchSampler";
    case PluginKind::lr:
      return "LrScalingRule";
    case PluginKind::accelerator:
      return "Accelerator";
    case PluginKind::zero:
      return "ParameterCoordinator";
    case PluginKind::optimizer:
      return "Optimizer";
  }
  return "unknown";
}

// Plugin libraries are never unloaded while the process runs (as LLVM does
// with pass plugins): an exception thrown by a plugin method carries a vtable
// from the plugin's code and may still be in flight after the last object and
// registry are gone, and loggers may still format strings that live there.
// The list is deliberately never destroyed.
void keep_loaded(std::shared_ptr<LoadedLibrary> library) {
  static auto* libraries = new std::vector<std::shared_ptr<LoadedLibrary>>();
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  libraries->push_back(std::move(library));
}

bool numeric(ParamType type) {
  return type == ParamType::integer || type == ParamType::floating ||
         type == ParamType::integer_list || type == ParamType::float_list;
}

// A bound whose flag is clear is never compared (param_values.cpp): a schema
// that sets min_value or max_value without param_has_min or param_has_max
// promises a check that does not happen, and a user's out-of-range value
// would reach the plugin. Only a bound other than 0 can be seen: 0 is the
// field's default, the same bytes as "not set" (params.hpp).
void refuse_unflagged_bound(const std::string& shown, const PluginInfo& plugin, const ParamSpec& p,
                            const char* field, double value, const char* flag) {
  const std::string what_to_do =
      numeric(p.type)
          ? fmt::format("add ductile::{} to its .flags to check it, or remove .{}", flag, field)
          : fmt::format(
                "bounds apply only to numbers and lists of numbers, and this parameter "
                "is of type {}: remove .{}",
                to_string(p.type), field);
  throw Error(ErrorKind::plugin,
              fmt::format("'{}': plugin {}/{} declares parameter '{}' with {} {} but without the "
                          "{} flag, so the bound is never checked; {}",
                          shown, to_string(plugin.kind), excerpt(plugin.name), excerpt(p.key),
                          field, value, flag, what_to_do));
}

}  // namespace

PluginInfo check_plugin_descriptor(const ductile_plugin_descriptor* d, const fs::path& file) {
  const std::string shown = file.string();
  if (d == nullptr)
    throw Error(ErrorKind::plugin,
                fmt::format("'{}': its entry point returned no descriptor", shown));
  // The one rule (version.hpp): ABI version, build tag, shared layout and
  // the kind's interface revision as the host's; the plugin is rebuilt
  // against this SDK otherwise.
  if (d->abi_version != DUCTILE_ABI_VERSION) {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' was built for plugin ABI {} but this ductile uses ABI {}; "
                            "rebuild the plugin against this SDK",
                            shown, d->abi_version, DUCTILE_ABI_VERSION));
  }
  std::string tag = d->build_tag ? d->build_tag : "";
  if (tag != DUCTILE_BUILD_TAG) {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' was built with '{}' but this ductile was built with '{}'; "
                            "rebuild the plugin against this SDK with the same compiler, standard "
                            "library, fmt and spdlog",
                            shown, tag, DUCTILE_BUILD_TAG));
  }
  if (d->layout_fingerprint != detail::shared_layout_fingerprint()) {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' was compiled with another layout of the types plugins share with "
                            "ductile (Params, ParamSpec, Error, std::string; fingerprint {:#010x}, "
                            "this ductile's {:#010x}); rebuild the plugin against this SDK with "
                            "the same compiler flags (for example without _GLIBCXX_DEBUG)",
                            shown, d->layout_fingerprint, detail::shared_layout_fingerprint()));
  }
  if (d->kind >= kPluginKindCount) {
    throw Error(ErrorKind::plugin, fmt::format("'{}' declares unknown plugin kind {} (valid: {})",
                                               shown, d->kind, plugin_kind_list()));
  }
  const auto kind = static_cast<PluginKind>(d->kind);
  if (d->interface_revision != interface_revision(kind)) {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' was built against revision {} of the {} interface ({}) but this "
                            "ductile has revision {}; rebuild the plugin against this SDK",
                            shown, d->interface_revision, to_string(kind), interface_name(kind),
                            interface_revision(kind)));
  }
  if (d->name == nullptr || *d->name == '\0' || d->create == nullptr ||
      (d->param_count > 0 && d->params == nullptr)) {
    throw Error(
        ErrorKind::plugin,
        fmt::format("'{}' has an incomplete descriptor (name, factory or schema missing)", shown));
  }
  PluginInfo info;
  info.kind = kind;
  info.name = d->name;
  info.version = d->version ? d->version : "";
  info.description = d->description ? d->description : "";
  info.file = file;
  info.build_tag = tag;
  info.abi_version = d->abi_version;
  info.interface_revision = d->interface_revision;
  for (std::size_t i = 0; i < d->param_count; ++i) {
    const ParamSpec& p = d->params[i];
    if (p.key == nullptr || *p.key == '\0')
      throw Error(ErrorKind::plugin,
                  fmt::format("'{}': parameter {} of its schema has no key", shown, i));
    if (static_cast<std::uint32_t>(p.type) > static_cast<std::uint32_t>(ParamType::string_list))
      throw Error(ErrorKind::plugin,
                  fmt::format("'{}': parameter '{}' of its schema has unknown type {} (valid: "
                              "0 to {})",
                              shown, excerpt(p.key), static_cast<std::uint32_t>(p.type),
                              static_cast<std::uint32_t>(ParamType::string_list)));
    const bool has_min = p.flags & param_has_min, has_max = p.flags & param_has_max;
    if ((has_min && std::isnan(p.min_value)) || (has_max && std::isnan(p.max_value)))
      throw Error(ErrorKind::plugin,
                  fmt::format("'{}': parameter '{}' of its schema has a NaN bound (valid: any "
                              "other number, or clear the param_has_min/param_has_max flag)",
                              shown, excerpt(p.key)));
    if (!has_min && p.min_value != 0)
      refuse_unflagged_bound(shown, info, p, "min_value", p.min_value, "param_has_min");
    if (!has_max && p.max_value != 0)
      refuse_unflagged_bound(shown, info, p, "max_value", p.max_value, "param_has_max");
    if (has_min && has_max && p.min_value > p.max_value)
      throw Error(ErrorKind::plugin,
                  fmt::format("'{}': parameter '{}' of its schema has min_value {} above "
                              "max_value {} (valid: min_value <= max_value)",
                              shown, excerpt(p.key), p.min_value, p.max_value));
    info.params.push_back(p);
  }
  PluginKind file_kind;
  std::string file_name;
  if (parse_plugin_file_name(file.filename().native(), file_kind, file_name) &&
      (file_kind != info.kind || file_name != info.name)) {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' declares plugin {}/{} but its file name says {}/{}; name the "
                            "file libductile_{}_{}.so",
                            shown, to_string(info.kind), info.name, to_string(file_kind), file_name,
                            to_string(info.kind), info.name));
  }
  info.factory = d->create;
  info.validate = d->validate;
  return info;
}

namespace {

[[noreturn]] void refuse_untrusted(const fs::path& file, const std::string& reason) {
  throw Error(ErrorKind::plugin,
              fmt::format("'{}' is refused: it {}; {}", file.string(), reason, kTrustRule));
}

void require_file(const fs::path& file) {
  std::error_code exists_error;
  if (!fs::is_regular_file(file, exists_error))
    throw Error(ErrorKind::not_found,
                fmt::format("plugin file '{}' does not exist", file.string()));
}

// Loads `file`, found trusted, by its resolved path `real` (a link changed
// afterwards does not matter).
PluginInfo load_trusted_plugin_file(const fs::path& file, const fs::path& real);

}  // namespace

// Nothing of the file runs before these checks: not the constructors of a
// file another user could have put there, nor those of a library that is not
// a plugin.
PluginInfo load_plugin_file(const fs::path& file) {
  require_file(file);
  std::error_code resolve_error;
  const fs::path real = fs::canonical(file, resolve_error);
  if (resolve_error)
    refuse_untrusted(file, fmt::format("cannot be resolved: {}", resolve_error.message()));
  if (auto reason = untrusted_reason(file, real)) refuse_untrusted(file, *reason);
  return load_trusted_plugin_file(file, real);
}

PluginInfo load_plugin_file_in(const fs::path& file, const fs::path& real_directory) {
  require_file(file);
  fs::path real;
  if (auto reason = untrusted_file_reason(file, real_directory, real))
    refuse_untrusted(file, *reason);
  return load_trusted_plugin_file(file, real);
}

namespace {

PluginInfo load_trusted_plugin_file(const fs::path& file, const fs::path& real) {
  const std::string shown = file.string();
  const ElfExport elf = find_elf_export_in_file(real, DUCTILE_PLUGIN_ENTRY_SYMBOL);
  if (!elf.loadable)
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' is not a loadable shared library: it {}", shown, elf.problem));
  if (!elf.exported) {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' is a shared library but not a ductile plugin: it does not "
                            "export the entry symbol '{}' (define it with DUCTILE_PLUGIN); it was "
                            "not loaded",
                            shown, DUCTILE_PLUGIN_ENTRY_SYMBOL));
  }

  boost::dll::shared_library library;
  boost::dll::fs::error_code ec;
  library.load(real, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local, ec);
  if (ec || !library.is_loaded()) {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' is not a loadable shared library: {}", shown, ec.message()));
  }
  if (!library.has(DUCTILE_PLUGIN_ENTRY_SYMBOL)) {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' is a shared library but not a ductile plugin: it does not "
                            "export the entry symbol '{}' (define it with DUCTILE_PLUGIN)",
                            shown, DUCTILE_PLUGIN_ENTRY_SYMBOL));
  }
  auto entry = library.get<const ductile_plugin_descriptor*()>(DUCTILE_PLUGIN_ENTRY_SYMBOL);
  const ductile_plugin_descriptor* descriptor = entry();
  // Nothing is read through the descriptor before its pointers are known to
  // lead into the library.
  check_descriptor_memory(descriptor, mapped_ranges(library.native()), file);
  PluginInfo info = check_plugin_descriptor(descriptor, file);
  info.library = std::make_shared<LoadedLibrary>(std::move(library));
  keep_loaded(info.library);
  return info;
}

}  // namespace

}  // namespace ductile::core
