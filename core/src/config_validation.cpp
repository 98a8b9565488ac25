// Config::validate: each section of a parsed document checked against its
// section spec (sections.cpp) and the schema of the plugin it selects, every
// problem collected with its position before anything is created.
#include <algorithm>
#include <iterator>
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

void sort_by_position(std::vector<Diagnostic>& list) {
  std::stable_sort(list.begin(), list.end(), [](const Diagnostic& a, const Diagnostic& b) {
    return before(a.where, b.where);
  });
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
  sort_by_position(list_);
  dropped_ += list_.size() - kMaxConfigDiagnostics;
  list_.resize(kMaxConfigDiagnostics);
  full_ = true;
  last_ = list_.back().where;
}

void Problems::throw_if_any() {
  if (list_.empty()) return;
  sort_by_position(list_);
  throw ConfigError(std::move(list_), dropped_);
}

namespace {

// One key of a section as read: a TOML node, or a value that another front
// end converted already (ConfigEntry). `shown` is how messages name it.
struct KeyInput {
  std::string key;
  std::string shown;
  SourcePosition key_at, value_at;
  const toml::node* node = nullptr;
  const ParamValue* value = nullptr;

  // The one check against the schema (TOML values are converted first).
  std::optional<ParamValue> convert(const ParamSpec& spec, std::string& error) const {
    if (node) return convert_node(*node, spec, shown, error);
    return check_param_value(spec, *value, shown, error);
  }
  const std::string* string() const {
    if (node) return node->as_string() ? &node->as_string()->get() : nullptr;
    return std::get_if<std::string>(value);
  }
  // A number as written, or a string: what a SelectorAlias reads.
  std::optional<std::string> text() const {
    if (const std::string* s = string()) return *s;
    if (node) {
      if (auto f = node->value_exact<double>()) return fmt::format("{}", *f);
      if (auto i = node->value_exact<std::int64_t>()) return fmt::format("{}", *i);
      return std::nullopt;
    }
    if (const auto* f = std::get_if<double>(value)) return fmt::format("{}", *f);
    if (const auto* i = std::get_if<std::int64_t>(value)) return fmt::format("{}", *i);
    return std::nullopt;
  }
  // "integer 3" (TOML's type and value), for messages about a wrong type.
  std::string described() const {
    if (node) return fmt::format("{} {}", toml_type_name(*node), show(*node));
    return format_param_value(*value);
  }
};

struct SectionInput {
  std::string name;
  SourcePosition header;
  std::vector<KeyInput> keys;
  const toml::table* table = nullptr;  // for [plugins]' own checks

