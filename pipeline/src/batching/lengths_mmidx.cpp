// Reader of DeepSpeed's MMapIndexedDataset (PREFIX.idx + PREFIX.bin), as its
// data analyzer writes seqlen/seqlen_sample_to_metric: the index (version 1)
// gives each sample's value count and byte offset in the .bin, and every
// value of every sample is a length, in order.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "batching/lengths_internal.hpp"

namespace ductile::pipeline::detail {

namespace fs = std::filesystem;

namespace {

// DeepSpeed's MMapIndexedDataset dtype codes (indexed_dataset.py `dtypes`).
struct MmidxType {
  int code;
  std::size_t size;
  const char* name;
};
constexpr MmidxType kMmidxTypes[] = {{1, 1, "uint8"},  {2, 1, "int8"},  {3, 2, "int16"},
                                     {4, 4, "int32"},  {5, 8, "int64"}, {6, 2, "uint16"},
                                     {7, 4, "uint32"}, {8, 8, "uint64"}};

// A byte count past 2^64 (an announced sample count times 12, say), written
// whole rather than wrapped.
std::string decimal(unsigned __int128 value) {
  std::string digits;
  do {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(value % 10)));
    value /= 10;
  } while (value > 0);
  return digits;
}

}  // namespace

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
                               decimal(need), idx.size()));
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
                                offset, decimal(end), bin.size()));
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

}  // namespace ductile::pipeline::detail
