#include "ductile/core/runtime.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "config_internal.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/core/text.hpp"

namespace ductile::core {

struct Runtime::State {
  std::shared_ptr<spdlog::logger> logger;
  // Shared by the runtimes made with with_config: the plugins are found once.
  std::shared_ptr<PluginRegistry> registry;
  std::unique_ptr<Config> config;
  std::recursive_mutex mutex;
  std::map<PluginKind, std::shared_ptr<Plugin>> instances;
  std::vector<PluginKind> creating;  // to report require() cycles

  std::shared_ptr<Plugin> create(const PluginInfo& info, Params params);
  std::shared_ptr<Plugin> instance(PluginKind kind);
};

namespace {

class HostContextImpl final : public HostContext {
 public:
  HostContextImpl(Runtime::State& state, const PluginInfo& info, Params params)
      : state_(state), info_(info), params_(std::move(params)) {
    logger_ = make_logger(fmt::format("{}.{}", to_string(info.kind), info.name));
    if (state.logger) logger_->set_level(state.logger->level());
  }
  std::string_view plugin_name() const override { return info_.name; }
  const Params& params() const override { return params_; }
  std::shared_ptr<spdlog::logger> logger() const override { return logger_; }
  std::shared_ptr<Plugin> require(PluginKind kind) const override { return state_.instance(kind); }

