// Reader of NumPy .npy lengths files (format versions 1, 2 and 3): a 1-D
// (or N x 1, 1 x N) array of int32, int64, uint16 or uint32, either byte
// order. The header dict is parsed only as far as `descr` and `shape`.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "batching/lengths_internal.hpp"

namespace ductile::pipeline::detail {

namespace fs = std::filesystem;

namespace {

// Finds `'key': value` in a .npy header dict and returns the value text.
std::string_view npy_field(std::string_view header, std::string_view key, const fs::path& file) {
  const std::string quoted1 = fmt::format("'{}'", key), quoted2 = fmt::format("\"{}\"", key);
  std::size_t at = header.find(quoted1);
  std::size_t klen = quoted1.size();
  if (at == std::string_view::npos) at = header.find(quoted2);
  if (at == std::string_view::npos)
    throw io_error(file,
                   fmt::format("corrupt .npy header: no '{}' entry in {}", key, shown(header)));
  std::size_t colon = header.find(':', at + klen);
  if (colon == std::string_view::npos)
    throw io_error(file, "corrupt .npy header: no ':' after key");
  std::string_view rest = trim(header.substr(colon + 1));
  std::size_t end = 0;
  if (!rest.empty() && rest.front() == '(') {
    end = rest.find(')');
    if (end == std::string_view::npos) throw io_error(file, "corrupt .npy header: unclosed shape");
    return rest.substr(0, end + 1);
  }
  end = rest.find_first_of(",}");
  return trim(rest.substr(0, end));
}

}  // namespace

std::vector<std::int64_t> read_npy(const fs::path& file) {
  MappedFile mapped(file);
  const unsigned char* d = mapped.data();
  const std::size_t size = mapped.size();
  if (size < 10 || std::memcmp(d, "\x93NUMPY", 6) != 0)
    throw io_error(file, "not a .npy file (no \\x93NUMPY magic at byte 0)");
  const unsigned major = d[6];
  std::size_t header_len = 0, header_start = 0;
  if (major == 1) {
    header_len = load_le<std::uint16_t>(d + 8, false);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) throw io_error(file, "truncated .npy header");
    header_len = load_le<std::uint32_t>(d + 8, false);
    header_start = 12;
  } else {
    throw io_error(file, fmt::format("unsupported .npy format version {}.{} (known: 1, 2, 3)",
                                     major, static_cast<unsigned>(d[7])));
  }
  if (header_start + header_len > size)
    throw io_error(file, fmt::format("truncated .npy header: needs {} bytes, the file has {}",
                                     header_start + header_len, size));
  std::string_view header(reinterpret_cast<const char*>(d + header_start), header_len);
  std::string descr(npy_field(header, "descr", file));
  if (descr.size() >= 2 && (descr.front() == '\'' || descr.front() == '"'))
    descr = descr.substr(1, descr.size() - 2);
  std::string_view shape = npy_field(header, "shape", file);
  // Shape: (N,) or (N, 1) or (1, N).
  std::vector<std::int64_t> dims;
  {
    if (shape.size() < 2 || shape.front() != '(' || shape.back() != ')')
      throw io_error(file, fmt::format("corrupt .npy header: shape {} is not a tuple like (N,)",
                                       shown(shape)));
    std::string_view inner = shape.substr(1, shape.size() - 2);
    while (!trim(inner).empty()) {
      std::size_t comma = inner.find(',');
      std::string_view part = trim(inner.substr(0, comma));
      if (!part.empty()) {
        std::int64_t v = 0;
        if (!parse_int(part, v) || v < 0)
          throw io_error(file, fmt::format("corrupt .npy header: shape {}", shown(shape)));
        dims.push_back(v);
      }
      if (comma == std::string_view::npos) break;
      inner.remove_prefix(comma + 1);
    }
  }
  // At most one dimension above 1, so the count is that dimension (or 0):
  // never a product that could overflow.
  std::int64_t count = 1;
  int big = 0;
  for (auto v : dims) {
    if (v > 1) ++big;
    count = v == 0 || count == 0 ? 0 : std::max(count, v);
  }
  if (dims.empty() || big > 1)
    throw value_error(file, fmt::format("array of shape {}: expected a 1-D array of lengths",
                                        std::string(shape)));
  const char order = descr.empty() ? '?' : descr[0];
  const std::string type = descr.size() > 1 ? descr.substr(1) : descr;
  const bool swap = (order == '>') == (std::endian::native == std::endian::little) &&
                    (order == '>' || order == '<');
  std::size_t item = 0;
  if (type == "i4" || type == "u4")
    item = 4;
  else if (type == "i8")
    item = 8;
  else if (type == "u2")
    item = 2;
  if (item == 0 || (order != '<' && order != '>' && order != '|' && order != '='))
    throw value_error(file,
                      fmt::format("dtype '{}' is not supported; lengths must be int32, int64, "
                                  "uint16 or uint32 ('<i4', '<i8', '<u2', '<u4')",
                                  descr));
  const std::size_t data_start = header_start + header_len;
  if (static_cast<std::uint64_t>(count) > (size - data_start) / item)
    throw io_error(file, fmt::format("truncated: the header announces {} values of {} bytes "
                                     "from byte {}, the file holds {} bytes of data",
                                     count, item, data_start, size - data_start));
  const std::size_t need = static_cast<std::size_t>(count) * item;
  if (size - data_start > need)
    throw io_error(file, fmt::format("corrupt: {} bytes after the {} values the header announces",
                                     size - data_start - need, count));
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(count));
  const unsigned char* p = d + data_start;
  const auto n = static_cast<std::size_t>(count);
  if (type == "i4")
    append_values<std::int32_t>(out, p, n, swap, file, data_start, 0, "element");
  else if (type == "u4")
    append_values<std::uint32_t>(out, p, n, swap, file, data_start, 0, "element");
  else if (type == "i8")
    append_values<std::int64_t>(out, p, n, swap, file, data_start, 0, "element");
  else
    append_values<std::uint16_t>(out, p, n, swap, file, data_start, 0, "element");
  return out;
}

}  // namespace ductile::pipeline::detail
