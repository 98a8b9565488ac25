// Reading per-sample lengths (see ductile/pipeline/lengths.hpp): the choice
// of format, the checks every format shares (a column only for CSV, at least
// one length) and the helpers of lengths_internal.hpp. Each format's reader
// is in its own file: lengths_text.cpp, lengths_csv.cpp, lengths_npy.cpp,
// lengths_mmidx.cpp; the file mapping they read through is
// lengths_mapped_file.cpp.
#include "ductile/pipeline/lengths.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <string_view>
#include <system_error>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "batching/lengths_internal.hpp"
#include "ductile/error.hpp"

namespace ductile::pipeline {

namespace fs = std::filesystem;

namespace detail {

Error io_error(const fs::path& file, const std::string& what) {
  return Error(ErrorKind::io, fmt::format("{}: {}", file.string(), what));
}
Error value_error(const fs::path& file, const std::string& what) {
  return Error(ErrorKind::invalid_argument, fmt::format("{}: {}", file.string(), what));
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

std::string shown(std::string_view s) {
  if (s.size() > 40) return fmt::format("'{}...'", s.substr(0, 40));
  return fmt::format("'{}'", s);
}

bool parse_int(std::string_view s, std::int64_t& out) {
  s = trim(s);
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size();
}

std::string not_a_length(std::string_view s) {
  s = trim(s);
  std::int64_t ignored = 0;
  std::string_view digits = s;
  if (!digits.empty() && (digits.front() == '+' || digits.front() == '-')) digits.remove_prefix(1);
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), ignored);
  if (!digits.empty() && std::isdigit(static_cast<unsigned char>(digits.front())) &&
      ec == std::errc::result_out_of_range && end == digits.data() + digits.size())
    return fmt::format(
        "{} is past the {} integer ({}); every length must be an integer from 1 to "
        "9223372036854775807 (2^63-1)",
        shown(s), s.front() == '-' ? "smallest" : "largest", s.front() == '-' ? "-2^63" : "2^63-1");
  return fmt::format("{} is not an integer length", shown(s));
}

void check_length(const fs::path& file, std::int64_t v, const std::string& where) {
  if (v < 1)
    throw value_error(file, fmt::format("{}: length {} is invalid; every length must be an "
                                        "integer >= 1",
                                        where, v));
}

}  // namespace detail

LengthFormat parse_length_format(const std::string& text) {
  std::vector<std::string> names;
  for (int k = 0; kLengthFormatNames[k]; ++k) {
    if (text == kLengthFormatNames[k]) return static_cast<LengthFormat>(k);
    names.emplace_back(kLengthFormatNames[k]);
  }
  throw Error(ErrorKind::invalid_argument, fmt::format("length format '{}' is unknown; valid: {}",
                                                       text, fmt::join(names, ", ")));
}

std::vector<std::int64_t> read_lengths(const fs::path& file, const LengthReadOptions& options) {
  LengthFormat format = options.format;
  if (format == LengthFormat::automatic) {
    const auto ext = file.extension().string();
    if (ext == ".csv")
      format = LengthFormat::csv;
    else if (ext == ".npy")
      format = LengthFormat::npy;
    else if (ext == ".bin" || ext == ".idx")
      format = LengthFormat::mmidx;
    else {
      std::error_code ec;
      fs::path idx = file;
      idx += ".idx";
      format =
          !fs::exists(file, ec) && fs::exists(idx, ec) ? LengthFormat::mmidx : LengthFormat::text;
    }
  }
  if (format != LengthFormat::csv && (!options.column.empty() || !options.count_column.empty()))
    throw Error(
        ErrorKind::invalid_argument,
        fmt::format("{}: a column was named, but the file is not read as CSV", file.string()));
  std::vector<std::int64_t> out;
  switch (format) {
    case LengthFormat::csv:
      out = detail::read_csv(file, options);
      break;
    case LengthFormat::npy:
      out = detail::read_npy(file);
      break;
    case LengthFormat::mmidx:
      out = detail::read_mmidx(file);
      break;
    default:
      out = detail::read_text(file);
      break;
  }
  if (out.empty())
    throw detail::value_error(file,
                              "no lengths: the input is empty (at least one sample is needed)");
  return out;
}

std::vector<std::int64_t> length_histogram(const std::vector<std::int64_t>& lengths) {
  std::int64_t top = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] > kMaxHistogramLength)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("length_histogram: sample {} has length {}, above {} (2^27), the "
                              "longest a histogram indexes; valid: lengths from 1 to {}",
                              i, lengths[i], kMaxHistogramLength, kMaxHistogramLength));
    top = std::max(top, lengths[i]);
  }
  std::vector<std::int64_t> h(static_cast<std::size_t>(top) + 1, 0);
  for (auto v : lengths)
    if (v >= 0) ++h[static_cast<std::size_t>(v)];
  return h;
}

}  // namespace ductile::pipeline
