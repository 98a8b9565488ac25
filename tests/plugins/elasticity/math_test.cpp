// The shared arithmetic of the elasticity plugins: factorization up to 2^64,
// divisors in a range, DeepSpeed's HCN scale, primorial products.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>

#include "elastic_math.hpp"

using namespace ductile::elastic;

namespace {

u64 product(const Factorization& f) {
  u64 v = 1;
  for (const auto& p : f)
    for (unsigned i = 0; i < p.exponent; ++i) v *= p.prime;
  return v;
}

bool is_prime_slow(u64 n) {
  if (n < 2) return false;
  for (u64 d = 2; d * d <= n; ++d)
    if (n % d == 0) return false;
  return true;
}

}  // namespace

TEST_CASE("factorize multiplies back and gives primes, small to 2^64") {
  std::mt19937_64 rng(1);
  std::vector<u64> numbers = {1,
                              2,
                              3,
                              4,
                              720720,
                              1000003ull * 1000033ull,
                              4611686018427387847ull,         // prime 2^62 - 57
                              (1ull << 61) - 1,               // Mersenne prime
                              4294967291ull * 4294967279ull,  // two 32-bit primes
                              18446744073709551557ull,        // largest 64-bit prime
                              (1ull << 62)};
  for (int i = 0; i < 200; ++i) numbers.push_back(rng() >> (i % 40));
  for (u64 n : numbers) {
    if (n == 0) continue;
    CAPTURE(n);
    auto f = factorize(n);
    CHECK(product(f) == n);
    for (std::size_t i = 0; i < f.size(); ++i) {
      if (f[i].prime < (1u << 20)) CHECK(is_prime_slow(f[i].prime));
      if (i) CHECK(f[i - 1].prime < f[i].prime);
    }
  }
  CHECK(factorize(4294967291ull * 4294967279ull).size() == 2);
}

TEST_CASE("divisors_in_range equals trial division") {
  for (u64 n : {1ull, 12ull, 720720ull, 997ull * 991ull, 1ull << 20}) {
    for (auto [lo, hi] : std::vector<std::pair<u64, u64>>{{1, n}, {3, 50}, {100, 100}, {7, 5}}) {
      std::vector<u64> got;
      divisors_in_range(factorize(n), lo, hi, got);
      std::sort(got.begin(), got.end());
      std::vector<u64> want;
      for (u64 d = lo; d <= std::min(hi, n); ++d)
        if (n % d == 0) want.push_back(d);
      CAPTURE(n);
      CHECK(got == want);
    }
  }
}

TEST_CASE("DeepSpeed's HCN scale: largest listed HCN <= value, 720720 beyond the table") {
  CHECK(deepspeed_hcn_scale(1) == 1);
  CHECK(deepspeed_hcn_scale(5) == 4);
  CHECK(deepspeed_hcn_scale(6) == 6);
  CHECK(deepspeed_hcn_scale(719999) == 665280);
  CHECK(deepspeed_hcn_scale(720720) == 720720);
  CHECK(deepspeed_hcn_scale(u64{1} << 40) == 720720);
  CHECK(deepspeed_hcn_list().size() == 38);
}

TEST_CASE("primorial products are complete, distinct and contain the HCNs") {
  std::vector<u64> seen;
  for_each_primorial_product(100000, [&](u64 k, const Factorization& f) {
    CHECK(product(f) == k);
    seen.push_back(k);
  });
  std::sort(seen.begin(), seen.end());
  CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end());
  for (u64 h : deepspeed_hcn_list())
    if (h <= 100000) CHECK(std::binary_search(seen.begin(), seen.end(), h));
  // Brute force: k qualifies iff its exponents over 2, 3, 5, ... never increase.
  std::size_t expected = 0;
  for (u64 k = 1; k <= 100000; ++k) {
    auto f = factorize(k);
    bool ok = true;
    const u64 primes[] = {2, 3, 5, 7, 11, 13, 17};
    unsigned previous = 64;
    std::size_t used = 0;
    for (u64 p : primes) {
      unsigned e = 0;
      for (const auto& pp : f)
        if (pp.prime == p) e = pp.exponent;
      if (e > previous) ok = false;
      previous = e;
      used += e > 0;
    }
    ok = ok && used == f.size();
    expected += ok;
  }
  CHECK(seen.size() == expected);
}

TEST_CASE("checked_mul refuses results above the limit") {
  CHECK(checked_mul(u64{1} << 31, u64{1} << 31) == (u64{1} << 62));
  CHECK_FALSE(checked_mul((u64{1} << 31) + 1, u64{1} << 31).has_value());
  CHECK_FALSE(checked_mul(~u64{0}, 2, ~u64{0}).has_value());
  CHECK(value_of(factorize(720720)) == 720720u);
  CHECK_FALSE(value_of(factorize(720720), 1000).has_value());
}
