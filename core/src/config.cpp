#include "ductile/core/config.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "config_internal.hpp"
#include "ductile/core/files.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/core/text.hpp"

namespace ductile::core {

namespace fs = std::filesystem;

std::string Diagnostic::format() const {
  if (where.line == 0) return fmt::format("{}: {}", where.file, message);
  return fmt::format("{}:{}:{}: {}", where.file, where.line, where.column, message);
}

namespace {

std::string join_diagnostics(const std::vector<Diagnostic>& diagnostics) {
  std::string out;
  for (std::size_t i = 0; i < diagnostics.size(); ++i) {
    if (i) out += '\n';
    out += diagnostics[i].format();
  }
  return out;
}

}  // namespace

ConfigError::ConfigError(std::vector<Diagnostic> diagnostics)
    : Error(ErrorKind::config, join_diagnostics(diagnostics)),
      diagnostics_(std::move(diagnostics)) {}

ConfigDocument::ConfigDocument() : impl_(std::make_unique<Impl>()) {}
ConfigDocument::ConfigDocument(ConfigDocument&&) noexcept = default;
ConfigDocument& ConfigDocument::operator=(ConfigDocument&&) noexcept = default;
ConfigDocument::~ConfigDocument() = default;

const std::string& ConfigDocument::source_name() const {
  return impl_->source_name;
}
const fs::path& ConfigDocument::base_dir() const {
  return impl_->base_dir;
}

SourcePosition position_of(const std::string& file, const toml::source_region& region) {
  return {file, region.begin.line, region.begin.column};
}

ConfigDocument ConfigDocument::from_file(const fs::path& file) {
  std::string text;
  try {
    text = read_user_file(file, "configuration file");
  } catch (const Error& e) {
    // read_user_file's message is "<file>: <problem>"; a ConfigError names
    // the file in its diagnostic instead.
    Diagnostic problem;
    problem.where.file = file.string();
    problem.message = std::string(e.what()).substr(file.string().size() + 2);
    throw ConfigError(std::vector<Diagnostic>{std::move(problem)});
  }
  std::error_code ec;
  fs::path base = file.has_parent_path() ? file.parent_path() : fs::path(".");
  return from_string(text, file.string(), fs::absolute(base, ec));
}

namespace {

// TOML++ bounds the nesting of values (256) but walks nested tables built from
// dotted keys and table headers recursively, both while parsing and when the
// tree is destroyed: `[a.a.a....]` 100,000 deep overflows the stack. So the
// text is scanned first (strings and comments skipped) for how deep any key
// lies: the brackets open around it, plus the dots of the key path in each.
// Numbers and times add at most one dot to a value, which only makes the
// estimate conservative.
void check_nesting(std::string_view text, const std::string& file) {
  std::vector<std::size_t> open;  // for each open [ or {: the depth outside it
  std::size_t dots = 0;           // dots of the current key path (or value)
  std::uint32_t line = 1, column = 0;
  auto fail = [&] {
    throw ConfigError({{{file, line, column},
                        fmt::format("tables, arrays and dotted keys nest deeper here than the "
                                    "limit of {} levels",
                                    kMaxConfigNesting)}});
  };
  auto depth = [&] { return (open.empty() ? 0 : open.back()) + dots; };
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    ++column;
    if (c == '\n') {
      ++line;
      column = 0;
      dots = 0;
      continue;
    }
    if (c == '#') {  // comment: to the end of the line
      while (i + 1 < text.size() && text[i + 1] != '\n') ++i;
      continue;
    }
    if (c == '"' || c == '\'') {
      const bool multi = text.substr(i, 3) == std::string_view(c == '"' ? "\"\"\"" : "\'\'\'");
      const std::string_view end = multi ? text.substr(i, 3) : text.substr(i, 1);
      i += end.size();
      while (i < text.size() && text.substr(i, end.size()) != end) {
        if (c == '"' && text[i] == '\\') ++i;  // escape: skip the next character
        if (i < text.size() && text[i] == '\n') ++line, column = 0;
        ++i;
      }
      i += end.size() - 1;
      continue;
    }
    switch (c) {
      case '.':
        ++dots;
        break;
      case '[':
      case '{':
        open.push_back(depth() + 1);
        dots = 0;
        break;
      case ']':
      case '}':
        if (!open.empty()) open.pop_back();
        dots = 0;
        break;
      case ',':  // the next key or element (a value keeps its key's dots)
        dots = 0;
        break;
      default:
        break;
    }
    if (depth() > kMaxConfigNesting) fail();
  }
}

}  // namespace

