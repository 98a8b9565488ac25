// Boost.DLL on std::filesystem: the core then needs no Boost library at run
// time (one shared object fewer to map and relocate at every start).
#define BOOST_DLL_USE_STD_FS 1
#include "ductile/core/registry.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <mutex>
#include <system_error>

#include <fmt/format.h>
#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>

#include "ductile/core/text.hpp"
#include "ductile/version.hpp"

namespace ductile::core {

class LoadedLibrary {
 public:
  explicit LoadedLibrary(boost::dll::shared_library library) : library_(std::move(library)) {}

 private:
  boost::dll::shared_library library_;
};

namespace {

namespace fs = std::filesystem;
constexpr std::string_view kPrefix = "libductile_";
constexpr std::string_view kSuffix = ".so";

bool split_file_name(const fs::path& file, PluginKind& kind, std::string& name) {
  std::string base = file.filename().string();
  if (base.size() <= kPrefix.size() + kSuffix.size() || !base.starts_with(kPrefix) ||
      !base.ends_with(kSuffix))
    return false;
  std::string_view middle(base);
  middle = middle.substr(kPrefix.size(), middle.size() - kPrefix.size() - kSuffix.size());
  auto underscore = middle.find('_');
  if (underscore == std::string_view::npos || underscore + 1 >= middle.size()) return false;
  if (!parse_plugin_kind(middle.substr(0, underscore), kind)) return false;
  name = std::string(middle.substr(underscore + 1));
  return true;
}

// The size of the ABI x.0 descriptor: every field up to the factory.
constexpr std::size_t kAbiBaseSize =
    offsetof(ductile_plugin_descriptor, create) + sizeof(ductile_plugin_factory);

// Whether a descriptor of `size` bytes has the field at [offset, offset + field_size).
bool descriptor_has(std::size_t size, std::size_t offset, std::size_t field_size) {
  return size >= offset + field_size;
}

// Collects what a plugin reports through ductile_plugin_error.
struct ReportedError {
  bool reported = false;
  ErrorKind kind = ErrorKind::plugin;
  std::string type;
  std::string message;
  std::string key;

  ductile_plugin_error sink() { return {this, &ReportedError::report}; }

