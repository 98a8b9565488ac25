// JSON from users, read without trusting its shape, for every front end that
// reads JSON (the DeepSpeed mapping, the agent's store records, the CLI):
// nesting depth bounded before nlohmann-json builds a DOM (its parser and
// dump() recurse once per level, so a deep document would overflow the
// stack), values quoted in messages as bounded excerpts, never whole, the
// conversion of JSON values to plugin parameters, and how a configuration
// file is told to be JSON.
//
// Threading: free functions without shared state. Errors: as each says.
#pragma once

#include <filesystem>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ductile/error.hpp"
#include "ductile/params.hpp"

namespace ductile::pipeline {

// Deepest nesting of arrays and objects accepted (a DeepSpeed config needs 4).
inline constexpr std::size_t kMaxJsonDepth = 64;
// Characters of a value quoted in a message before "...".
inline constexpr std::size_t kExcerptChars = 60;

// The deepest nesting of `text` and the byte offset where it first exceeds
// `limit` (npos when it does not). A linear scan that skips strings; it does
// not validate the text (the parser does that afterwards).
std::size_t json_depth_exceeded_at(std::string_view text, std::size_t limit);

// Parses `text` after checking its depth. Errors are ductile::Error of
// `kind` (and `type`, may be empty): "<source>: JSON nested deeper than 64
// levels (at byte N); ductile accepts at most 64", or "<source>: <what>:
// <parser message>" for a syntax error.
nlohmann::json parse_bounded_json(std::string_view text, std::string_view source,
                                  std::string_view what, ErrorKind kind,
                                  const std::string& type = {});

// The value as compact JSON (nlohmann's dump format), cut after
// kExcerptChars characters with "..." appended; visits only what it prints.
std::string json_excerpt(const nlohmann::json& value);

// The value as a parameter of `type`, or nullopt when it is not one: a
// boolean for boolean; an integer (or a float with an integral value that
// fits, as DeepSpeed's Python accepts 2.0) for integer; any number for
// floating; a string for string; arrays of integers (integers only), numbers
// or strings for the lists.
std::optional<ParamValue> json_to_param(const nlohmann::json& value, ParamType type);

// True when `file` is to be read as JSON: a .json extension, or any other
// extension than .toml with content whose first non-blank character is '{'.
bool is_json_config(const std::filesystem::path& file, std::string_view content);

// What a value of `type` must be, for messages: "true or false", "an
// integer", "a number", "a string", "a list of integers", ...
const char* param_type_expectation(ParamType type);

}  // namespace ductile::pipeline