ConfigDocument ConfigDocument::from_string(std::string_view text, std::string_view source_name,
                                           const fs::path& base_dir) {
  ConfigDocument doc;
  doc.impl_->source_name = std::string(source_name);
  doc.impl_->base_dir = base_dir.empty() ? fs::current_path() : base_dir;
  check_nesting(text, doc.impl_->source_name);
  try {
    doc.impl_->root = toml::parse(text, std::string_view{doc.impl_->source_name});
  } catch (const toml::parse_error& e) {
    throw ConfigError({{position_of(doc.impl_->source_name, e.source()),
                        "invalid TOML: " + std::string(e.description())}});
  }
  return doc;
}

std::optional<std::string> ConfigDocument::log_level() const {
  if (auto level = impl_->root["log"]["level"].value<std::string>()) return level;
  return std::nullopt;
}

namespace {

const char* toml_type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table:
      return "table";
    case toml::node_type::array:
      return "array";
    case toml::node_type::string:
      return "string";
    case toml::node_type::integer:
      return "integer";
    case toml::node_type::floating_point:
      return "float";
    case toml::node_type::boolean:
      return "boolean";
    case toml::node_type::date:
      return "date";
    case toml::node_type::time:
      return "time";
    case toml::node_type::date_time:
      return "date-time";
    default:
      return "nothing";
  }
}

// A bounded rendering of a TOML value for messages. A string is cut (see
// excerpt()); a small array or table of plain values is written as TOML; a
// larger or nested one shows its first elements, or its key count, without
// walking what is nested, so a huge or deep value costs nothing.
std::string show(const toml::node& node) {
  auto formatted = [](const toml::node& n) {
    std::ostringstream out;
    n.visit([&](const auto& v) { out << toml::toml_formatter{v}; });
    return out.str();
  };
  auto nested = [](const toml::node& n) { return n.is_array() || n.is_table(); };
  auto flat_array = [&](const toml::array& array) {
    if (array.size() > 8) return false;
    for (const auto& element : array)
      if (nested(element)) return false;
    return true;
  };
  auto flat_table = [&](const toml::table& table) {
    if (table.size() > 8) return false;
    for (auto&& [key, value] : table)
      if (key.str().size() > 64 || nested(value)) return false;
    return true;
  };
  if (const auto* text = node.as_string())
    return formatted(toml::value<std::string>(excerpt(text->get())));
  if (const auto* table = node.as_table()) {
    if (flat_table(*table)) return excerpt(formatted(node), 80);
    return fmt::format("{{...}} (a table of {} keys)", table->size());
  }
  if (const auto* array = node.as_array()) {
    if (flat_array(*array)) return excerpt(formatted(node), 80);
    std::string out = "[ ";
    std::size_t shown = 0;
    for (const auto& element : *array) {
      if (shown == 4) {
        out += fmt::format("... ({} elements)", array->size());
        break;
      }
      if (shown) out += ", ";
      out += element.is_array() ? "[...]" : element.is_table() ? "{...}" : show(element);
      ++shown;
    }
    return out + " ]";
  }
  return excerpt(formatted(node), 80);
}

std::string bounds_text(const ParamSpec& spec) {
  bool has_min = spec.flags & param_has_min, has_max = spec.flags & param_has_max;
  bool integral = spec.type == ParamType::integer || spec.type == ParamType::integer_list;
  // A bound of an integer key prints as an integer when it is one; a plugin
  // may declare any double (the descriptor check refuses only NaN).
  auto num = [&](double v) {
    const double limit = std::ldexp(1.0, 63);
    if (integral && v >= -limit && v < limit && v == std::trunc(v))
      return fmt::format("{}", static_cast<long long>(v));
    return fmt::format("{}", v);
  };
  if (has_min && has_max)
    return fmt::format("between {} and {}", num(spec.min_value), num(spec.max_value));
  if (has_min) return fmt::format(">= {}", num(spec.min_value));
  if (has_max) return fmt::format("<= {}", num(spec.max_value));
  return "";
}