  static void report(void* host, std::uint32_t kind, const char* type, const char* message,
                     const char* key) {
    auto* self = static_cast<ReportedError*>(host);
    self->reported = true;
    self->kind = kind <= static_cast<std::uint32_t>(ErrorKind::internal)
                     ? static_cast<ErrorKind>(kind)
                     : ErrorKind::internal;
    self->type = type ? type : "";
    self->message = message ? message : "";
    self->key = key ? key : "";
  }
};

std::string kind_list() {
  return join(plugin_kind_names());
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

}  // namespace

bool parse_plugin_kind(std::string_view text, PluginKind& kind) {
  for (std::uint32_t i = 0; i < kPluginKindCount; ++i) {
    auto k = static_cast<PluginKind>(i);
    if (text == to_string(k)) {
      kind = k;
      return true;
    }
  }
  return false;
}

std::vector<std::string> plugin_kind_names() {
  std::vector<std::string> out;
  for (std::uint32_t i = 0; i < kPluginKindCount; ++i)
    out.emplace_back(to_string(static_cast<PluginKind>(i)));
  return out;
}

PluginInfo check_plugin_descriptor(const ductile_plugin_descriptor* d, const fs::path& file) {
  const std::string shown = file.string();
  if (d == nullptr)
    throw Error(ErrorKind::plugin,
                fmt::format("'{}': its entry point returned no descriptor", shown));
  if (d->abi_major != DUCTILE_ABI_MAJOR) {
    throw Error(
        ErrorKind::plugin,
        fmt::format("'{}' was built for plugin ABI {}.{} but this ductile uses ABI {}.{}; "
                    "rebuild the plugin against this SDK",
                    shown, d->abi_major, d->abi_minor, DUCTILE_ABI_MAJOR, DUCTILE_ABI_MINOR));
  }
  // Any minor version: read the fields the plugin's descriptor has (see the
  // rule in plugin.hpp); the ABI 2.0 fields are required.
  const std::size_t size = d->struct_size;
  if (!descriptor_has(size, offsetof(ductile_plugin_descriptor, create),
                      sizeof(ductile_plugin_factory))) {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' has a descriptor of {} bytes, smaller than the {} bytes of ABI "
                            "{}.0; rebuild the plugin against this SDK",
                            shown, size, kAbiBaseSize, DUCTILE_ABI_MAJOR));
  }
  std::string tag = d->build_tag ? d->build_tag : "";
  if (tag != DUCTILE_BUILD_TAG) {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' was built with '{}' but this ductile was built with '{}'; "
                            "rebuild the plugin with the same compiler, standard library, fmt "
                            "and spdlog",
                            shown, tag, DUCTILE_BUILD_TAG));
  }
  if (d->kind >= kPluginKindCount) {
    throw Error(ErrorKind::plugin, fmt::format("'{}' declares unknown plugin kind {} (valid: {})",
                                               shown, d->kind, kind_list()));
  }
  if (d->name == nullptr || *d->name == '\0' || d->create == nullptr ||
      (d->param_count > 0 && d->params == nullptr)) {
    throw Error(
        ErrorKind::plugin,
        fmt::format("'{}' has an incomplete descriptor (name, factory or schema missing)", shown));
  }
  PluginInfo info;
  info.kind = static_cast<PluginKind>(d->kind);
  info.name = d->name;
  info.version = d->version ? d->version : "";
  info.description = d->description ? d->description : "";
  info.file = file;
  info.build_tag = tag;
  info.abi_major = d->abi_major;
  info.abi_minor = d->abi_minor;
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
    if (has_min && has_max && p.min_value > p.max_value)
      throw Error(ErrorKind::plugin,
                  fmt::format("'{}': parameter '{}' of its schema has min_value {} above "
                              "max_value {} (valid: min_value <= max_value)",
                              shown, excerpt(p.key), p.min_value, p.max_value));
    info.params.push_back(p);
  }
  PluginKind file_kind;
  std::string file_name;
  if (split_file_name(file, file_kind, file_name) &&
      (file_kind != info.kind || file_name != info.name)) {
    throw Error(ErrorKind::plugin,
                fmt::format("'{}' declares plugin {}/{} but its file name says {}/{}; name the "
                            "file libductile_{}_{}.so",
                            shown, to_string(info.kind), info.name, to_string(file_kind), file_name,
                            to_string(info.kind), info.name));
  }
  info.factory = d->create;
  if (descriptor_has(size, offsetof(ductile_plugin_descriptor, validate),
                     sizeof(ductile_plugin_validate)))
    info.validate = d->validate;
  return info;
}

PluginInfo load_plugin_file(const fs::path& file) {
  const std::string shown = file.string();
  std::error_code exists_error;
  if (!fs::is_regular_file(file, exists_error))
    throw Error(ErrorKind::not_found, fmt::format("plugin file '{}' does not exist", shown));

  boost::dll::shared_library library;
  boost::dll::fs::error_code ec;
  library.load(file, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local, ec);
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
  PluginInfo info = check_plugin_descriptor(entry(), file);
  info.library = std::make_shared<LoadedLibrary>(std::move(library));
  keep_loaded(info.library);
  return info;
}

// A file on the search path whose name says libductile_<kind>_<name>.so,
// with the later files of the same kind and name that it shadows.
struct Candidate {
  PluginKind kind;
  std::string name;
  fs::path file;
  std::vector<fs::path> shadowed;
};

struct PluginRegistry::State {
  std::vector<fs::path> search_path;
  std::shared_ptr<spdlog::logger> logger;
  std::vector<Candidate> candidates;  // search-path order, one per kind and name
  std::mutex mutex;
  // Results of loading, by index into `candidates`: a loaded plugin (stable
  // address, handed out by find()) or the failure.
  std::map<std::size_t, PluginInfo> loaded;
  std::map<std::size_t, std::string> failed;
  bool all_loaded = false;
  std::vector<PluginInfo> all;        // plugins(), once all_loaded
  std::vector<LoadProblem> problems;  // problems(), once all_loaded

