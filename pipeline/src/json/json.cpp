// See ductile/pipeline/json.hpp.
#include "ductile/pipeline/json.hpp"

#include <cctype>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace ductile::pipeline {

using nlohmann::json;

std::size_t json_depth_exceeded_at(std::string_view text, std::size_t limit) {
  std::size_t depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;  // the escaped character cannot end the string
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return i;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return std::string_view::npos;
}

json parse_bounded_json(std::string_view text, std::string_view source, std::string_view what,
                        ErrorKind kind, const std::string& type) {
  if (const auto at = json_depth_exceeded_at(text, kMaxJsonDepth); at != std::string_view::npos)
    throw Error(kind,
                fmt::format("{}: JSON nested deeper than {} levels (at byte {}); ductile accepts "
                            "at most {}",
                            source, kMaxJsonDepth, at, kMaxJsonDepth),
                type);
  // nlohmann keeps the last of duplicate keys; a config that says a key
  // twice is refused instead, naming it, so no value is dropped unseen.
  std::vector<std::set<std::string>> open_objects;
  std::optional<std::string> duplicate;
  const json::parser_callback_t check_keys = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      open_objects.pop_back();
    } else if (event == json::parse_event_t::key && !duplicate &&
               !open_objects.back().insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json root;
  try {
    root = json::parse(text.begin(), text.end(), check_keys);
  } catch (const json::exception& e) {
    // Syntax errors, and numbers too large for a double (out_of_range),
    // whose message quotes the whole number: cut like any excerpt.
    std::string message = e.what();
    if (message.size() > 2 * kExcerptChars + 100) {
      message.resize(2 * kExcerptChars + 100);
      message += "...";
    }
    throw Error(kind, fmt::format("{}: {}: {}", source, what, message), type);
  }
  if (duplicate)
    throw Error(kind,
                fmt::format("{}: key {} appears twice in one object; each key may be given once",
                            source, json_excerpt(json(*duplicate))),
                type);
  return root;
}

namespace {

// Appends `value` to `out` until `out` holds more than `limit` characters.
void append_excerpt(const json& value, std::string& out, std::size_t limit) {
  if (out.size() > limit) return;
  if (value.is_array()) {
    out += '[';
    bool first = true;
    for (const auto& element : value) {
      if (out.size() > limit) return;
      if (!first) out += ',';
      first = false;
      append_excerpt(element, out, limit);
    }
    out += ']';
  } else if (value.is_object()) {
    out += '{';
    bool first = true;
    for (auto it = value.begin(); it != value.end(); ++it) {
      if (out.size() > limit) return;
      if (!first) out += ',';
      first = false;
      append_excerpt(json(it.key()), out, limit);
      out += ':';
      append_excerpt(it.value(), out, limit);
    }
    out += '}';
  } else if (value.is_string()) {
    // A long string is cut before it is escaped whole.
    const auto& s = value.get_ref<const std::string&>();
    const std::size_t room = limit + 1 - std::min(limit + 1, out.size());
    out += json(s.substr(0, room + 1)).dump(-1, ' ', false, json::error_handler_t::replace);
  } else {
    out += value.dump(-1, ' ', false, json::error_handler_t::replace);
  }
}

}  // namespace

std::string json_excerpt(const json& value) {
  std::string out;
  append_excerpt(value, out, kExcerptChars);
  if (out.size() > kExcerptChars) {
    out.resize(kExcerptChars);
    out += "...";
  }
  return out;
}

std::optional<ParamValue> json_to_param(const json& v, ParamType type) {
  auto integer = [](const json& x) -> std::optional<std::int64_t> {
    if (x.is_number_integer()) {
      if (x.is_number_unsigned() &&
          x.get<std::uint64_t>() >
              static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        return std::nullopt;
      return x.get<std::int64_t>();
    }
    if (x.is_number_float()) {
      const double d = x.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.2e18)
        return static_cast<std::int64_t>(d);
    }
    return std::nullopt;
  };
  switch (type) {
    case ParamType::boolean:
      if (v.is_boolean()) return ParamValue(v.get<bool>());
      return std::nullopt;
    case ParamType::integer:
      if (auto i = integer(v)) return ParamValue(*i);
      return std::nullopt;
    case ParamType::floating:
      if (v.is_number()) return ParamValue(v.get<double>());
      return std::nullopt;
    case ParamType::string:
      if (v.is_string()) return ParamValue(v.get<std::string>());
      return std::nullopt;
    case ParamType::integer_list: {
      if (!v.is_array()) return std::nullopt;
      std::vector<std::int64_t> list;
      for (const auto& e : v) {
        // Integers only: 2.0 and true are not list elements.
        if (!e.is_number_integer() || !integer(e)) return std::nullopt;
        list.push_back(*integer(e));
      }
      return ParamValue(std::move(list));
    }
    case ParamType::float_list: {
      if (!v.is_array()) return std::nullopt;
      std::vector<double> list;
      for (const auto& e : v) {
        if (!e.is_number()) return std::nullopt;
        list.push_back(e.get<double>());
      }
      return ParamValue(std::move(list));
    }
    case ParamType::string_list: {
      if (!v.is_array()) return std::nullopt;
      std::vector<std::string> list;
      for (const auto& e : v) {
        if (!e.is_string()) return std::nullopt;
        list.push_back(e.get<std::string>());
      }
      return ParamValue(std::move(list));
    }
  }
  return std::nullopt;
}

const char* param_type_expectation(ParamType type) {
  switch (type) {
    case ParamType::boolean:
      return "true or false";
    case ParamType::integer:
      return "an integer";
    case ParamType::floating:
      return "a number";
    case ParamType::string:
      return "a string";
    case ParamType::integer_list:
      return "a list of integers";
    case ParamType::float_list:
      return "a list of numbers";
    case ParamType::string_list:
      return "a list of strings";
  }
  return "a value";
}

bool is_json_config(const std::filesystem::path& file, std::string_view content) {
  std::string ext = file.extension().string();
  for (auto& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (ext == ".json") return true;
  if (ext == ".toml") return false;
  // A UTF-8 byte order mark before the text, as the JSON parser skips it.
  if (content.starts_with("\xEF\xBB\xBF")) content.remove_prefix(3);
  for (char c : content) {
    if (std::isspace(static_cast<unsigned char>(c))) continue;
    return c == '{';
  }
  return false;
}

}  // namespace ductile::pipeline