bool in_bounds(const ParamSpec& spec, double v) {
  if ((spec.flags & param_has_min) && v < spec.min_value) return false;
  if ((spec.flags & param_has_max) && v > spec.max_value) return false;
  return true;
}

bool in_bounds_int(const ParamSpec& spec, std::int64_t v) {
  // Bounds are doubles; compare exactly where the bound is representable.
  if ((spec.flags & param_has_min) && static_cast<long double>(v) < spec.min_value) return false;
  if ((spec.flags & param_has_max) && static_cast<long double>(v) > spec.max_value) return false;
  return true;
}

std::vector<std::string> allowed_list(const ParamSpec& spec) {
  std::vector<std::string> out;
  if (spec.allowed_values)
    for (auto p = spec.allowed_values; *p; ++p) out.emplace_back(*p);
  return out;
}

}  // namespace

// Converts one TOML node to a parameter value, or returns an error message
// (without position). `what` names the key, e.g. "[elasticity] min_gpus".
std::optional<ParamValue> convert_node(const toml::node& node, const ParamSpec& spec,
                                       const std::string& what, std::string& error) {
  auto type_error = [&]() {
    std::string type = to_string(spec.type);
    bool vowel = std::string_view("aeiou").find(type[0]) != std::string_view::npos;
    error = fmt::format("{} must be {}{}, got {} {}", what, vowel ? "an " : "a ", type,
                        toml_type_name(node), show(node));
    return std::nullopt;
  };
  auto range_error = [&](const std::string& value) {
    error = fmt::format("{} = {} is out of range: must be {}", what, value, bounds_text(spec));
    return std::nullopt;
  };
  switch (spec.type) {
    case ParamType::boolean:
      if (auto v = node.value_exact<bool>()) return ParamValue(*v);
      return type_error();
    case ParamType::integer: {
      auto v = node.value_exact<std::int64_t>();
      if (!v) return type_error();
      if (!in_bounds_int(spec, *v)) return range_error(std::to_string(*v));
      return ParamValue(*v);
    }
    case ParamType::floating: {
      double d;
      if (auto f = node.value_exact<double>())
        d = *f;
      else if (auto i = node.value_exact<std::int64_t>())
        d = static_cast<double>(*i);
      else
        return type_error();
      if (std::isnan(d) || !in_bounds(spec, d)) return range_error(show(node));
      return ParamValue(d);
    }
    case ParamType::string: {
      auto v = node.value_exact<std::string>();
      if (!v) return type_error();
      auto allowed = allowed_list(spec);
      if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), *v) == allowed.end()) {
        error = fmt::format("{} = \"{}\" is not allowed{}; valid values: {}", what, excerpt(*v),
                            did_you_mean(*v, allowed), join(allowed));
        return std::nullopt;
      }
      return ParamValue(*v);
    }
    case ParamType::integer_list:
    case ParamType::float_list:
    case ParamType::string_list: {
      const auto* array = node.as_array();
      if (!array) return type_error();
      std::vector<std::int64_t> ints;
      std::vector<double> floats;
      std::vector<std::string> strings;
      std::size_t index = 0;
      for (const auto& element : *array) {
        std::string at = fmt::format("{}[{}]", what, index++);
        if (spec.type == ParamType::integer_list) {
          auto v = element.value_exact<std::int64_t>();
          if (!v) {
            error = fmt::format("{} must be an integer, got {} {}", at, toml_type_name(element),
                                show(element));
            return std::nullopt;
          }
          if (!in_bounds_int(spec, *v)) {
            error = fmt::format("{} = {} is out of range: must be {}", at, *v, bounds_text(spec));
            return std::nullopt;
          }
          ints.push_back(*v);
        } else if (spec.type == ParamType::float_list) {
          double d;
          if (auto f = element.value_exact<double>())
            d = *f;
          else if (auto i = element.value_exact<std::int64_t>())
            d = static_cast<double>(*i);
          else {
            error = fmt::format("{} must be a number, got {} {}", at, toml_type_name(element),
                                show(element));
            return std::nullopt;
          }
          if (std::isnan(d) || !in_bounds(spec, d)) {
            error = fmt::format("{} = {} is out of range: must be {}", at, show(element),
                                bounds_text(spec));
            return std::nullopt;
          }
          floats.push_back(d);
        } else {
          auto v = element.value_exact<std::string>();
          if (!v) {
            error = fmt::format("{} must be a string, got {} {}", at, toml_type_name(element),
                                show(element));
            return std::nullopt;
          }
          auto allowed = allowed_list(spec);
          if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), *v) == allowed.end()) {
            error = fmt::format("{} = \"{}\" is not allowed{}; valid values: {}", at, excerpt(*v),
                                did_you_mean(*v, allowed), join(allowed));
            return std::nullopt;
          }
          strings.push_back(*v);
        }
      }
      if (spec.type == ParamType::integer_list) return ParamValue(std::move(ints));
      if (spec.type == ParamType::float_list) return ParamValue(std::move(floats));
      return ParamValue(std::move(strings));
    }
  }
  return type_error();
}

