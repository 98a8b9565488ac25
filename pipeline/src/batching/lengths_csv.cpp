// Reader of the CSV lengths format (see ductile/pipeline/lengths.hpp): a
// header row, then rows; the lengths column is named (or the only one), and
// with a count column each row stands for `count` samples of its length (a
// histogram, expanded in row order). Fields may be double-quoted.
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "batching/lengths_internal.hpp"
#include "ductile/core/text.hpp"

namespace ductile::pipeline::detail {

namespace fs = std::filesystem;

namespace {

// Splits one CSV record on commas, honouring double quotes.
std::vector<std::string_view> split_csv(std::string_view line, std::vector<std::string>& storage) {
  std::vector<std::string_view> fields;
  storage.clear();
  std::size_t i = 0;
  bool quoted_any = false;
  std::vector<std::pair<std::size_t, std::size_t>> spans;
  while (true) {
    std::size_t start = i;
    if (i < line.size() && line[i] == '"') {
      std::string value;
      ++i;
      while (i < line.size()) {
        if (line[i] == '"') {
          if (i + 1 < line.size() && line[i + 1] == '"') {
            value += '"';
            i += 2;
            continue;
          }
          ++i;
          break;
        }
        value += line[i++];
      }
      storage.push_back(std::move(value));
      quoted_any = true;
      spans.emplace_back(static_cast<std::size_t>(-1), storage.size() - 1);
      while (i < line.size() && line[i] != ',') ++i;
    } else {
      while (i < line.size() && line[i] != ',') ++i;
      spans.emplace_back(start, i - start);
    }
    if (i >= line.size()) break;
    ++i;  // the comma
  }
  (void)quoted_any;
  for (auto [a, b] : spans)
    fields.push_back(a == static_cast<std::size_t>(-1) ? std::string_view(storage[b])
                                                       : trim(line.substr(a, b)));
  return fields;
}

}  // namespace

std::vector<std::int64_t> read_csv(const fs::path& file, const LengthReadOptions& options) {
  MappedFile mapped(file);
  std::vector<std::int64_t> out;
  std::vector<std::string> header;
  std::size_t length_col = 0, count_col = 0;
  bool histogram = !options.count_column.empty();
  std::vector<std::string> storage;
  for_each_row(
      file, mapped.text(), "empty line inside the table",
      [&](std::size_t line, std::string_view s) {
        auto fields = split_csv(s, storage);
        if (header.empty()) {
          for (auto f : fields) header.emplace_back(trim(f));
          auto find = [&](const std::string& name, const char* what) {
            auto it = std::find(header.begin(), header.end(), name);
            if (it == header.end())
              throw value_error(file,
                                fmt::format("line 1: no {} column '{}'{}; columns: {}", what, name,
                                            core::did_you_mean(name, header), core::join(header)));
            return static_cast<std::size_t>(it - header.begin());
          };
          if (options.column.empty()) {
            if (header.size() != 1)
              throw value_error(file,
                                fmt::format("line 1: {} columns ({}); name the lengths column "
                                            "(--column NAME)",
                                            header.size(), core::join(header)));
            length_col = 0;
          } else {
            length_col = find(options.column, "lengths");
          }
          if (histogram) count_col = find(options.count_column, "count");
          return;
        }
        if (fields.size() != header.size())
          throw value_error(file, fmt::format("line {}: {} fields, but the header has {} columns",
                                              line, fields.size(), header.size()));
        std::int64_t v = 0;
        if (!parse_int(fields[length_col], v))
          throw value_error(file, fmt::format("line {}, column '{}': {}", line, header[length_col],
                                              not_a_length(fields[length_col])));
        std::int64_t count = 1;
        if (histogram) {
          if (!parse_int(fields[count_col], count) || count < 0)
            throw value_error(file,
                              fmt::format("line {}, column '{}': {} is not a count (an integer "
                                          ">= 0)",
                                          line, header[count_col], shown(fields[count_col])));
          if (count == 0) return;
          // A histogram expands to one entry per sample: refuse counts that no
          // memory could hold before allocating them.
          const std::int64_t most = options.max_histogram_samples;
          const auto before = static_cast<std::int64_t>(out.size());
          if (count > most - before)
            throw value_error(
                file, fmt::format("line {}, column '{}': count {} expands the file to more than "
                                  "{} samples ({} from the rows above), the most a lengths file "
                                  "may expand to; valid: counts totalling at most {}",
                                  line, header[count_col], count, most, before, most));
        }
        check_length(file, v, fmt::format("line {}, column '{}'", line, header[length_col]));
        out.insert(out.end(), static_cast<std::size_t>(count), v);
      });
  if (header.empty()) throw value_error(file, "empty file: expected a header row and data rows");
  return out;
}

}  // namespace ductile::pipeline::detail
