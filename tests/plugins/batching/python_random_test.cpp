// Python random.Random compatibility, against values Python 3 produced
// (data/python_random_expected.txt, written by data/gen_python_random.py).
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "ductile_batching/python_random.hpp"

using ductile::batching::PythonRandom;

namespace {

std::vector<std::string> expectation_lines(const std::string& kind) {
  std::ifstream in(std::string(BATCHING_TEST_DATA) + "/python_random_expected.txt");
  REQUIRE(in.good());
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(kind + " ", 0) == 0) out.push_back(line.substr(kind.size() + 1));
  REQUIRE(!out.empty());
  return out;
}

}  // namespace

TEST_CASE("getrandbits matches Python for 1..64 bits and every seed width") {
  for (const auto& line : expectation_lines("bits")) {
    std::istringstream in(line);
    std::int64_t seed = 0;
    int k = 0;
    in >> seed >> k;
    PythonRandom rng(seed);
    for (int i = 0; i < 4; ++i) {
      std::uint64_t want = 0;
      in >> want;
      INFO("seed ", seed, " bits ", k, " draw ", i);
      CHECK(rng.getrandbits(k) == want);
    }
  }
}

TEST_CASE("shuffle matches random.Random(seed).shuffle element for element") {
  for (const auto& line : expectation_lines("shuffle")) {
    std::istringstream in(line);
    std::int64_t seed = 0;
    std::size_t n = 0;
    in >> seed >> n;
    std::vector<std::int64_t> x(n), want(n);
    for (std::size_t i = 0; i < n; ++i) {
      x[i] = static_cast<std::int64_t>(i);
      in >> want[i];
    }
    PythonRandom(seed).shuffle(std::span<std::int64_t>(x));
    INFO("seed ", seed, " n ", n);
    CHECK(x == want);
  }
}

TEST_CASE("long shuffles match Python's (checksum over 100000 elements)") {
  constexpr unsigned __int128 kMod = (static_cast<unsigned __int128>(1) << 61) - 1;
  for (const auto& line : expectation_lines("shufflesum")) {
    std::istringstream in(line);
    std::int64_t seed = 0;
    std::size_t n = 0;
    std::uint64_t want = 0;
    in >> seed >> n >> want;
    std::vector<std::int64_t> x(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<std::int64_t>(i);
    PythonRandom(seed).shuffle(std::span<std::int64_t>(x));
    unsigned __int128 sum = 0;
    for (std::size_t i = 0; i < n; ++i)
      sum = (sum + static_cast<unsigned __int128>(i) * static_cast<std::uint64_t>(x[i])) % kMod;
    INFO("seed ", seed, " n ", n);
    CHECK(static_cast<std::uint64_t>(sum) == want);
  }
}

TEST_CASE("negative seeds behave as their absolute value, as in Python") {
  PythonRandom a(-12345), b(12345);
  for (int i = 0; i < 100; ++i) CHECK(a.next_u32() == b.next_u32());
}