ParamValue parse_param_literal(const ParamSpec& spec, std::string_view literal) {
  std::string text = "v = " + std::string(literal);
  toml::table table;
  try {
    table = toml::parse(text, std::string_view{"<default>"});
  } catch (const toml::parse_error& e) {
    throw Error(ErrorKind::config, fmt::format("default of '{}' is not a TOML value: {} ({})",
                                               spec.key, literal, e.description()));
  }
  const toml::node* node = table.get("v");
  std::string error;
  auto value = node ? convert_node(*node, spec, spec.key, error) : std::nullopt;
  if (!value) throw Error(ErrorKind::config, fmt::format("default of '{}': {}", spec.key, error));
  return *value;
}

namespace {

struct ValueFormatter {
  std::string operator()(bool b) const { return b ? "true" : "false"; }
  std::string operator()(std::int64_t i) const { return std::to_string(i); }
  std::string operator()(double d) const {
    std::string s = fmt::format("{}", d);
    if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
    return s;
  }
  std::string operator()(const std::string& s) const {
    std::string out = "\"";
    for (char c : s) {
      switch (c) {
        case '"':
          out += "\\\"";
          break;
        case '\\':
          out += "\\\\";
          break;
        case '\n':
          out += "\\n";
          break;
        case '\t':
          out += "\\t";
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20)
            out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
          else
            out += c;
      }
    }
    return out + "\"";
  }
  template <class T>
  std::string operator()(const std::vector<T>& list) const {
    std::string out = "[";
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (i) out += ", ";
      out += (*this)(list[i]);
    }
    return out + "]";
  }
};

}  // namespace

std::string format_param_value(const ParamValue& value) {
  return std::visit(ValueFormatter{}, value);
}

void validate_keys(const toml::table& table, const std::string& file, const std::string& section,
                   const std::vector<ParamSpec>& specs, const std::vector<ParamSpec>& host_specs,
                   const std::vector<std::string>& ignored_keys, const SourcePosition& header,
                   Params& params, Params& host_params, std::vector<Diagnostic>& errors) {
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
      errors.push_back({position_of(file, key.source()),
                        fmt::format("unknown key '{}' in [{}]{}; valid keys: {}", excerpt(k),
                                    section, did_you_mean(k, known), join(known))});
      continue;
    }
    std::string error;
    auto value = convert_node(node, *spec, fmt::format("[{}] {}", section, k), error);
    if (!value) {
      errors.push_back({position_of(file, node.source()), error});
      continue;
    }
    (host ? host_params : params).set(k, std::move(*value));
  }
  auto fill = [&](const std::vector<ParamSpec>& list, Params& out) {
    for (const auto& s : list) {
      if (out.has(s.key) || std::find(present.begin(), present.end(), s.key) != present.end())
        continue;
      if (s.flags & param_required) {
        errors.push_back({header, fmt::format("[{}] is missing required key '{}' ({}: {})", section,
                                              s.key, to_string(s.type), s.doc ? s.doc : "")});
      } else if (s.default_value) {
        try {
          out.set(s.key, parse_param_literal(s, s.default_value));
        } catch (const std::exception& e) {
          errors.push_back({header, fmt::format("[{}]: the plugin's {}", section, e.what())});
        }
      }
    }
  };
  fill(specs, params);
  fill(host_specs, host_params);
}

