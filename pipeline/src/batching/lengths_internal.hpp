// Shared by the lengths readers of the pipeline (not installed): one source
// per format (lengths_text.cpp, lengths_csv.cpp, lengths_npy.cpp,
// lengths_mmidx.cpp), the mapping they all read through
// (lengths_mapped_file.cpp) and lengths.cpp, which chooses the format and
// defines the helpers declared here. What more than one format needs is
// here, so that every format parses fields and words its errors alike.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "ductile/error.hpp"
#include "ductile/pipeline/lengths.hpp"

namespace ductile::pipeline::detail {

// "FILE: what", typed ErrorKind::io (unreadable, corrupt or truncated).
Error io_error(const std::filesystem::path& file, const std::string& what);
// "FILE: what", typed ErrorKind::invalid_argument (a bad value).
Error value_error(const std::filesystem::path& file, const std::string& what);

// A read-only memory mapping of a whole file.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& file);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::string_view text() const { return {reinterpret_cast<const char*>(data_), size_}; }

 private:
  std::filesystem::path file_;
  int fd_ = -1;
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

// `s` without leading blanks and tabs, nor trailing ones and '\r'.
std::string_view trim(std::string_view s);

// `s` quoted for a message, cut after 40 characters.
std::string shown(std::string_view s);

// Parses a whole field as a signed 64-bit integer.
bool parse_int(std::string_view s, std::int64_t& out);

// Why a field parse_int refused is not a length: "is past the largest
// integer (...)" for a whole number too wide for 64 bits, else "is not an
// integer length"; `s` is quoted and cut as shown() does.
std::string not_a_length(std::string_view s);

// Throws value_error unless `v` >= 1; `where` is the position in the file.
void check_length(const std::filesystem::path& file, std::int64_t v, const std::string& where);

// Calls visit(line, text_of_line) for each line that is not blank (the last
// line may lack '\n'). Blank lines may only trail: one followed by another
// line is Error(value) "line N: <blank_problem>".
template <class Visit>
void for_each_row(const std::filesystem::path& file, std::string_view text,
                  std::string_view blank_problem, Visit&& visit) {
  std::size_t line = 0, pos = 0, blank_line = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view s = text.substr(pos, end - pos);
    pos = end + 1;
    ++line;
    if (trim(s).empty()) {
      if (!blank_line) blank_line = line;
      continue;
    }
    if (blank_line) throw value_error(file, fmt::format("line {}: {}", blank_line, blank_problem));
    visit(line, s);
  }
}

template <class T>
T load_le(const unsigned char* p, bool swap) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  if (swap) {
    unsigned char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    std::reverse(b, b + sizeof(T));
    std::memcpy(&v, b, sizeof(T));
  }
  return v;
}

// Reads `count` values of a numeric type at `data`, checking each.
template <class T>
void append_values(std::vector<std::int64_t>& out, const unsigned char* data, std::size_t count,
                   bool swap, const std::filesystem::path& file, std::size_t base_offset,
                   std::size_t first_index, const char* unit) {
  for (std::size_t i = 0; i < count; ++i) {
    const T raw = load_le<T>(data + i * sizeof(T), swap);
    std::int64_t v;
    if constexpr (std::is_same_v<T, std::uint64_t>) {
      if (raw > static_cast<std::uint64_t>(INT64_MAX))
        throw value_error(file, fmt::format("{} {} (byte offset {}): value {} is too large", unit,
                                            first_index + i, base_offset + i * sizeof(T), raw));
      v = static_cast<std::int64_t>(raw);
    } else {
      v = static_cast<std::int64_t>(raw);
    }
    if (v < 1)
      throw value_error(file, fmt::format("{} {} (byte offset {}): length {} is invalid; every "
                                          "length must be an integer >= 1",
                                          unit, first_index + i, base_offset + i * sizeof(T), v));
    out.push_back(v);
  }
}

// The readers, one a format; each returns the lengths in file order (perhaps
// none: read_lengths refuses an empty result).
std::vector<std::int64_t> read_text(const std::filesystem::path& file);
std::vector<std::int64_t> read_csv(const std::filesystem::path& file,
                                   const LengthReadOptions& options);
std::vector<std::int64_t> read_npy(const std::filesystem::path& file);
// `given`: PREFIX, PREFIX.bin or PREFIX.idx.
std::vector<std::int64_t> read_mmidx(const std::filesystem::path& given);

}  // namespace ductile::pipeline::detail
