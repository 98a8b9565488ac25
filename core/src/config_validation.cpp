// Config::validate: each section of a parsed document checked against its
// section spec (sections.cpp) and the schema of the plugin it selects, every
// problem collected with its position before anything is created.
#include <algorithm>
#include <tuple>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "config_internal.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/core/text.hpp"

namespace ductile::core {

namespace {

bool before(const SourcePosition& a, const SourcePosition& b) {
  return std::tie(a.line, a.column) < std::tie(b.line, b.column);
}

}  // namespace

bool Problems::wanted(const SourcePosition& where) {
  if (!full_ || before(where, last_)) return true;
  ++dropped_;
  return false;
}

void Problems::add(Diagnostic diagnostic) {
  list_.push_back(std::move(diagnostic));
  if (list_.size() < 4 * kMaxConfigDiagnostics) return;
  std::stable_sort(list_.begin(), list_.end(), [](const Diagnostic& a, const Diagnostic& b) {
    return before(a.where, b.where);
  });
  dropped_ += list_.size() - kMaxConfigDiagnostics;
  list_.resize(kMaxConfigDiagnostics);
  full_ = true;
  last_ = list_.back().where;
}

void Problems::throw_if_any() {
  if (list_.empty()) return;
  std::stable_sort(list_.begin(), list_.end(), [](const Diagnostic& a, const Diagnostic& b) {
    return before(a.where, b.where);
  });
  throw ConfigError(std::move(list_), dropped_);
}

namespace {

// The keys of one section: each must be the plugin's or a host key (or an
// ignored selector); values are converted and checked, missing ones get
// their defaults.
void validate_keys(const toml::table& table, const std::string& file, const std::string& section,
                   const std::vector<ParamSpec>& specs, const std::vector<ParamSpec>& host_specs,
                   const std::vector<std::string>& ignored_keys, const SourcePosition& header,
                   Params& params, Params& host_params, Problems& errors) {
  std::vector<std::string> known;
  for (const auto& s : specs) known.emplace_back(s.key);
  for (const auto& s : host_specs) known.emplace_back(s.key);
  std::vector<std::string> present;
  for (auto&& [key, node] : table) {
    std::string k(key.str());
    present.push_back(k);
    if (std::find(ignored_keys.begin(), ignored_keys.end(), k) != ignored_keys.end()) continue;
    const ParamSpec* spec = nullptr;
    bool host = false;
    for (const auto& s : specs)
      if (k == s.key) spec = &s;
    if (!spec)
      for (const auto& s : host_specs)
        if (k == s.key) spec = &s, host = true;
    if (!spec) {
      if (!errors.wanted(position_of(file, key.source()))) continue;
      errors.add({position_of(file, key.source()),
                  fmt::format("unknown key '{}' in [{}]{}; valid keys: {}", excerpt(k), section,
                              did_you_mean(k, known), join(known))});
      continue;
    }
    std::string error;
    auto value = convert_node(node, *spec, fmt::format("[{}] {}", section, k), error);
    if (!value) {
      errors.add({position_of(file, node.source()), error});
      continue;
    }
    (host ? host_params : params).set(k, std::move(*value));
  }
  auto fill = [&](const std::vector<ParamSpec>& list, Params& out) {
    for (const auto& s : list) {
      if (out.has(s.key) || std::find(present.begin(), present.end(), s.key) != present.end())
        continue;
      if (s.flags & param_required) {
        errors.add({header, fmt::format("[{}] is missing required key '{}' ({}: {})", section,
                                        s.key, to_string(s.type), s.doc ? s.doc : "")});
      } else if (s.default_value) {
        try {
          out.set(s.key, parse_param_literal(s, s.default_value));
        } catch (const std::exception& e) {
          errors.add({header, fmt::format("[{}]: the plugin's {}", section, e.what())});
        }
      }
    }
  };
  fill(specs, params);
  fill(host_specs, host_params);
}

}  // namespace

Config Config::validate(const ConfigDocument& document, const PluginRegistry& registry,
                        bool plugin_checks) {
  const auto& impl = document.impl();
  const std::string& file = impl.source_name;
  Problems errors;
  Config config;
  config.source_name_ = file;
  config.base_dir_ = impl.base_dir;

  const std::vector<SectionSpec> specs = section_specs();
  std::vector<std::string> section_names;
  for (const auto& s : specs) section_names.push_back(s.name);

  for (auto&& [key, node] : impl.root) {
    std::string name(key.str());
    auto spec = std::find_if(specs.begin(), specs.end(),
                             [&](const SectionSpec& s) { return s.name == name; });
    if (spec == specs.end()) {
      if (!errors.wanted(position_of(file, key.source()))) continue;
      errors.add({position_of(file, key.source()),
                  fmt::format("unknown section [{}]{}; valid sections: {}", excerpt(name),
                              did_you_mean(name, section_names), join(section_names))});
      continue;
    }
    const toml::table* table = node.as_table();
    if (!table) {
      errors.add({position_of(file, node.source()),
                  fmt::format("'{}' must be a table ([{}]), got {} {}", excerpt(name),
                              excerpt(name), toml_type_name(node), show(node))});
      continue;
    }
    SourcePosition header = position_of(file, table->source());
    if (!spec->kind) {
      Params host, unused;
      validate_keys(*table, file, name, {}, spec->host_keys, {}, header, unused, host, errors);
      if (name == "plugins") check_plugins_section(*table, file, errors);
      config.host_[name] = std::move(host);
      continue;
    }
    PluginKind kind = *spec->kind;
    std::vector<std::string> ignored{spec->selector};
    std::optional<std::string> plugin;
    SourcePosition selector_at = header;
    if (const toml::node* sel = table->get(spec->selector)) {
      selector_at = position_of(file, sel->source());
      if (auto s = sel->value_exact<std::string>()) {
        plugin = *s;
      } else {
        errors.add({selector_at, fmt::format("[{}] {} must be a string naming the {} plugin, "
                                             "got {} {}",
                                             name, spec->selector, to_string(kind),
                                             toml_type_name(*sel), show(*sel))});
        continue;
      }
    }
    // A key that names the plugin in another tool's words (SelectorAlias).
    if (const toml::node* alias = spec->alias ? table->get(spec->alias->key) : nullptr) {
      ignored.push_back(spec->alias->key);
      const SourcePosition alias_at = position_of(file, alias->source());
      std::string text;
      if (auto f = alias->value_exact<double>())
        text = fmt::format("{}", *f);
      else if (auto i = alias->value_exact<std::int64_t>())
        text = fmt::format("{}", *i);
      else if (auto s = alias->value_exact<std::string>())
        text = *s;
      else {
        errors.add(
            {alias_at, fmt::format("[{}] {} must be {}, got {} {}", name, spec->alias->key,
                                   spec->alias->expected, toml_type_name(*alias), show(*alias))});
        continue;
      }
      try {
        std::string resolved = spec->alias->resolve(text, plugin);
        if (!plugin) selector_at = alias_at;
        plugin = std::move(resolved);
      } catch (const Error& e) {
        errors.add({alias_at, e.what()});
        continue;
      }
    }
    if (!plugin) {
      if (spec->default_plugin.empty()) {
        errors.add({header, fmt::format("[{}] must name its plugin with {} = \"...\"; "
                                        "available: {}",
                                        name, spec->selector, join(registry.names(kind)))});
        continue;
      }
      plugin = spec->default_plugin;
    }
    const PluginInfo* info = nullptr;
    try {
      info = &registry.find(kind, *plugin);
    } catch (const Error& e) {
      errors.add({selector_at, fmt::format("[{}] {} = \"{}\": {}", name, spec->selector,
                                           excerpt(*plugin), e.what())});
      continue;
    }
    PluginSection section;
    section.section = name;
    section.kind = kind;
    section.plugin = *plugin;
    section.where = header;
    const std::size_t errors_before = errors.count();
    validate_keys(*table, file, name, info->params, spec->host_keys, ignored, header,
                  section.params, section.host_params, errors);
    // The plugin's own checks need schema-valid parameters.
    if (plugin_checks && errors.count() == errors_before) {
      if (auto problem = check_plugin_params(*info, section.params)) {
        const toml::node* at = problem->key.empty() ? nullptr : table->get(problem->key);
        errors.add({at ? position_of(file, at->source()) : header, problem->message});
      }
    }
    config.sections_.push_back(std::move(section));
  }

  errors.throw_if_any();
  // Host sections that are absent still get their defaults.
  for (const auto& spec : specs) {
    if (spec.kind || config.host_.count(spec.name)) continue;
    Params host, unused;
    Problems ignored_errors;
    validate_keys(toml::table{}, file, spec.name, {}, spec.host_keys, {}, {file, 0, 0}, unused,
                  host, ignored_errors);
    config.host_[spec.name] = std::move(host);
  }
  return config;
}

const PluginSection* Config::section(PluginKind kind) const {
  for (const auto& s : sections_)
    if (s.kind == kind) return &s;
  return nullptr;
}

const Params* Config::host_section(std::string_view name) const {
  auto it = host_.find(name);
  return it == host_.end() ? nullptr : &it->second;
}

}  // namespace ductile::core
