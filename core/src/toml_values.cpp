// The TOML edge of a parameter value: a TOML node converted to the type its
// ParamSpec declares (a node of another type is refused here, in TOML's
// words), then checked once by check_param_value (param_values.cpp).
#include <charconv>
#include <cmath>
#include <sstream>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "config_internal.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/text.hpp"

namespace ductile::core {

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

// Converts one TOML node to a parameter value, or returns an error message
// (without position). `what` names the key, e.g. "[elasticity] min_gpus".
std::optional<ParamValue> convert_node(const toml::node& node, const ParamSpec& spec,
                                       const std::string& what, std::string& error) {
  auto type_error = [&](const std::string& at, const toml::node& n, std::string_view type) {
    bool vowel = std::string_view("aeiou").find(type[0]) != std::string_view::npos;
    error = fmt::format("{} must be {}{}, got {} {}", at, vowel ? "an " : "a ", type,
                        toml_type_name(n), show(n));
    return std::nullopt;
  };
  std::optional<ParamValue> value;
  switch (spec.type) {
    case ParamType::boolean:
      if (auto v = node.value_exact<bool>()) value = *v;
      break;
    case ParamType::integer:
      if (auto v = node.value_exact<std::int64_t>()) value = *v;
      break;
    case ParamType::floating:
      // An integer stays one here so that a message shows it as written.
      if (auto f = node.value_exact<double>())
        value = *f;
      else if (auto i = node.value_exact<std::int64_t>())
        value = *i;
      break;
    case ParamType::string:
      if (auto v = node.value_exact<std::string>()) value = *v;
      break;
    case ParamType::integer_list:
    case ParamType::float_list:
    case ParamType::string_list: {
      const auto* array = node.as_array();
      if (!array) break;
      std::vector<std::int64_t> ints;
      std::vector<double> floats;
      std::vector<std::string> strings;
      std::size_t index = 0;
      for (const auto& element : *array) {
        std::string at = fmt::format("{}[{}]", what, index++);
        if (spec.type == ParamType::integer_list) {
          auto v = element.value_exact<std::int64_t>();
          if (!v) return type_error(at, element, "integer");
          ints.push_back(*v);
        } else if (spec.type == ParamType::float_list) {
          if (auto f = element.value_exact<double>())
            floats.push_back(*f);
          else if (auto i = element.value_exact<std::int64_t>())
            floats.push_back(static_cast<double>(*i));
          else
            return type_error(at, element, "number");
        } else {
          auto v = element.value_exact<std::string>();
          if (!v) return type_error(at, element, "string");
          strings.push_back(std::move(*v));
        }
      }
      if (spec.type == ParamType::integer_list)
        value = std::move(ints);
      else if (spec.type == ParamType::float_list)
        value = std::move(floats);
      else
        value = std::move(strings);
      break;
    }
  }
  if (!value) return type_error(what, node, to_string(spec.type));
  return check_param_value(spec, std::move(*value), what, error);
}

namespace {

bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

// Decimal digits from `i`, without a leading zero; returns where they end,
// or npos when there are none (or a leading zero).
std::size_t digits_end(std::string_view text, std::size_t i) {
  const std::size_t start = i;
  while (i < text.size() && is_digit(text[i])) ++i;
  if (i == start || (text[start] == '0' && i - start > 1)) return std::string_view::npos;
  return i;
}

// The literals that defaults are nearly all written as, read without the
// TOML parser (one parse of a document per default, at every validation, was
// a tenth of a `ductile elastic` process): a decimal integer, true or false,
// a basic string of printable ASCII without escapes, each exactly as TOML
// reads it. Anything else (floats, signs, underscores, other bases, escapes,
// lists, malformed text) returns nullopt for the TOML parser to read or
// refuse in its words.
std::optional<ParamValue> plain_literal(ParamType type, std::string_view text) {
  switch (type) {
    case ParamType::boolean:
      if (text == "true") return ParamValue(true);
      if (text == "false") return ParamValue(false);
      return std::nullopt;
    case ParamType::integer:
    case ParamType::floating: {
      // A float is left to TOML++: libstdc++'s from_chars for a double
      // needs libm (its rounding mode), which the program does not load.
      const std::size_t sign = !text.empty() && text[0] == '-' ? 1 : 0;
      if (digits_end(text, sign) != text.size()) return std::nullopt;
      std::int64_t value = 0;
      auto [at, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
      if (ec != std::errc() || at != text.data() + text.size()) return std::nullopt;
      return ParamValue(value);  // for a float parameter, made one by check_param_value
    }
    case ParamType::string: {
      if (text.size() < 2 || text.front() != '"' || text.back() != '"') return std::nullopt;
      const std::string_view inner = text.substr(1, text.size() - 2);
      for (char c : inner)
        if (c < 0x20 || c > 0x7e || c == '"' || c == '\\') return std::nullopt;
      return ParamValue(std::string(inner));
    }
    default:
      return std::nullopt;
  }
}

}  // namespace

ParamValue parse_param_literal(const ParamSpec& spec, std::string_view literal) {
  std::string error;
  std::optional<ParamValue> value;
  if (auto plain = plain_literal(spec.type, literal)) {
    value = check_param_value(spec, std::move(*plain), spec.key, error);
  } else {
    std::string text = "v = " + std::string(literal);
    toml::table table;
    try {
      table = toml::parse(text, std::string_view{"<default>"});
    } catch (const toml::parse_error& e) {
      throw Error(ErrorKind::config, fmt::format("default of '{}' is not a TOML value: {} ({})",
                                                 spec.key, literal, e.description()));
    }
    if (const toml::node* node = table.get("v")) value = convert_node(*node, spec, spec.key, error);
  }
  if (!value) throw Error(ErrorKind::config, fmt::format("default of '{}': {}", spec.key, error));
  return *value;
}

}  // namespace ductile::core