  // Loads candidate `i` once; returns nullptr when it failed. Caller holds
  // the mutex.
  const PluginInfo* load(std::size_t i) {
    if (auto it = loaded.find(i); it != loaded.end()) return &it->second;
    if (failed.count(i)) return nullptr;
    const Candidate& c = candidates[i];
    if (logger)
      for (const auto& other : c.shadowed)
        logger->warn(
            "plugin {}/{} found twice: using '{}', ignoring '{}' (earlier on the "
            "search path wins)",
            to_string(c.kind), c.name, c.file.string(), other.string());
    try {
      return &loaded.emplace(i, load_plugin_file(c.file)).first->second;
    } catch (const std::exception& e) {
      failed.emplace(i, e.what());
      if (logger) logger->warn("{}", e.what());
      return nullptr;
    }
  }

  void load_all() {
    if (all_loaded) return;
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      if (const PluginInfo* info = load(i))
        all.push_back(*info);
      else
        problems.push_back({candidates[i].file, failed.at(i)});
    }
    std::stable_sort(all.begin(), all.end(), [](const PluginInfo& a, const PluginInfo& b) {
      return std::tie(a.kind, a.name) < std::tie(b.kind, b.name);
    });
    all_loaded = true;
  }
};

PluginRegistry::PluginRegistry(std::vector<fs::path> search_path,
                               std::shared_ptr<spdlog::logger> logger)
    : state_(std::make_unique<State>()) {
  state_->search_path = std::move(search_path);
  state_->logger = std::move(logger);
  std::map<std::pair<PluginKind, std::string>, std::size_t> seen;
  std::vector<fs::path> scanned;
  for (const auto& dir : state_->search_path) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) {
      if (state_->logger)
        state_->logger->debug("plugin directory '{}' does not exist; skipped", dir.string());
      continue;
    }
    // The same directory named twice (say, the built-in one in [plugins] path
    // too) holds no competing plugins: scan it once.
    fs::path canonical = fs::weakly_canonical(dir, ec);
    if (std::find(scanned.begin(), scanned.end(), canonical) != scanned.end()) continue;
    scanned.push_back(canonical);
    std::vector<Candidate> files;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      Candidate c;
      if (split_file_name(it->path(), c.kind, c.name)) {
        c.file = it->path();
        files.push_back(std::move(c));
      }
    }
    std::sort(files.begin(), files.end(),
              [](const Candidate& a, const Candidate& b) { return a.file < b.file; });
    for (auto& c : files) {
      auto key = std::make_pair(c.kind, c.name);
      if (auto found = seen.find(key); found != seen.end()) {
        state_->candidates[found->second].shadowed.push_back(c.file);
        continue;
      }
      seen.emplace(key, state_->candidates.size());
      state_->candidates.push_back(std::move(c));
    }
  }
}

PluginRegistry::PluginRegistry(PluginRegistry&&) noexcept = default;
PluginRegistry& PluginRegistry::operator=(PluginRegistry&&) noexcept = default;
PluginRegistry::~PluginRegistry() = default;

const std::vector<fs::path>& PluginRegistry::search_path() const {
  return state_->search_path;
}

const std::vector<PluginInfo>& PluginRegistry::plugins() const {
  std::lock_guard lock(state_->mutex);
  state_->load_all();
  return state_->all;
}

const std::vector<LoadProblem>& PluginRegistry::problems() const {
  std::lock_guard lock(state_->mutex);
  state_->load_all();
  return state_->problems;
}

std::vector<fs::path> PluginRegistry::default_search_path(
    const std::vector<fs::path>& config_dirs) {
  std::vector<fs::path> path(config_dirs.begin(), config_dirs.end());
  if (const char* env = std::getenv("DUCTILE_PLUGIN_PATH"); env && *env) {
    std::string_view rest(env);
    while (!rest.empty()) {
      auto colon = rest.find(':');
      auto part = rest.substr(0, colon);
      if (!part.empty()) path.emplace_back(std::string(part));
      if (colon == std::string_view::npos) break;
      rest.remove_prefix(colon + 1);
    }
  }
  path.push_back(builtin_plugin_dir());
  return path;
}

fs::path PluginRegistry::core_library_dir() {
  boost::dll::fs::error_code ec;
  auto here = boost::dll::this_line_location(ec);
  if (ec) return fs::path(".");
  return here.parent_path();
}

fs::path PluginRegistry::builtin_plugin_dir() {
  return (core_library_dir() / DUCTILE_PLUGIN_RELATIVE_DIR).lexically_normal();
}