 private:
  Runtime::State& state_;
  const PluginInfo& info_;
  Params params_;
  std::shared_ptr<spdlog::logger> logger_;
};

}  // namespace

Params complete_params(const PluginInfo& info, const Params& given) {
  std::vector<std::string> problems;
  std::vector<std::string> known;
  for (const auto& s : info.params) known.emplace_back(s.key);
  Params out;
  for (const auto& [key, value] : given.values()) {
    // (a lambda may not capture a structured binding before clang 16)
    const std::string& name = key;
    auto spec = std::find_if(info.params.begin(), info.params.end(),
                             [&](const ParamSpec& s) { return name == s.key; });
    if (spec == info.params.end()) {
      problems.push_back(fmt::format("unknown parameter '{}'{}; valid: {}", key,
                                     did_you_mean(key, known), join(known)));
      continue;
    }
    std::string error;
    if (auto checked = check_param_value(*spec, value, key, error))
      out.set(key, std::move(*checked));
    else
      problems.push_back(std::move(error));
  }
  for (const auto& s : info.params) {
    if (out.has(s.key) || given.has(s.key)) continue;
    if (s.flags & param_required)
      problems.push_back(fmt::format("missing required parameter '{}'", s.key));
    else if (s.default_value)
      out.set(s.key, parse_param_literal(s, s.default_value));
  }
  if (!problems.empty())
    throw Error(ErrorKind::config, fmt::format("{} plugin '{}': {}", to_string(info.kind),
                                               info.name, join(problems, "; ")));
  return out;
}

Params schema_params(const PluginInfo& info, const Params& given,
                     std::vector<std::string>* dropped) {
  Params kept;
  for (const auto& [key, value] : given.values()) {
    const bool known = std::any_of(info.params.begin(), info.params.end(),
                                   [&](const ParamSpec& s) { return key == s.key; });
    if (known)
      kept.set(key, value);
    else if (dropped)
      dropped->push_back(key);
  }
  return kept;
}

std::vector<std::string> schema_allowed_values(const PluginInfo& info, std::string_view key) {
  for (const auto& spec : info.params)
    if (key == spec.key) return allowed_list(spec);
  return {};
}

std::shared_ptr<Plugin> Runtime::State::create(const PluginInfo& info, Params params) {
  // Every error the plugin can know from its parameters, as it reported it
  // (kind, type and message), before its constructor runs.
  validate_plugin_params(info, params);
  HostContextImpl context(*this, info, std::move(params));
  return create_plugin(info, context);
}

std::shared_ptr<Plugin> Runtime::State::instance(PluginKind kind) {
  std::lock_guard lock(mutex);
  if (auto it = instances.find(kind); it != instances.end()) return it->second;
  if (std::find(creating.begin(), creating.end(), kind) != creating.end())
    throw Error(
        ErrorKind::config,
        fmt::format("the {} plugin requires itself (through other plugins)", to_string(kind)));
  const PluginSection* section = config->section(kind);
  if (!section) {
    std::optional<SectionSpec> spec;
    for (auto& s : section_specs())
      if (s.kind == kind) spec = std::move(s);
    if (!spec || spec->default_plugin.empty())
      throw Error(ErrorKind::config,
                  fmt::format("{}: no [{}] section; add one naming the {} plugin to use",
                              config->source_name(), to_string(kind), to_string(kind)));
    // Sections with a default plugin may be omitted.
    const PluginInfo& info = registry->find(kind, spec->default_plugin);
    creating.push_back(kind);
    struct Pop {
      std::vector<PluginKind>& v;
      ~Pop() { v.pop_back(); }
    } pop{creating};
    auto object = create(info, complete_params(info, {}));
    instances[kind] = object;
    return object;
  }
  const PluginInfo& info = registry->find(kind, section->plugin);
  creating.push_back(kind);
  struct Pop {
    std::vector<PluginKind>& v;
    ~Pop() { v.pop_back(); }
  } pop{creating};
  auto object = create(info, section->params);
  instances[kind] = object;
  return object;
}

Runtime::Runtime(std::unique_ptr<State> state) : state_(std::move(state)) {}
Runtime::Runtime(Runtime&&) noexcept = default;
Runtime& Runtime::operator=(Runtime&&) noexcept = default;
Runtime::~Runtime() = default;

Runtime Runtime::from_file(const std::filesystem::path& file, RuntimeOptions options) {
  return from_document(ConfigDocument::from_file(file), std::move(options));
}

Runtime Runtime::from_string(std::string_view toml, std::string_view source_name,
                             RuntimeOptions options) {
  return from_document(ConfigDocument::from_string(toml, source_name), std::move(options));
}

Runtime Runtime::from_document(const ConfigDocument& document, RuntimeOptions options) {
  auto state = std::make_unique<State>();
  state->logger = options.logger ? options.logger : core::logger();
  auto dirs = options.extra_plugin_dirs;
  RegistryOptions registry_options;
  registry_options.builtin_overrides = options.builtin_overrides;
  for (auto& ref : document.builtin_overrides())
    registry_options.builtin_overrides.push_back(std::move(ref));
  if (options.search_config_plugin_dirs) {
    for (auto& d : document.plugin_dirs()) dirs.push_back(d);
  }
  auto search_path = PluginRegistry::default_search_path(dirs);
  if (!options.search_config_plugin_dirs && !document.plugin_dirs().empty()) {
    // Named by the file and not searched, unless on the path anyway (the
    // built-in directory named again, say).
    std::vector<std::filesystem::path> searched;
    for (const auto& d : search_path) {
      std::error_code ec;
      searched.push_back(std::filesystem::weakly_canonical(d, ec));
    }
    for (auto& d : document.plugin_dirs()) {
      std::error_code ec;
      if (std::find(searched.begin(), searched.end(), std::filesystem::weakly_canonical(d, ec)) ==
          searched.end())
        registry_options.unsearched.push_back({d, options.config_dirs_note});
    }
  }
  state->registry = std::make_shared<PluginRegistry>(std::move(search_path), state->logger,
                                                     std::move(registry_options));
  state->config =
      std::make_unique<Config>(Config::validate(document, *state->registry, options.plugin_checks));
  return Runtime(std::move(state));
}

Runtime Runtime::with_config(const ConfigDocument& document, bool plugin_checks) const {
  auto state = std::make_unique<State>();
  state->logger = state_->logger;
  state->registry = state_->registry;
  state->config =
      std::make_unique<Config>(Config::validate(document, *state->registry, plugin_checks));
  return Runtime(std::move(state));
}

const Config& Runtime::config() const {
  return *state_->config;
}
const PluginRegistry& Runtime::registry() const {
  return *state_->registry;
}
std::shared_ptr<spdlog::logger> Runtime::logger() const {
  return state_->logger;
}

bool Runtime::has(PluginKind kind) const {
  return state_->config->section(kind) != nullptr;
}

std::shared_ptr<Plugin> Runtime::instance(PluginKind kind) {
  return state_->instance(kind);
}

std::shared_ptr<Plugin> Runtime::create(PluginKind kind, std::string_view name,
                                        const Params& params) {
  std::lock_guard lock(state_->mutex);
  const PluginInfo& info = state_->registry->find(kind, name);
  return state_->create(info, complete_params(info, params));
}

}  // namespace ductile::core