std::string elasticity_policy_for_version(std::string_view version) {
  // Appended rather than "v" + std::string(version): GCC 12 at -O3 warns of
  // overlapping memcpy (-Wrestrict) in that operator+, falsely.
  std::string policy = "v";
  policy += version;
  return policy;
}

Config Config::validate(const ConfigDocument& document, const PluginRegistry& registry,
                        bool plugin_checks) {
  const auto& impl = document.impl();
  const std::string& file = impl.source_name;
  std::vector<Diagnostic> errors;
  Config config;
  config.source_name_ = file;
  config.base_dir_ = impl.base_dir;

  std::vector<std::string> section_names;
  for (const auto& s : section_specs()) section_names.push_back(s.name);

  for (auto&& [key, node] : impl.root) {
    std::string name(key.str());
    const SectionSpec* spec = find_section_spec(name);
    if (!spec) {
      errors.push_back({position_of(file, key.source()),
                        fmt::format("unknown section [{}]{}; valid sections: {}", excerpt(name),
                                    did_you_mean(name, section_names), join(section_names))});
      continue;
    }
    const toml::table* table = node.as_table();
    if (!table) {
      errors.push_back({position_of(file, node.source()),
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
        errors.push_back({selector_at, fmt::format("[{}] {} must be a string naming the {} plugin, "
                                                   "got {} {}",
                                                   name, spec->selector, to_string(kind),
                                                   toml_type_name(*sel), show(*sel))});
        continue;
      }
    }
    // DeepSpeed names the elasticity algorithm by `version = 0.1`.
    if (kind == PluginKind::elasticity) {
      if (const toml::node* version = table->get("version")) {
        ignored.push_back("version");
        std::string text;
        if (auto f = version->value_exact<double>())
          text = fmt::format("{}", *f);
        else if (auto i = version->value_exact<std::int64_t>())
          text = fmt::format("{}", *i);
        else if (auto s = version->value_exact<std::string>())
          text = *s;
        else {
          errors.push_back({position_of(file, version->source()),
                            fmt::format("[elasticity] version must be a number such as 0.1 or "
                                        "0.2, got {} {}",
                                        toml_type_name(*version), show(*version))});
          continue;
        }
        std::string from_version = elasticity_policy_for_version(text);
        if (!plugin) {
          plugin = from_version;
          selector_at = position_of(file, version->source());
        } else if (*plugin != from_version && plugin->starts_with("v")) {
          errors.push_back({position_of(file, version->source()),
                            fmt::format("[elasticity] version = {} contradicts policy = \"{}\"; "
                                        "give one of them",
                                        excerpt(text), excerpt(*plugin))});
          continue;
        }
      }
    }
    if (!plugin) {
      if (spec->default_plugin.empty()) {
        errors.push_back({header, fmt::format("[{}] must name its plugin with {} = \"...\"; "
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
      errors.push_back({selector_at, fmt::format("[{}] {} = \"{}\": {}", name, spec->selector,
                                                 excerpt(*plugin), e.what())});
      continue;
    }
    PluginSection section;
    section.section = name;
    section.kind = kind;
    section.plugin = *plugin;
    section.where = header;
    const std::size_t errors_before = errors.size();
    validate_keys(*table, file, name, info->params, spec->host_keys, ignored, header,
                  section.params, section.host_params, errors);
    // The plugin's own checks need schema-valid parameters.
    if (plugin_checks && errors.size() == errors_before) {
      if (auto problem = check_plugin_params(*info, section.params)) {
        const toml::node* at = problem->key.empty() ? nullptr : table->get(problem->key);
        errors.push_back({at ? position_of(file, at->source()) : header, problem->message});
      }
    }
    config.sections_.push_back(std::move(section));
  }

  if (!errors.empty()) {
    std::stable_sort(errors.begin(), errors.end(), [](const Diagnostic& a, const Diagnostic& b) {
      return std::tie(a.where.line, a.where.column) < std::tie(b.where.line, b.where.column);
    });
    throw ConfigError(std::move(errors));
  }
  // Host sections that are absent still get their defaults.
  for (const auto& spec : section_specs()) {
    if (spec.kind || config.host_.count(spec.name)) continue;
    Params host, unused;
    std::vector<Diagnostic> ignored_errors;
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
