// Configuration documents: a file or string read and parsed as TOML, after a
// scan that refuses nesting deep enough to overflow TOML++'s recursion, plus
// the diagnostics every configuration error is reported as.
#include <algorithm>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "config_internal.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/files.hpp"
#include "ductile/core/text.hpp"

namespace ductile::core {

namespace fs = std::filesystem;

std::string Diagnostic::format() const {
  if (where.line == 0) return printable(fmt::format("{}: {}", where.file, message), false);
  return printable(fmt::format("{}:{}:{}: {}", where.file, where.line, where.column, message),
                   false);
}

namespace {

// The first kMaxConfigDiagnostics, one a line, then how many more there are.
std::string join_diagnostics(const std::vector<Diagnostic>& diagnostics, std::size_t more) {
  std::string out;
  const std::size_t shown = std::min(diagnostics.size(), kMaxConfigDiagnostics);
  for (std::size_t i = 0; i < shown; ++i) {
    if (i) out += '\n';
    out += diagnostics[i].format();
  }
  more += diagnostics.size() - shown;
  if (more > 0) out += fmt::format("\n... and {} more", more);
  return out;
}

}  // namespace

ConfigError::ConfigError(std::vector<Diagnostic> diagnostics, std::size_t more)
    : Error(ErrorKind::config, join_diagnostics(diagnostics, more)),
      diagnostics_(std::move(diagnostics)),
      more_(more) {
  if (diagnostics_.size() > kMaxConfigDiagnostics) {
    more_ += diagnostics_.size() - kMaxConfigDiagnostics;
    diagnostics_.resize(kMaxConfigDiagnostics);
  }
}

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
  return from_file_text(file, text);
}

ConfigDocument ConfigDocument::from_file_text(const fs::path& file, std::string_view text) {
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

// Line `line` (1-based) of `text`, without its '\n'; empty past the end.
std::string_view line_of(std::string_view text, std::size_t line) {
  std::size_t start = 0;
  for (std::size_t n = 1; n < line; ++n) {
    start = text.find('\n', start);
    if (start == std::string_view::npos) return {};
    ++start;
  }
  return text.substr(start, text.find('\n', start) - start);
}

// The key a line assigns (the text before its '='), or "" when the line
// has none (an element of an array written over several lines).
std::string_view key_of(std::string_view row) {
  const std::size_t equals = row.find('=');
  if (equals == std::string_view::npos) return {};
  row = row.substr(0, equals);
  while (!row.empty() && (row.front() == ' ' || row.front() == '\t')) row.remove_prefix(1);
  while (!row.empty() && (row.back() == ' ' || row.back() == '\t')) row.remove_suffix(1);
  return row;
}

// TOML++'s description of a parse error. An integer outside 64 bits is
// otherwise reported as "not representable in 64 bits" without its key, its
// sign nor what is valid; it is said here in the terms of every other range
// error.
std::string toml_problem(std::string_view text, std::size_t line, std::string_view description) {
  constexpr std::string_view kTooWide = "' is not representable in 64 bits";
  const std::size_t tail = description.find(kTooWide);
  const std::size_t open =
      tail == std::string_view::npos || tail == 0 ? tail : description.rfind('\'', tail - 1);
  if (open == std::string_view::npos) return "invalid TOML: " + std::string(description);
  const std::string_view digits = description.substr(open + 1, tail - open - 1);
  const std::string_view row = line_of(text, line);
  // TOML++ quotes the digits without their sign: the line has it.
  const std::size_t at = row.find(digits);
  const bool negative = at != std::string_view::npos && at > 0 && row[at - 1] == '-';
  const std::string_view key = key_of(row);
  return fmt::format(
      "{}{}{} is past the {} integer ({}): integers in a configuration are 64-bit, from "
      "-9223372036854775808 (-2^63) to 9223372036854775807 (2^63-1)",
      key.empty() ? std::string() : fmt::format("{} = ", excerpt(key)), negative ? "-" : "",
      excerpt(digits), negative ? "smallest" : "largest", negative ? "-2^63" : "2^63-1");
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
                        toml_problem(text, e.source().begin.line, e.description())}});
  }
  return doc;
}

ConfigDocument ConfigDocument::from_entries(std::vector<ConfigEntry> entries,
                                            std::string_view source_name,
                                            const fs::path& base_dir) {
  ConfigDocument doc;
  doc.impl_->source_name = std::string(source_name);
  doc.impl_->base_dir = base_dir.empty() ? fs::current_path() : base_dir;
  doc.impl_->entries = std::move(entries);
  return doc;
}

ConfigDocument ConfigDocument::section_document(std::string_view name, bool top_level_keys,
                                                std::optional<ConfigEntry> unnamed) const {
  ConfigDocument doc;
  doc.impl_->source_name = impl_->source_name;
  doc.impl_->base_dir = impl_->base_dir;
  if (const toml::node* section = impl_->root.get(name)) {
    doc.impl_->root.insert(name, *section);
  } else if (top_level_keys) {
    toml::table keys;
    for (auto&& [key, node] : impl_->root)
      if (!node.is_table()) keys.insert(key, node);
    doc.impl_->root.insert(name, std::move(keys));
  }
  if (unnamed) {
    const auto spec = find_section_spec(name);
    const toml::table* table = doc.impl_->root.get_as<toml::table>(name);
    auto has = [&](const std::string& key) {
      return table && !key.empty() && table->contains(key);
    };
    if (spec && !has(spec->selector) && !(spec->alias && has(spec->alias->key)))
      doc.impl_->entries.push_back(std::move(*unnamed));
  }
  return doc;
}

std::optional<std::string> ConfigDocument::log_level() const {
  if (auto level = impl_->root["log"]["level"].value<std::string>()) return level;
  return std::nullopt;
}

}  // namespace ductile::core
