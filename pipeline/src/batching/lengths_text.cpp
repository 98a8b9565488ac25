// Reader of the text lengths format (see ductile/pipeline/lengths.hpp): one
// integer length a line. A blank line is an error unless only blank lines
// follow it; the error names the first blank line.
#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include "batching/lengths_internal.hpp"

namespace ductile::pipeline::detail {

std::vector<std::int64_t> read_text(const std::filesystem::path& file) {
  MappedFile mapped(file);
  std::vector<std::int64_t> out;
  for_each_row(file, mapped.text(), "empty line; expected one integer length a line",
               [&](std::size_t line, std::string_view s) {
                 std::int64_t v = 0;
                 if (!parse_int(s, v))
                   throw value_error(file, fmt::format("line {}: {}", line, not_a_length(s)));
                 check_length(file, v, fmt::format("line {}", line));
                 out.push_back(v);
               });
  return out;
}

}  // namespace ductile::pipeline::detail