  const KeyInput* find(std::string_view key) const {
    for (const auto& k : keys)
      if (k.key == key) return &k;
    return nullptr;
  }
};

SectionInput toml_section(const std::string& file, const std::string& name,
                          const toml::table& table) {
  SectionInput in{name, position_of(file, table.source()), {}, &table};
  for (auto&& [key, node] : table) {
    std::string k(key.str());
    std::string shown = fmt::format("[{}] {}", name, k);
    in.keys.push_back({std::move(k), std::move(shown), position_of(file, key.source()),
                       position_of(file, node.source()), &node, nullptr});
  }
  return in;
}

// The keys of one section: each must be the plugin's or a host key (or an
// ignored selector); values are converted and checked, missing ones get
// their defaults.
void validate_keys(const SectionInput& in, const std::vector<ParamSpec>& specs,
                   const std::vector<ParamSpec>& host_specs,
                   const std::vector<std::string>& ignored_keys, Params& params,
                   Params& host_params, Problems& errors) {
  const std::string& section = in.name;
  std::vector<std::string> known;
  for (const auto& s : specs) known.emplace_back(s.key);
  for (const auto& s : host_specs) known.emplace_back(s.key);
  for (const auto& input : in.keys) {
    const std::string& k = input.key;
    if (std::find(ignored_keys.begin(), ignored_keys.end(), k) != ignored_keys.end()) continue;
    const ParamSpec* spec = nullptr;
    bool host = false;
    for (const auto& s : specs)
      if (k == s.key) spec = &s;
    if (!spec)
      for (const auto& s : host_specs)
        if (k == s.key) spec = &s, host = true;
    if (!spec) {
      if (!errors.wanted(input.key_at)) continue;
      errors.add({input.key_at, fmt::format("unknown key '{}' in [{}]{}; valid keys: {}",
                                            excerpt(input.node ? k : input.shown), section,
                                            did_you_mean(k, known), join(known))});
      continue;
    }
    std::string error;
    auto value = input.convert(*spec, error);
    if (!value) {
      errors.add({input.value_at, error});
      continue;
    }
    (host ? host_params : params).set(k, std::move(*value));
  }
  auto fill = [&](const std::vector<ParamSpec>& list, Params& out) {
    for (const auto& s : list) {
      if (out.has(s.key) || in.find(s.key)) continue;
      if (s.flags & param_required) {
        errors.add({in.header, fmt::format("[{}] is missing required key '{}' ({}: {})", section,
                                           s.key, to_string(s.type), s.doc ? s.doc : "")});
      } else if (s.default_value) {
        try {
          out.set(s.key, parse_param_literal(s, s.default_value));
        } catch (const std::exception& e) {
          errors.add({in.header, fmt::format("[{}]: the plugin's {}", section, e.what())});
        }
      }
    }
  };
  fill(specs, params);
  fill(host_specs, host_params);
}

// The sections of a document as read, in file (or entry) order; a section
// that is not a table, or not known, is reported and left out.
std::vector<SectionInput> read_sections(const ConfigDocument::Impl& impl,
                                        const std::vector<std::string>& section_names,
                                        Problems& errors) {
  const std::string& file = impl.source_name;
  std::vector<SectionInput> out;
  auto known = [&](const std::string& name, const SourcePosition& at) {
    if (std::find(section_names.begin(), section_names.end(), name) != section_names.end())
      return true;
    if (errors.wanted(at))
      errors.add({at, fmt::format("unknown section [{}]{}; valid sections: {}", excerpt(name),
                                  did_you_mean(name, section_names), join(section_names))});
    return false;
  };
  for (auto&& [key, node] : impl.root) {
    std::string name(key.str());
    if (!known(name, position_of(file, key.source()))) continue;
    const toml::table* table = node.as_table();
    if (!table) {
      errors.add({position_of(file, node.source()),
                  fmt::format("'{}' must be a table ([{}]), got {} {}", excerpt(name),
                              excerpt(name), toml_type_name(node), show(node))});
      continue;
    }
    out.push_back(toml_section(file, name, *table));
  }
  const SourcePosition nowhere{file, 0, 0};
  for (const auto& entry : impl.entries) {
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const SectionInput& s) { return s.name == entry.section; });
    if (it == out.end()) {
      if (!known(entry.section, nowhere)) continue;
      out.push_back({entry.section, nowhere, {}, nullptr});
      it = std::prev(out.end());
    }
    it->keys.push_back({entry.key, entry.user_key, nowhere, nowhere, nullptr, &entry.value});
  }
  return out;
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

  for (const SectionInput& in : read_sections(impl, section_names, errors)) {
    const std::string& name = in.name;
    auto spec = std::find_if(specs.begin(), specs.end(),
                             [&](const SectionSpec& s) { return s.name == name; });
    const SourcePosition& header = in.header;
    if (!spec->kind) {
      Params host, unused;
      validate_keys(in, {}, spec->host_keys, {}, unused, host, errors);
      if (name == "plugins" && in.table) check_plugins_section(*in.table, file, errors);
      config.host_[name] = std::move(host);
      continue;
    }
    PluginKind kind = *spec->kind;
    std::vector<std::string> ignored{spec->selector};
    std::optional<std::string> plugin;
    SourcePosition selector_at = header;
    if (const KeyInput* sel = in.find(spec->selector)) {
      selector_at = sel->value_at;
      if (const std::string* s = sel->string()) {
        plugin = *s;
      } else {
        errors.add({selector_at, fmt::format("{} must be a string naming the {} plugin, got {}",
                                             sel->shown, to_string(kind), sel->described())});
        continue;
      }
    }
    // A key that names the plugin in another tool's words (SelectorAlias).
    if (const KeyInput* alias = spec->alias ? in.find(spec->alias->key) : nullptr) {
      ignored.push_back(spec->alias->key);
      const SourcePosition alias_at = alias->value_at;
      const std::optional<std::string> text = alias->text();
      if (!text) {
        errors.add({alias_at, fmt::format("{} must be {}, got {}", alias->shown,
                                          spec->alias->expected, alias->described())});
        continue;
      }
      try {
        std::string resolved = spec->alias->resolve(*text, plugin);
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
      const KeyInput* sel = in.find(spec->selector);
      const std::string shown = sel ? sel->shown : fmt::format("[{}] {}", name, spec->selector);
      errors.add({selector_at, fmt::format("{} = \"{}\": {}", shown, excerpt(*plugin), e.what())});
      continue;
    }
    PluginSection section;
    section.section = name;
    section.kind = kind;
    section.plugin = *plugin;
    section.where = header;
    const std::size_t errors_before = errors.count();
    validate_keys(in, info->params, spec->host_keys, ignored, section.params, section.host_params,
                  errors);
    // The plugin's own checks need schema-valid parameters.
    if (plugin_checks && errors.count() == errors_before) {
      if (auto problem = check_plugin_params(*info, section.params)) {
        const KeyInput* at = problem->key.empty() ? nullptr : in.find(problem->key);
        std::string message = problem->message;
        // A key the user wrote under another name (a DeepSpeed key mapped
        // onto this section): the plugin names its own "[section] key",
        // which the user never wrote, so the user's key takes its place;
        // a message that does not name it is prefixed with the user's key.
        if (at && !at->node) {
          const std::string own = fmt::format("[{}] {}", name, problem->key);
          if (const auto pos = message.find(own); pos != std::string::npos)
            message.replace(pos, own.size(), at->shown);
          else
            message = fmt::format("{}: {}", at->shown, message);
        }
        errors.add({at ? at->value_at : header, std::move(message)});
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
    validate_keys(SectionInput{spec.name, {file, 0, 0}, {}, nullptr}, {}, spec.host_keys, {},
                  unused, host, ignored_errors);
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
