#include "ductile/core/registry.hpp"

#include <dirent.h>
#include <dlfcn.h>
#include <link.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <system_error>

#include <fmt/format.h>

#include "ductile/core/plugin_trust.hpp"
#include "ductile/core/text.hpp"
#include "registry_internal.hpp"

namespace ductile::core {

namespace fs = std::filesystem;

namespace {
constexpr std::string_view kPrefix = "libductile_";
constexpr std::string_view kSuffix = ".so";
}  // namespace

bool parse_plugin_file_name(std::string_view base, PluginKind& kind, std::string& name) {
  if (base.size() <= kPrefix.size() + kSuffix.size() || !base.starts_with(kPrefix) ||
      !base.ends_with(kSuffix))
    return false;
  std::string_view middle =
      base.substr(kPrefix.size(), base.size() - kPrefix.size() - kSuffix.size());
  auto underscore = middle.find('_');
  if (underscore == std::string_view::npos || underscore + 1 >= middle.size()) return false;
  if (!parse_plugin_kind(middle.substr(0, underscore), kind)) return false;
  name = std::string(middle.substr(underscore + 1));
  return true;
}

std::string plugin_kind_list() {
  return join(plugin_kind_names());
}

namespace {

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

std::optional<PluginRef> parse_plugin_ref(std::string_view text) {
  const auto slash = text.find('/');
  if (slash == std::string_view::npos || slash + 1 >= text.size()) return std::nullopt;
  PluginRef ref;
  if (!parse_plugin_kind(text.substr(0, slash), ref.kind)) return std::nullopt;
  ref.name = std::string(text.substr(slash + 1));
  return ref;
}

std::vector<std::string> plugin_kind_names() {
  std::vector<std::string> out;
  for (std::uint32_t i = 0; i < kPluginKindCount; ++i)
    out.emplace_back(to_string(static_cast<PluginKind>(i)));
  return out;
}

// A file on the search path whose name says libductile_<kind>_<name>.so,
// with the later files of the same kind and name that it shadows, and the
// files that named a built-in plugin without leave (when it is built in).
struct Candidate {
  PluginKind kind;
  std::string name;
  // Paths are made when used: a directory's files are many, the plugins a
  // process loads few (std::filesystem splits a path into components as it
  // is made, copied or appended to).
  std::string file;
  std::shared_ptr<const fs::path> real_directory;  // its directory, resolved and found trusted
  bool builtin = false;                            // in the built-in plugin directory
  std::vector<fs::path> shadowed;
  std::vector<fs::path> refused;
};

std::string refused_shadow_message(const Candidate& builtin, const fs::path& file) {
  return fmt::format(
      "'{}' is not used: it has the name of the built-in {} plugin '{}' ('{}'), which a plugin "
      "found elsewhere replaces only when the configuration asks for it with [plugins] "
      "override_builtin = [\"{}/{}\"]",
      file.string(), to_string(builtin.kind), builtin.name, builtin.file, to_string(builtin.kind),
      builtin.name);
}

struct PluginRegistry::State {
  std::vector<fs::path> search_path;
  std::shared_ptr<spdlog::logger> logger;
  std::vector<Candidate> candidates;      // search-path order, one per kind and name
  std::vector<SkippedDirectory> skipped;  // unsearched (options) and refused directories
  std::vector<LoadProblem> refused_dirs;  // the refused ones, for problems()
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
    if (logger) {
      for (const auto& other : c.shadowed)
        logger->warn(
            "plugin {}/{} found twice: using '{}', ignoring '{}' (earlier on the "
            "search path wins)",
            to_string(c.kind), c.name, c.file, other.string());
      for (const auto& other : c.refused) logger->warn("{}", refused_shadow_message(c, other));
    }
    try {
      return &loaded.emplace(i, load_plugin_file_in(c.file, *c.real_directory)).first->second;
    } catch (const std::exception& e) {
      failed.emplace(i, e.what());
      if (logger) logger->warn("{}", e.what());
      return nullptr;
    }
  }

  void load_all() {
    if (all_loaded) return;
    problems = refused_dirs;
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      if (const PluginInfo* info = load(i))
        all.push_back(*info);
      else
        problems.push_back({candidates[i].file, failed.at(i)});
      for (const auto& other : candidates[i].refused)
        problems.push_back({other, refused_shadow_message(candidates[i], other)});
    }
    std::stable_sort(all.begin(), all.end(), [](const PluginInfo& a, const PluginInfo& b) {
      return std::tie(a.kind, a.name) < std::tie(b.kind, b.name);
    });
    all_loaded = true;
  }
};

