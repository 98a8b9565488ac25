// Readers of per-sample lengths (see ductile/pipeline/lengths.hpp).
#include "ductile/pipeline/lengths.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <string_view>

#include <fmt/format.h>

#include "ductile/core/files.hpp"
#include "ductile/core/text.hpp"
#include "ductile/error.hpp"

namespace ductile::pipeline {
namespace {

namespace fs = std::filesystem;

Error io_error(const fs::path& file, const std::string& what) {
  return Error(ErrorKind::io, fmt::format("{}: {}", file.string(), what));
}
Error value_error(const fs::path& file, const std::string& what) {
  return Error(ErrorKind::invalid_argument, fmt::format("{}: {}", file.string(), what));
}

// A read-only memory mapping of a whole file.
class MappedFile {
 public:
  explicit MappedFile(const fs::path& file) : file_(file) {
    std::error_code ec;
    if (!fs::exists(file, ec))
      throw Error(ErrorKind::not_found, fmt::format("{}: no such file", file.string()));
    // Non-blocking open: a FIFO must not wait for a writer before it is refused.
    fd_ = core::open_for_reading(file);
    if (fd_ < 0) throw io_error(file, fmt::format("cannot open: {}", std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      ::close(fd_);
      throw io_error(file, fmt::format("cannot stat: {}", std::strerror(errno)));
    }
    if (auto problem = core::regular_file_problem(st, core::kMaxLengthsFileBytes, "lengths file");
        !problem.empty()) {
      ::close(fd_);
      throw io_error(file, problem);
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
      if (p == MAP_FAILED) {
        ::close(fd_);
        throw io_error(file, fmt::format("cannot map: {}", std::strerror(errno)));
      }
      data_ = static_cast<const unsigned char*>(p);
    }
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<unsigned char*>(data_), size_);
    if (fd_ >= 0) ::close(fd_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::string_view text() const { return {reinterpret_cast<const char*>(data_), size_}; }

 private:
  fs::path file_;
  int fd_ = -1;
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

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

// Parses a whole field as a signed 64-bit integer.
bool parse_int(std::string_view s, std::int64_t& out) {
  s = trim(s);
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size();
}

void check_length(const fs::path& file, std::int64_t v, const std::string& where) {
  if (v < 1)
    throw value_error(file, fmt::format("{}: length {} is invalid; every length must be an "
                                        "integer >= 1",
                                        where, v));
}

// Splits text into lines; the last line may lack '\n'.
template <class F>
void for_each_line(std::string_view text, F&& f) {
  std::size_t line = 0, pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    f(++line, text.substr(pos, end - pos), end >= text.size() - 1);
    pos = end + 1;
  }
}

std::vector<std::int64_t> read_text(const fs::path& file) {
  MappedFile mapped(file);
  std::vector<std::int64_t> out;
  std::size_t blank_line = 0;
  for_each_line(mapped.text(), [&](std::size_t line, std::string_view s, bool) {
    if (trim(s).empty()) {
      if (!blank_line) blank_line = line;
      return;
    }
    if (blank_line)
      throw value_error(file, fmt::format("line {}: empty line; expected one integer length a "
                                          "line",
                                          blank_line));
    std::int64_t v = 0;
    if (!parse_int(s, v))
      throw value_error(file,
                        fmt::format("line {}: {} is not an integer length", line, shown(trim(s))));
    check_length(file, v, fmt::format("line {}", line));
    out.push_back(v);
  });
  return out;
}

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

std::vector<std::int64_t> read_csv(const fs::path& file, const LengthReadOptions& options) {
  MappedFile mapped(file);
  std::vector<std::int64_t> out;
  std::vector<std::string> header;
  std::size_t length_col = 0, count_col = 0;
  bool histogram = !options.count_column.empty();
  std::vector<std::string> storage;
  std::size_t blank_line = 0;
  for_each_line(mapped.text(), [&](std::size_t line, std::string_view s, bool) {
    if (trim(s).empty()) {
      if (!blank_line) blank_line = line;
      return;
    }
    if (blank_line)
      throw value_error(file, fmt::format("line {}: empty line inside the table", blank_line));
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
          throw value_error(file, fmt::format("line 1: {} columns ({}); name the lengths column "
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
      throw value_error(file, fmt::format("line {}: {} fields, but the header has {} columns", line,
                                          fields.size(), header.size()));
    std::int64_t v = 0;
    if (!parse_int(fields[length_col], v))
      throw value_error(file, fmt::format("line {}, column '{}': {} is not an integer length", line,
                                          header[length_col], shown(fields[length_col])));
    std::int64_t count = 1;
    if (histogram) {
      if (!parse_int(fields[count_col], count) || count < 0)
        throw value_error(file, fmt::format("line {}, column '{}': {} is not a count (an integer "
                                            ">= 0)",
                                            line, header[count_col], shown(fields[count_col])));
      if (count == 0) return;
      // A histogram expands to one entry per sample: refuse counts that no
      // memory could hold before allocating them.
      const std::int64_t most = options.max_histogram_samples;
      if (count > most - static_cast<std::int64_t>(out.size()))
        throw value_error(
            file, fmt::format("line {}, column '{}': count {} makes more than {} samples in all, "
                              "the most a lengths file may expand to",
                              line, header[count_col], count, most));
    }
    check_length(file, v, fmt::format("line {}, column '{}'", line, header[length_col]));
    out.insert(out.end(), static_cast<std::size_t>(count), v);
  });
  if (header.empty()) throw value_error(file, "empty file: expected a header row and data rows");
  return out;
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
                   bool swap, const fs::path& file, std::size_t base_offset,
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

// DeepSpeed's MMapIndexedDataset dtype codes (indexed_dataset.py `dtypes`).
struct MmidxType {
  int code;
  std::size_t size;
  const char* name;
};
constexpr MmidxType kMmidxTypes[] = {{1, 1, "uint8"},  {2, 1, "int8"},  {3, 2, "int16"},
                                     {4, 4, "int32"},  {5, 8, "int64"}, {6, 2, "uint16"},
                                     {7, 4, "uint32"}, {8, 8, "uint64"}};

std::vector<std::int64_t> read_mmidx(const fs::path& given) {
  fs::path prefix = given;
  if (given.extension() == ".bin" || given.extension() == ".idx") prefix.replace_extension();
  fs::path idx_path = prefix, bin_path = prefix;
  idx_path += ".idx";
  bin_path += ".bin";
  MappedFile idx(idx_path);
  MappedFile bin(bin_path);
  const unsigned char* d = idx.data();
  constexpr std::size_t kHeader = 9 + 8 + 1 + 8 + 8;
  if (idx.size() < 9 || std::memcmp(d, "MMIDIDX\x00\x00", 9) != 0)
    throw io_error(idx_path,
                   "not a DeepSpeed MMapIndexedDataset index (no MMIDIDX magic at byte 0)");
  if (idx.size() < kHeader)
    throw io_error(idx_path, fmt::format("truncated: {} bytes, the header alone needs {}",
                                         idx.size(), kHeader));
  const auto version = load_le<std::uint64_t>(d + 9, false);
  if (version != 1)
    throw io_error(idx_path,
                   fmt::format("byte 9: index version {} is not supported (known: 1)", version));
  const int code = d[17];
  const MmidxType* type = nullptr;
  for (const auto& t : kMmidxTypes)
    if (t.code == code) type = &t;
  if (!type)
    throw io_error(idx_path, fmt::format("byte 17: unknown dtype code {} (known: 1..8)", code));
  const auto len = load_le<std::uint64_t>(d + 18, false);
  const auto doc_count = load_le<std::uint64_t>(d + 26, false);
  const unsigned __int128 need = static_cast<unsigned __int128>(len) * 12u +
                                 static_cast<unsigned __int128>(doc_count) * 8u + kHeader;
  if (need != idx.size())
    throw io_error(idx_path,
                   fmt::format("{}: the header announces {} samples and {} document entries ({} "
                               "bytes), the file has {} bytes",
                               need > idx.size() ? "truncated" : "corrupt", len, doc_count,
                               static_cast<std::uint64_t>(need), idx.size()));
  const unsigned char* sizes = d + kHeader;
  const unsigned char* pointers = sizes + len * 4;
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(len));
  for (std::uint64_t i = 0; i < len; ++i) {
    const auto count = load_le<std::int32_t>(sizes + i * 4, false);
    const auto offset = load_le<std::int64_t>(pointers + i * 8, false);
    if (count < 0 || offset < 0)
      throw io_error(idx_path, fmt::format("corrupt: sample {} has size {} at byte offset {}", i,
                                           count, offset));
    const unsigned __int128 end =
        static_cast<unsigned __int128>(offset) + static_cast<unsigned __int128>(count) * type->size;
    if (end > bin.size())
      throw io_error(
          bin_path, fmt::format("truncated: sample {} needs bytes {}..{}, the file has {} bytes", i,
                                offset, static_cast<std::uint64_t>(end), bin.size()));
    const unsigned char* p = bin.data() + offset;
    const auto n = static_cast<std::size_t>(count);
    const auto off = static_cast<std::size_t>(offset);
    switch (code) {
      case 1:
        append_values<std::uint8_t>(out, p, n, false, bin_path, off, i, "sample");
        break;
      case 2:
        append_values<std::int8_t>(out, p, n, false, bin_path, off, i, "sample");
        break;
      case 3:
        append_values<std::int16_t>(out, p, n, false, bin_path, off, i, "sample");
        break;
      case 4:
        append_values<std::int32_t>(out, p, n, false, bin_path, off, i, "sample");
        break;
      case 5:
        append_values<std::int64_t>(out, p, n, false, bin_path, off, i, "sample");
        break;
      case 6:
        append_values<std::uint16_t>(out, p, n, false, bin_path, off, i, "sample");
        break;
      case 7:
        append_values<std::uint32_t>(out, p, n, false, bin_path, off, i, "sample");
        break;
      default:
        append_values<std::uint64_t>(out, p, n, false, bin_path, off, i, "sample");
        break;
    }
  }
  return out;
}

}  // namespace

LengthFormat parse_length_format(const std::string& text) {
  if (text == "auto") return LengthFormat::automatic;
  if (text == "text") return LengthFormat::text;
  if (text == "csv") return LengthFormat::csv;
  if (text == "npy") return LengthFormat::npy;
  if (text == "mmidx") return LengthFormat::mmidx;
  throw Error(
      ErrorKind::invalid_argument,
      fmt::format("length format '{}' is unknown; valid: auto, text, csv, npy, mmidx", text));
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
      out = read_csv(file, options);
      break;
    case LengthFormat::npy:
      out = read_npy(file);
      break;
    case LengthFormat::mmidx:
      out = read_mmidx(file);
      break;
    default:
      out = read_text(file);
      break;
  }
  if (out.empty())
    throw value_error(file, "no lengths: the input is empty (at least one sample is needed)");
  return out;
}

std::vector<std::int64_t> length_histogram(const std::vector<std::int64_t>& lengths) {
  std::int64_t top = 0;
  for (auto v : lengths) top = std::max(top, v);
  std::vector<std::int64_t> h(static_cast<std::size_t>(top) + 1, 0);
  for (auto v : lengths)
    if (v >= 0) ++h[static_cast<std::size_t>(v)];
  return h;
}

}  // namespace ductile::pipeline
