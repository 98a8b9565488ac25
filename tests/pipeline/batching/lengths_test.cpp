// Length readers on the real files of tests/data/lengths and on corrupt or
// truncated copies made in a temporary directory.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "ductile/error.hpp"
#include "ductile/pipeline/lengths.hpp"
#include "temp_dir.hpp"

using ductile::Error;
using ductile::ErrorKind;
using ductile::pipeline::LengthReadOptions;
using ductile::pipeline::read_lengths;

namespace {

const std::string kData = std::string(DUCTILE_TEST_DATA_DIR) + "/lengths";

std::string slurp(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Expects read_lengths to fail with `kind` and a message containing every needle.
void expect_error(const std::filesystem::path& file, ErrorKind kind,
                  std::initializer_list<const char*> needles, const LengthReadOptions& o = {}) {
  try {
    (void)read_lengths(file, o);
    FAIL("no error reading ", file.string());
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.kind() == kind);
    for (const char* n : needles) CHECK(std::string(e.what()).find(n) != std::string::npos);
  }
}

std::vector<std::int64_t> conv_context_tokens() {
  LengthReadOptions o;
  o.column = "ContextTokens";
  return read_lengths(kData + "/AzureLLMInferenceTrace_conv.csv", o);
}

std::string npy(const std::string& descr, const std::string& shape, const std::string& data) {
  std::string header =
      "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  while ((10 + header.size() + 1) % 64) header += ' ';
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  return out + header + data;
}

template <class T>
std::string raw(std::initializer_list<T> values, bool big_endian = false) {
  std::string out;
  for (T v : values) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    if (big_endian) std::reverse(b, b + sizeof(T));
    out.append(b, sizeof(T));
  }
  return out;
}

}  // namespace

TEST_CASE(
    "DeepSpeed metric files (MMIDIDX) written by DeepSpeed read as the trace they came from") {
  const auto expected = conv_context_tokens();
  REQUIRE(expected.size() == 19366);
  const auto i64 = read_lengths(kData + "/deepspeed_metric/azure_conv_seqlen_i64");
  const auto u16 = read_lengths(kData + "/deepspeed_metric/azure_conv_seqlen_u16.idx");
  CHECK(i64 == expected);
  CHECK(u16 == expected);
  CHECK(read_lengths(kData + "/deepspeed_metric/azure_conv_seqlen_u16.bin") == expected);
}

TEST_CASE("corrupt and truncated metric files are refused naming file and position") {
  ductile::test::TempDir dir;
  const std::string idx = slurp(kData + "/deepspeed_metric/azure_conv_seqlen_u16.idx");
  const std::string bin = slurp(kData + "/deepspeed_metric/azure_conv_seqlen_u16.bin");
  auto pair = [&](const std::string& name, const std::string& i, const std::string& b) {
    dir.write(name + ".idx", i);
    dir.write(name + ".bin", b);
    return dir.path() / name;
  };
  expect_error(pair("short_bin", idx, bin.substr(0, bin.size() - 10)), ErrorKind::io,
               {"short_bin.bin", "truncated", "sample 19361"});
  expect_error(pair("short_idx", idx.substr(0, idx.size() - 3), bin), ErrorKind::io,
               {"short_idx.idx", "truncated"});
  expect_error(pair("half_header", idx.substr(0, 20), bin), ErrorKind::io, {"truncated"});
  std::string magic = idx;
  magic[0] = 'X';
  expect_error(pair("magic", magic, bin), ErrorKind::io, {"magic.idx", "MMIDIDX"});
  std::string version = idx;
  version[9] = 2;
  expect_error(pair("version", version, bin), ErrorKind::io, {"version 2"});
  std::string dtype = idx;
  dtype[17] = 42;
  expect_error(pair("dtype", dtype, bin), ErrorKind::io, {"dtype code 42"});
  std::string zero = bin;
  zero[10] = 0;  // sample 5 (2 bytes each)
  zero[11] = 0;
  expect_error(pair("zero", idx, zero), ErrorKind::invalid_argument,
               {"zero.bin", "sample 5", "byte offset 10", "length 0"});
  dir.write("lonely.idx", idx);
  expect_error(dir.path() / "lonely", ErrorKind::not_found, {"lonely.bin"});
}