PluginRegistry::PluginRegistry(std::vector<fs::path> search_path,
                               std::shared_ptr<spdlog::logger> logger, RegistryOptions options)
    : state_(std::make_unique<State>()) {
  state_->search_path = std::move(search_path);
  state_->logger = std::move(logger);
  state_->skipped = std::move(options.unsearched);
  const auto& overrides = options.builtin_overrides;
  // The built-in directory is recognised by its identity (device and inode),
  // which costs one stat() where resolving its path costs one per component.
  struct stat builtin_status {};
  const bool has_builtin = ::stat(builtin_plugin_dir().c_str(), &builtin_status) == 0;
  std::map<std::pair<PluginKind, std::string>, std::size_t> seen;
  std::vector<fs::path> scanned;
  for (const auto& dir : state_->search_path) {
    struct stat status {};
    if (::stat(dir.c_str(), &status) != 0 || !S_ISDIR(status.st_mode)) {
      if (state_->logger)
        state_->logger->debug("plugin directory '{}' does not exist; skipped", dir.string());
      continue;
    }
    // Resolved once, for the three uses below and for loading its files.
    std::error_code ec;
    const fs::path canonical = fs::canonical(dir, ec);
    // The same directory named twice (say, the built-in one in [plugins] path
    // too) holds no competing plugins: scan it once.
    if (!ec && std::find(scanned.begin(), scanned.end(), canonical) != scanned.end()) continue;
    if (!ec) scanned.push_back(canonical);
    auto reason =
        ec ? std::optional<std::string>(fmt::format("cannot be resolved: {}", ec.message()))
           : untrusted_reason(dir, canonical);
    if (reason) {
      std::string message = fmt::format("plugin directory '{}' is refused: it {}; {}", dir.string(),
                                        *reason, kTrustRule);
      if (state_->logger) state_->logger->warn("{}", message);
      state_->refused_dirs.push_back({dir, message});
      state_->skipped.push_back({dir, "refused: it " + *reason});
      continue;
    }
    const auto real_directory = std::make_shared<const fs::path>(canonical);
    const bool in_builtin = has_builtin && status.st_dev == builtin_status.st_dev &&
                            status.st_ino == builtin_status.st_ino;
    // Names first: a path is made only for the files named like plugins
    // (std::filesystem's directory iteration made one, and split it into
    // components, for every entry).
    struct Listed {
      std::string file_name;
      PluginKind kind;
      std::string name;
    };
    std::vector<Listed> listed;
    if (DIR* listing = ::opendir(dir.c_str())) {
      while (const dirent* entry = ::readdir(listing)) {
        PluginKind kind{};
        std::string name;
        if (parse_plugin_file_name(entry->d_name, kind, name))
          listed.push_back({entry->d_name, kind, std::move(name)});
      }
      ::closedir(listing);
    }
    // One directory: its files' order is their names' order.
    std::sort(listed.begin(), listed.end(),
              [](const Listed& a, const Listed& b) { return a.file_name < b.file_name; });
    for (auto& l : listed) {
      Candidate c;
      c.kind = l.kind;
      c.name = std::move(l.name);
      c.file = dir.native();
      if (!c.file.empty() && c.file.back() != '/') c.file += '/';
      c.file += l.file_name;
      c.real_directory = real_directory;
      c.builtin = in_builtin;
      auto key = std::make_pair(c.kind, c.name);
      auto found = seen.find(key);
      if (found == seen.end()) {
        seen.emplace(key, state_->candidates.size());
        state_->candidates.push_back(std::move(c));
        continue;
      }
      Candidate& first = state_->candidates[found->second];
      const bool may_replace_builtin = std::find(overrides.begin(), overrides.end(),
                                                 PluginRef{c.kind, c.name}) != overrides.end();
      if (may_replace_builtin || first.builtin == c.builtin) {
        first.shadowed.push_back(c.file);  // the first on the search path wins
      } else if (c.builtin) {
        // The built-in plugin wins over the files found before it.
        first.refused.push_back(first.file);
        first.refused.insert(first.refused.end(), first.shadowed.begin(), first.shadowed.end());
        first.shadowed.clear();
        first.file = c.file;
        first.real_directory = c.real_directory;
        first.builtin = true;
      } else {
        first.refused.push_back(c.file);
      }
    }
  }
}

PluginRegistry::PluginRegistry(PluginRegistry&&) noexcept = default;
PluginRegistry& PluginRegistry::operator=(PluginRegistry&&) noexcept = default;
PluginRegistry::~PluginRegistry() = default;

const std::vector<fs::path>& PluginRegistry::search_path() const {
  return state_->search_path;
}

const std::vector<SkippedDirectory>& PluginRegistry::skipped() const {
  return state_->skipped;
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

namespace {

fs::path find_core_library_dir() {
  // The module that holds this code: libductile_core.so, or the program
  // itself when the core is linked into it (the `ductile` program built with
  // DUCTILE_STATIC_RUNTIME), whose link map has no name.
  Dl_info info;
  link_map* module = nullptr;
  if (dladdr1(reinterpret_cast<void*>(&find_core_library_dir), &info,
              reinterpret_cast<void**>(&module), RTLD_DL_LINKMAP) != 0 &&
      module != nullptr && module->l_name != nullptr && module->l_name[0] != '\0')
    return fs::path(module->l_name).parent_path();
  std::error_code ec;
  const fs::path program = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return fs::path(".");
  return (program.parent_path() / DUCTILE_BIN_TO_LIB_DIR).lexically_normal();
}

}  // namespace

fs::path PluginRegistry::core_library_dir() {
  static const fs::path dir = find_core_library_dir();  // a module does not move
  return dir;
}

fs::path PluginRegistry::builtin_plugin_dir() {
  static const fs::path dir = (core_library_dir() / DUCTILE_PLUGIN_RELATIVE_DIR).lexically_normal();
  return dir;
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
  std::string skipped;
  for (const auto& d : state_->skipped)
    skipped += fmt::format("; not searched: '{}' ({})", d.directory.string(), d.reason);
  throw Error(ErrorKind::not_found,
              fmt::format("no {} plugin named '{}'{}; available: {}; searched: {}{}",
                          to_string(kind), excerpt(name), did_you_mean(name, available),
                          join(available), join(dirs), skipped));
}

const PluginInfo& PluginRegistry::find_any(std::string_view name) const {
  auto slash = name.find('/');
  if (slash != std::string_view::npos) {
    PluginKind kind;
    if (!parse_plugin_kind(name.substr(0, slash), kind))
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("'{}': unknown plugin kind '{}'; valid kinds: {}", excerpt(name),
                              excerpt(name.substr(0, slash)), plugin_kind_list()));
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
