// Reading the length (tokens) of every sample of a data set, for the batching
// samplers: text, CSV, NumPy .npy and DeepSpeed's data-analyzer metric files.
//
// Formats (chosen from the extension unless given):
// - text (.txt, anything else): one integer a line; blank lines are errors
//   except at the very end; '\r' line ends are accepted.
// - csv (.csv): a header row, then rows; `column` names the column holding
//   lengths (optional when the file has one column). With `count_column` the
//   file is a histogram: each row stands for `count` samples of that length,
//   expanded in row order (counts may be 0).
// - npy (.npy): a 1-D (or N x 1) array of int32, int64, uint16 or uint32,
//   either byte order, C or Fortran order.
// - mmidx (PREFIX.bin + PREFIX.idx, given as PREFIX, PREFIX.bin or
//   PREFIX.idx): DeepSpeed's MMapIndexedDataset ("MMIDIDX" index, version 1),
//   as its data analyzer writes seqlen/seqlen_sample_to_metric; every value
//   of every sample, in order, read through mmap.
//
// Errors: ductile::Error with ErrorKind::not_found (missing file),
// ErrorKind::io (unreadable, corrupt or truncated file) or
// ErrorKind::invalid_argument (a value that is not an integer >= 1, an
// unknown column, an empty input). The message names the file and the
// position (line and column, byte offset, or sample index) and the bad value.
// Threading: free functions without shared state; safe to call concurrently.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace ductile::pipeline {

enum class LengthFormat { automatic, text, csv, npy, mmidx };

// The names of the formats, in enum order, nullptr-terminated (as the
// [batching] format key's allowed values are).
inline constexpr const char* kLengthFormatNames[] = {"auto", "text",  "csv",
                                                     "npy",  "mmidx", nullptr};

// The largest lengths file (text or binary): 64 GiB, 8 G int64 lengths.
// Lengths files are mapped, not read, so this bounds the address space only.
inline constexpr std::uintmax_t kMaxLengthsFileBytes = std::uintmax_t{64} << 30;

// The default cap on the samples a CSV histogram may expand to (see
// LengthReadOptions::max_histogram_samples).
inline constexpr std::int64_t kMaxHistogramSamples = std::int64_t{1} << 28;

struct LengthReadOptions {
  LengthFormat format = LengthFormat::automatic;
  std::string column;        // csv: the lengths column (empty: the only column)
  std::string count_column;  // csv: histogram counts column (empty: one sample a row)
  // csv histograms: the most samples the rows may expand to; more is
  // Error(invalid_argument) before allocating. A histogram row of a few
  // bytes stands for any number of samples, each of which costs about 16
  // bytes once packed, so the default (2^28 = 268,435,456 samples: 2 GiB of
  // lengths, about 4 GiB at the peak of `ductile pack`) keeps a small file
  // from asking for more memory than a training host has to spare, while
  // holding the length distribution of the largest public corpora.
  std::int64_t max_histogram_samples = kMaxHistogramSamples;
};

// One of kLengthFormatNames. Throws Error(invalid_argument).
LengthFormat parse_length_format(const std::string& text);

// The lengths in file order. Every length is >= 1 and the result is not empty.
std::vector<std::int64_t> read_lengths(const std::filesystem::path& file,
                                       const LengthReadOptions& options = {});

// The longest length length_histogram indexes: one counter per length up to
// the longest, so a single length read from a file (up to 2^63 - 1) would
// otherwise size the result. 2^27 (1 GiB of counters) is far above any
// sequence a model is trained on.
inline constexpr std::int64_t kMaxHistogramLength = std::int64_t{1} << 27;

// Histogram of lengths: result[len] = number of samples of that length
// (result[0] == 0). Convenience for bounds and reports. Throws
// Error(invalid_argument) naming the sample and its length when a length is
// above kMaxHistogramLength.
std::vector<std::int64_t> length_histogram(const std::vector<std::int64_t>& lengths);

}  // namespace ductile::pipeline