TEST_CASE("text files: one integer a line, errors by line") {
  const auto fortunes = read_lengths(kData + "/debian_fortunes_word_lengths.txt");
  CHECK(fortunes.size() == 14397);
  CHECK(fortunes.front() == 44);
  ductile::test::TempDir dir;
  CHECK(read_lengths(dir.write("crlf.txt", "3\r\n5\r\n8\r\n")) ==
        std::vector<std::int64_t>{3, 5, 8});
  CHECK(read_lengths(dir.write("trailing.txt", "3\n5\n\n")) == std::vector<std::int64_t>{3, 5});
  expect_error(dir.write("word.txt", "3\n4\nabc\n"), ErrorKind::invalid_argument,
               {"word.txt", "line 3", "'abc'"});
  expect_error(dir.write("zero.txt", "3\n0\n"), ErrorKind::invalid_argument,
               {"line 2", "length 0"});
  expect_error(dir.write("neg.txt", "-4\n"), ErrorKind::invalid_argument, {"line 1", "length -4"});
  // An integer too wide for 64 bits is out of range, not "not an integer".
  expect_error(dir.write("wide.txt", "3\n99999999999999999999\n"), ErrorKind::invalid_argument,
               {"line 2: '99999999999999999999' is past the largest integer (2^63-1)",
                "every length must be an integer from 1 to 9223372036854775807"});
  expect_error(dir.write("gap.txt", "3\n\n4\n"), ErrorKind::invalid_argument,
               {"line 2", "empty line"});
  expect_error(dir.write("empty.txt", ""), ErrorKind::invalid_argument, {"empty.txt", "empty"});
  expect_error(dir.path() / "missing.txt", ErrorKind::not_found, {"missing.txt"});
}

TEST_CASE("CSV columns and histograms") {
  const auto conv = conv_context_tokens();
  CHECK(conv.front() == 374);
  LengthReadOptions sharegpt;
  sharegpt.column = "input_tokens";
  CHECK(read_lengths(kData + "/sharegpt_opt_first_turn_lengths.csv", sharegpt).size() == 84226);
  LengthReadOptions hist;
  hist.column = "length";
  hist.count_column = "count";
  const auto squad = read_lengths(kData + "/squad11_bert384_hist.csv", hist);
  CHECK(squad.size() == 88641);
  CHECK(std::is_sorted(squad.begin(), squad.end()));

  ductile::test::TempDir dir;
  LengthReadOptions typo;
  typo.column = "ContextToken";
  expect_error(kData + "/AzureLLMInferenceTrace_conv.csv", ErrorKind::invalid_argument,
               {"no lengths column 'ContextToken'", "did you mean 'ContextTokens'"}, typo);
  expect_error(kData + "/AzureLLMInferenceTrace_conv.csv", ErrorKind::invalid_argument,
               {"3 columns", "--column"});
  CHECK(read_lengths(dir.write("one.csv", "len\n4\n5\n")) == std::vector<std::int64_t>{4, 5});
  LengthReadOptions len;
  len.column = "len";
  expect_error(dir.write("ragged.csv", "id,len\n1,4\n2\n"), ErrorKind::invalid_argument,
               {"line 3", "1 fields", "2 columns"}, len);
  expect_error(dir.write("bad.csv", "id,len\n1,4\n2,x7\n"), ErrorKind::invalid_argument,
               {"line 3", "column 'len'", "'x7'"}, len);
  LengthReadOptions counted;
  counted.column = "len";
  counted.count_column = "n";
  CHECK(read_lengths(dir.write("h.csv", "len,n\n3,2\n\"5\",0\n7,1\n"), counted) ==
        std::vector<std::int64_t>{3, 3, 7});
  expect_error(dir.write("hneg.csv", "len,n\n3,-2\n"), ErrorKind::invalid_argument,
               {"line 2", "column 'n'", "count"}, counted);
  // The expansion is capped (default 2^28 samples) before anything is
  // allocated: a 22-byte file does not ask for gigabytes. The cap is an
  // option, and the message says the row, the column, the count and the cap.
  static_assert(ductile::pipeline::kMaxHistogramSamples == std::int64_t{1} << 28);
  expect_error(dir.write("huge.csv", "len,n\n3,300000000\n"), ErrorKind::invalid_argument,
               {"huge.csv: line 2, column 'n': count 300000000 expands the file to more than "
                "268435456 samples",
                "valid: counts totalling at most 268435456"},
               counted);
  expect_error(dir.write("wide.csv", "len,n\n3,1073741824\n"), ErrorKind::invalid_argument,
               {"count 1073741824 expands"}, counted);
  counted.max_histogram_samples = 4;
  CHECK(read_lengths(dir.write("h4.csv", "len,n\n3,2\n7,2\n"), counted).size() == 4);
  expect_error(
      dir.write("h5.csv", "len,n\n3,2\n7,3\n"), ErrorKind::invalid_argument,
      {"line 3", "count 3 expands the file to more than 4 samples (2 from the rows above)"},
      counted);
}