const PluginInfo& PluginRegistry::find(PluginKind kind, std::string_view name) const {
  std::lock_guard lock(state_->mutex);
  const auto& candidates = state_->candidates;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    if (candidates[i].kind != kind || candidates[i].name != name) continue;
    if (const PluginInfo* info = state_->load(i)) return *info;
    throw Error(ErrorKind::plugin, fmt::format("{} plugin '{}' cannot be used: {}", to_string(kind),
                                               name, state_->failed.at(i)));
  }
  std::vector<std::string> available;
  for (const auto& c : candidates)
    if (c.kind == kind) available.push_back(c.name);
  std::sort(available.begin(), available.end());
  std::vector<std::string> dirs;
  for (const auto& d : state_->search_path) dirs.push_back(d.string());
  throw Error(
      ErrorKind::not_found,
      fmt::format("no {} plugin named '{}'{}; available: {}; searched: {}", to_string(kind),
                  excerpt(name), did_you_mean(name, available), join(available), join(dirs)));
}

const PluginInfo& PluginRegistry::find_any(std::string_view name) const {
  auto slash = name.find('/');
  if (slash != std::string_view::npos) {
    PluginKind kind;
    if (!parse_plugin_kind(name.substr(0, slash), kind))
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("'{}': unknown plugin kind '{}'; valid kinds: {}", excerpt(name),
                              excerpt(name.substr(0, slash)), kind_list()));
    return find(kind, name.substr(slash + 1));
  }
  std::vector<std::string> all;
  std::vector<std::string> qualified;
  const Candidate* match = nullptr;
  for (const auto& c : state_->candidates) {
    all.push_back(c.name);
    if (c.name == name) {
      qualified.push_back(std::string(to_string(c.kind)) + "/" + c.name);
      match = &c;
    }
  }
  if (qualified.size() > 1)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("plugin name '{}' is ambiguous; use one of: {}", excerpt(name),
                            join(qualified)));
  if (match) return find(match->kind, match->name);
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  throw Error(ErrorKind::not_found, fmt::format("no plugin named '{}'{}; available: {}",
                                                excerpt(name), did_you_mean(name, all), join(all)));
}

std::vector<std::string> PluginRegistry::names(PluginKind kind) const {
  std::vector<std::string> out;
  for (const auto& c : state_->candidates)
    if (c.kind == kind) out.push_back(c.name);
  std::sort(out.begin(), out.end());
  return out;
}

std::shared_ptr<Plugin> create_plugin(const PluginInfo& info, const HostContext& context) {
  auto library = info.library;
  ReportedError reported;
  ductile_plugin_error sink = reported.sink();
  Plugin* object = info.factory(&context, &sink);
  if (object == nullptr) {
    throw Error(reported.kind,
                fmt::format("{} plugin '{}' ({}) failed to create an instance: {}",
                            to_string(info.kind), info.name, info.file.string(),
                            reported.reported && !reported.message.empty() ? reported.message
                                                                           : "no reason given"),
                reported.type);
  }
  return std::shared_ptr<Plugin>(object, [library](Plugin* p) { delete p; });
}

std::optional<PluginParamError> check_plugin_params(const PluginInfo& info, const Params& params) {
  if (!info.validate) return std::nullopt;
  ReportedError reported;
  ductile_plugin_error sink = reported.sink();
  if (info.validate(&params, info.name.c_str(), &sink)) return std::nullopt;
  PluginParamError error;
  error.kind = reported.kind;
  error.type = reported.type;
  error.message = reported.reported && !reported.message.empty()
                      ? reported.message
                      : fmt::format("{} plugin '{}' refused its parameters without saying why",
                                    to_string(info.kind), info.name);
  error.key = reported.key;
  return error;
}

void validate_plugin_params(const PluginInfo& info, const Params& params) {
  if (auto error = check_plugin_params(info, params)) {
    if (!error->key.empty()) throw ParamError(error->kind, error->key, error->message, error->type);
    throw Error(error->kind, error->message, error->type);
  }
}

std::shared_ptr<Plugin> PluginRegistry::create(const PluginInfo& info,
                                               const HostContext& context) const {
  return create_plugin(info, context);
}

}  // namespace ductile::core
