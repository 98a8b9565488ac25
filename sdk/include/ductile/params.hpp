// Parameter schemas (declared by plugins) and validated parameter values
// (built by the core and handed to a plugin's factory).
//
// A plugin describes each key it accepts with a ParamSpec: a plain, constant
// aggregate that lives in the plugin's read-only data for as long as the
// library is loaded. The core validates every key of a configuration section
// against the schema (unknown key, wrong type, out of range, not an allowed
// value) before any plugin object is created, fills in defaults, and passes
// the result as a Params object.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ductile/error.hpp"
#include "ductile/export.hpp"

namespace ductile {

enum class ParamType : std::uint32_t {
  boolean = 0,
  integer = 1,   // signed 64-bit
  floating = 2,  // double; an integer literal is accepted too
  string = 3,
  integer_list = 4,  // array of signed 64-bit integers
  float_list = 5,    // array of doubles
  string_list = 6,
};

DUCTILE_SDK_API inline const char* to_string(ParamType t) noexcept {
  switch (t) {
    case ParamType::boolean:
      return "boolean";
    case ParamType::integer:
      return "integer";
    case ParamType::floating:
      return "float";
    case ParamType::string:
      return "string";
    case ParamType::integer_list:
      return "array of integers";
    case ParamType::float_list:
      return "array of floats";
    case ParamType::string_list:
      return "array of strings";
  }
  return "unknown";
}

// Flags of a ParamSpec.
enum ParamFlags : std::uint32_t {
  param_required = 1u << 0,  // no default; the key must be present
  param_has_min = 1u << 1,   // min_value applies (to numbers and list elements)
  param_has_max = 1u << 2,   // max_value applies
  // A setting of this process alone (a switch, a hint): copies of a
  // configuration that must agree, such as the elasticity scheduler
  // contract, do not compare it.
  param_local = 1u << 3,
};

// One key of a plugin's schema. Every pointer refers to static storage of the
// plugin (string literals, static arrays) and must stay valid while the
// library is loaded.
//
// default_value is the default written as a TOML value ("4", "true",
// "\"seqlen\"", "[2, 4, 6]"); nullptr means no default (an optional key
// without default is simply absent from Params). Bounds are inclusive and
// compared as doubles for floats and as integers for integers.
//
// A bound applies only with its flag: min_value with param_has_min,
// max_value with param_has_max (in .flags). Errors: the host refuses to load
// a plugin whose schema sets a bound without its flag, naming the plugin,
// the key and the value, since such a bound would never be checked. A bound
// of 0 cannot be told from an unset field (0 is the default), so without its
// flag it is accepted and, like any unflagged bound, not checked: write
// `.flags = param_has_min, .min_value = 0` for a lower bound of 0.
struct ParamSpec {
  const char* key = nullptr;
  ParamType type = ParamType::boolean;
  std::uint32_t flags = 0;
  const char* default_value = nullptr;
  double min_value = 0;
  double max_value = 0;
  const char* const* allowed_values =
      nullptr;  // for strings: nullptr-terminated list, or nullptr for any
  const char* doc = nullptr;
};

// A validated value.
using ParamValue = std::variant<bool, std::int64_t, double, std::string, std::vector<std::int64_t>,
                                std::vector<double>, std::vector<std::string>>;

// Validated parameters of one plugin instance: every key of the schema that
// was given or has a default. Typed getters throw ductile::Error
// (ErrorKind::internal) when the key is absent or holds another type, which
// after validation means the plugin asked for a key its schema does not
// declare.
//
// Ownership: a value type; the plugin receives a copy it may keep.
// Threading: const methods are safe to call concurrently.
class DUCTILE_SDK_API Params {
 public:
  Params() = default;

  void set(std::string key, ParamValue value) { values_[std::move(key)] = std::move(value); }
  bool has(std::string_view key) const { return values_.find(key) != values_.end(); }
  const std::map<std::string, ParamValue, std::less<>>& values() const { return values_; }

  bool get_bool(std::string_view key) const { return get<bool>(key); }
  std::int64_t get_int(std::string_view key) const { return get<std::int64_t>(key); }
  double get_double(std::string_view key) const {
    auto it = find(key);
    if (auto* i = std::get_if<std::int64_t>(&it->second)) return static_cast<double>(*i);
    return as<double>(it);
  }
  const std::string& get_string(std::string_view key) const { return get<std::string>(key); }
  const std::vector<std::int64_t>& get_int_list(std::string_view key) const {
    return get<std::vector<std::int64_t>>(key);
  }
  const std::vector<double>& get_double_list(std::string_view key) const {
    return get<std::vector<double>>(key);
  }
  const std::vector<std::string>& get_string_list(std::string_view key) const {
    return get<std::vector<std::string>>(key);
  }

  // Getters with a fallback for absent keys.
  std::int64_t get_int_or(std::string_view key, std::int64_t fallback) const {
    return has(key) ? get_int(key) : fallback;
  }
  double get_double_or(std::string_view key, double fallback) const {
    return has(key) ? get_double(key) : fallback;
  }
  bool get_bool_or(std::string_view key, bool fallback) const {
    return has(key) ? get_bool(key) : fallback;
  }
  std::string get_string_or(std::string_view key, std::string fallback) const {
    return has(key) ? get_string(key) : fallback;
  }

 private:
  using Map = std::map<std::string, ParamValue, std::less<>>;
  Map::const_iterator find(std::string_view key) const {
    auto it = values_.find(key);
    if (it == values_.end())
      throw Error(ErrorKind::internal, "parameter '" + std::string(key) + "' is not set");
    return it;
  }
  template <class T>
  const T& as(Map::const_iterator it) const {
    if (auto* v = std::get_if<T>(&it->second)) return *v;
    throw Error(ErrorKind::internal, "parameter '" + it->first + "' has another type");
  }
  template <class T>
  const T& get(std::string_view key) const {
    return as<T>(find(key));
  }

  Map values_;
};

}  // namespace ductile