TEST_CASE("npy arrays of every supported type and byte order") {
  ductile::test::TempDir dir;
  const std::vector<std::int64_t> want{7, 1, 300, 65535};
  CHECK(read_lengths(
            dir.write("a.npy", npy("<i4", "(4,)", raw<std::int32_t>({7, 1, 300, 65535})))) == want);
  CHECK(read_lengths(
            dir.write("b.npy", npy("<i8", "(4,)", raw<std::int64_t>({7, 1, 300, 65535})))) == want);
  CHECK(read_lengths(dir.write(
            "c.npy", npy("<u2", "(4,)", raw<std::uint16_t>({7, 1, 300, 65535})))) == want);
  CHECK(read_lengths(dir.write(
            "d.npy", npy("<u4", "(4, 1)", raw<std::uint32_t>({7, 1, 300, 65535})))) == want);
  CHECK(read_lengths(dir.write(
            "e.npy", npy(">i4", "(4,)", raw<std::int32_t>({7, 1, 300, 65535}, true)))) == want);
  expect_error(dir.write("f.npy", npy("<f8", "(1,)", raw<double>({1.0}))),
               ErrorKind::invalid_argument, {"f.npy", "dtype '<f8'"});
  expect_error(dir.write("short.npy", npy("<i4", "(4,)", raw<std::int32_t>({7, 1, 300}))),
               ErrorKind::io, {"short.npy", "truncated", "4 values"});
  expect_error(dir.write("zero.npy", npy("<i8", "(3,)", raw<std::int64_t>({5, 0, 2}))),
               ErrorKind::invalid_argument, {"element 1", "length 0"});
  expect_error(dir.write("neg.npy", npy("<i4", "(2,)", raw<std::int32_t>({5, -3}))),
               ErrorKind::invalid_argument, {"element 1", "length -3"});
  expect_error(dir.write("matrix.npy", npy("<i4", "(2, 2)", raw<std::int32_t>({1, 2, 3, 4}))),
               ErrorKind::invalid_argument, {"1-D"});
  // Shapes whose element count overflows 64 bits (fuzz findings): refused
  // without computing it.
  expect_error(
      dir.write("wide.npy", npy("<i8", "(49, 999999999999499959)", raw<std::int64_t>({1}))),
      ErrorKind::invalid_argument, {"1-D"});
  expect_error(dir.write("long.npy", npy("<i8", "(2305843009213693953,)", raw<std::int64_t>({1}))),
               ErrorKind::io, {"long.npy", "truncated", "2305843009213693953 values of 8 bytes"});
  expect_error(dir.write("junk.npy", "not numpy at all"), ErrorKind::io, {"junk.npy", "NUMPY"});
  expect_error(dir.write("empty.npy", npy("<i4", "(0,)", "")), ErrorKind::invalid_argument,
               {"empty"});
}

TEST_CASE("length_histogram counts each length and refuses one that would size it past its cap") {
  using ductile::pipeline::kMaxHistogramLength;
  using ductile::pipeline::length_histogram;
  CHECK(length_histogram({3, 1, 3}) == std::vector<std::int64_t>{0, 1, 0, 2});
  static_assert(kMaxHistogramLength == std::int64_t{1} << 27);
  try {
    length_histogram({5, std::int64_t{1} << 62});
    FAIL("a length of 2^62 was accepted");
  } catch (const ductile::Error& e) {
    CHECK(e.kind() == ductile::ErrorKind::invalid_argument);
    CHECK_MESSAGE(std::string(e.what()).find("sample 1 has length 4611686018427387904, above "
                                             "134217728") != std::string::npos,
                  e.what());
  }
}
