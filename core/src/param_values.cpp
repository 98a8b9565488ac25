// A parameter value checked against its ParamSpec: type, bounds and allowed
// values. Every edge (TOML, JSON, Python keyword arguments, Params built in
// C++) converts its input to a ParamValue once and comes here for the one
// check, before any plugin hook sees it.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "config_internal.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/text.hpp"

namespace ductile::core {

namespace {

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

std::vector<std::string> allowed_list(const ParamSpec& spec) {
  std::vector<std::string> out;
  if (spec.allowed_values)
    for (auto p = spec.allowed_values; *p; ++p) out.emplace_back(*p);
  return out;
}

std::string format_param_value(const ParamValue& value) {
  return std::visit(ValueFormatter{}, value);
}

std::optional<ParamValue> check_param_value(const ParamSpec& spec, ParamValue value,
                                            const std::string& what, std::string& error) {
  const ValueFormatter shown;
  auto out_of_range = [&](const std::string& at, const std::string& text) {
    error = fmt::format("{} = {} is out of range: must be {}", at, text, bounds_text(spec));
    return false;
  };
  auto allowed_string = [&](const std::string& at, const std::string& v) {
    auto allowed = allowed_list(spec);
    if (allowed.empty() || std::find(allowed.begin(), allowed.end(), v) != allowed.end())
      return true;
    error = fmt::format("{} = \"{}\" is not allowed{}; valid values: {}", at, excerpt(v),
                        did_you_mean(v, allowed), join(allowed));
    return false;
  };
  auto element = [&](std::size_t index) { return fmt::format("{}[{}]", what, index); };
  switch (spec.type) {
    case ParamType::boolean:
      if (std::holds_alternative<bool>(value)) return value;
      break;
    case ParamType::integer:
      if (const auto* i = std::get_if<std::int64_t>(&value)) {
        if (!in_bounds_int(spec, *i)) return out_of_range(what, shown(*i)), std::nullopt;
        return value;
      }
      break;
    case ParamType::floating: {
      // An integer is a number too; it is shown as written and kept as a double.
      double d;
      std::string text;
      if (const auto* f = std::get_if<double>(&value))
        d = *f, text = shown(*f);
      else if (const auto* i = std::get_if<std::int64_t>(&value))
        d = static_cast<double>(*i), text = shown(*i);
      else
        break;
      if (std::isnan(d) || !in_bounds(spec, d)) return out_of_range(what, text), std::nullopt;
      return ParamValue(d);
    }
    case ParamType::string:
      if (const auto* v = std::get_if<std::string>(&value)) {
        if (!allowed_string(what, *v)) return std::nullopt;
        return value;
      }
      break;
    case ParamType::integer_list:
      if (const auto* list = std::get_if<std::vector<std::int64_t>>(&value)) {
        for (std::size_t k = 0; k < list->size(); ++k)
          if (!in_bounds_int(spec, (*list)[k]))
            return out_of_range(element(k), shown((*list)[k])), std::nullopt;
        return value;
      }
      break;
    case ParamType::float_list:
      if (const auto* list = std::get_if<std::vector<double>>(&value)) {
        for (std::size_t k = 0; k < list->size(); ++k)
          if (std::isnan((*list)[k]) || !in_bounds(spec, (*list)[k]))
            return out_of_range(element(k), shown((*list)[k])), std::nullopt;
        return value;
      }
      break;
    case ParamType::string_list:
      if (const auto* list = std::get_if<std::vector<std::string>>(&value)) {
        for (std::size_t k = 0; k < list->size(); ++k)
          if (!allowed_string(element(k), (*list)[k])) return std::nullopt;
        return value;
      }
      break;
  }
  std::string type = to_string(spec.type);
  bool vowel = std::string_view("aeiou").find(type[0]) != std::string_view::npos;
  error = fmt::format("{} must be {}{}, got {}", what, vowel ? "an " : "a ", type,
                      format_param_value(value));
  return std::nullopt;
}

}  // namespace ductile::core
