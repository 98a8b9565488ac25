#include "elastic_math.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

namespace ductile::elastic {

std::optional<u64> checked_mul(u64 a, u64 b, u64 limit) {
  u64 r;
  if (__builtin_mul_overflow(a, b, &r) || r > limit) return std::nullopt;
  return r;
}

namespace {

using u128 = unsigned __int128;

u64 mulmod(u64 a, u64 b, u64 m) {
  return static_cast<u64>(static_cast<u128>(a) * b % m);
}

u64 powmod(u64 base, u64 exp, u64 m) {
  u64 result = 1 % m;
  base %= m;
  while (exp) {
    if (exp & 1) result = mulmod(result, base, m);
    base = mulmod(base, base, m);
    exp >>= 1;
  }
  return result;
}

// Deterministic for every 64-bit n with these bases.
bool is_prime(u64 n) {
  if (n < 2) return false;
  for (u64 p : {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37})
    if (n % p == 0) return n == p;
  u64 d = n - 1;
  unsigned s = 0;
  while ((d & 1) == 0) d >>= 1, ++s;
  for (u64 a : {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37}) {
    u64 x = powmod(a, d, n);
    if (x == 1 || x == n - 1) continue;
    bool composite = true;
    for (unsigned r = 1; r < s; ++r) {
      x = mulmod(x, x, n);
      if (x == n - 1) {
        composite = false;
        break;
      }
    }
    if (composite) return false;
  }
  return true;
}

// A non-trivial factor of an odd composite n (Brent's variant of Pollard's rho).
u64 find_factor(u64 n) {
  for (u64 c = 1;; ++c) {
    auto step = [&](u64 v) {
      return static_cast<u64>((static_cast<u128>(mulmod(v, v, n)) + c) % n);
    };
    u64 y = 2, x = 2, ys = 2, g = 1, q = 1;
    constexpr u64 batch = 64;
    for (u64 r = 1; g == 1; r <<= 1) {
      x = y;
      for (u64 i = 0; i < r; ++i) y = step(y);
      for (u64 k = 0; k < r && g == 1; k += batch) {
        ys = y;
        for (u64 i = 0; i < std::min(batch, r - k); ++i) {
          y = step(y);
          q = mulmod(q, x > y ? x - y : y - x, n);
        }
        g = std::gcd(q, n);
      }
    }
    if (g == n) {
      do {
        ys = step(ys);
        g = std::gcd(x > ys ? x - ys : ys - x, n);
      } while (g == 1);
    }
    if (g != n) return g;
  }
}

void factor_into(u64 n, std::vector<u64>& primes) {
  if (n == 1) return;
  if (is_prime(n)) {
    primes.push_back(n);
    return;
  }
  u64 d = find_factor(n);
  factor_into(d, primes);
  factor_into(n / d, primes);
}

}  // namespace

Factorization factorize(u64 n) {
  Factorization f;
  if (n <= 1) return f;
  for (u64 p = 2; p < 256 && p * p <= n; p += (p == 2 ? 1 : 2)) {
    if (n % p) continue;
    unsigned e = 0;
    while (n % p == 0) n /= p, ++e;
    f.push_back({p, e});
  }
  if (n > 1) {
    std::vector<u64> big;
    if (n < 256 * 256)
      big.push_back(n);  // no factor below 256, so prime
    else
      factor_into(n, big);
    std::sort(big.begin(), big.end());
    for (u64 p : big) {
      if (!f.empty() && f.back().prime == p)
        ++f.back().exponent;
      else
        f.push_back({p, 1});
    }
  }
  return f;
}

std::optional<u64> value_of(const Factorization& f, u64 limit) {
  u64 v = 1;
  for (const auto& pp : f)
    for (unsigned i = 0; i < pp.exponent; ++i) {
      auto next = checked_mul(v, pp.prime, limit);
      if (!next) return std::nullopt;
      v = *next;
    }
  return v;
}

namespace {

template <class Combine>
Factorization merge(const Factorization& a, const Factorization& b, Combine combine) {
  Factorization out;
  std::size_t i = 0, j = 0;
  while (i < a.size() || j < b.size()) {
    if (j == b.size() || (i < a.size() && a[i].prime < b[j].prime)) {
      out.push_back({a[i].prime, combine(a[i].exponent, 0u)});
      ++i;
    } else if (i == a.size() || b[j].prime < a[i].prime) {
      out.push_back({b[j].prime, combine(0u, b[j].exponent)});
      ++j;
    } else {
      out.push_back({a[i].prime, combine(a[i].exponent, b[j].exponent)});
      ++i, ++j;
    }
    if (out.back().exponent == 0) out.pop_back();
  }
  return out;
}

}  // namespace

Factorization multiply(const Factorization& a, const Factorization& b) {
  return merge(a, b, [](unsigned x, unsigned y) { return x + y; });
}

Factorization lcm(const Factorization& a, const Factorization& b) {
  return merge(a, b, [](unsigned x, unsigned y) { return std::max(x, y); });
}

std::optional<Factorization> divide(const Factorization& a, const Factorization& b) {
  for (const auto& pb : b) {
    auto it =
        std::find_if(a.begin(), a.end(), [&](const PrimePower& p) { return p.prime == pb.prime; });
    if (it == a.end() || it->exponent < pb.exponent) return std::nullopt;
  }
  return merge(a, b, [](unsigned x, unsigned y) { return x - y; });
}

u64 divisor_count(const Factorization& f) {
  u64 count = 1;
  for (const auto& pp : f) {
    auto next = checked_mul(count, pp.exponent + 1u, std::numeric_limits<u64>::max());
    if (!next) return std::numeric_limits<u64>::max();
    count = *next;
  }
  return count;
}

namespace {

void divisors_from(const Factorization& f, std::size_t index, u64 current, u64 lo, u64 hi,
                   std::vector<u64>& out) {
  if (index == f.size()) {
    if (current >= lo) out.push_back(current);
    return;
  }
  u64 v = current;
  const u64 p = f[index].prime;
  for (unsigned e = 0;; ++e) {
    divisors_from(f, index + 1, v, lo, hi, out);
    if (e == f[index].exponent || v > hi / p) break;  // every further product exceeds hi
    v *= p;
  }
}

}  // namespace

void divisors_in_range(const Factorization& f, u64 lo, u64 hi, std::vector<u64>& out) {
  if (hi == 0 || lo > hi) return;
  divisors_from(f, 0, 1, lo, hi, out);
}

const std::vector<u64>& deepspeed_hcn_list() {
  static const std::vector<u64> list = {
      1,      2,      4,      6,      12,     24,     36,     48,    60,    120,
      180,    240,    360,    720,    840,    1260,   1680,   2520,  5040,  7560,
      10080,  15120,  20160,  25200,  27720,  45360,  50400,  55440, 83160, 110880,
      166320, 221760, 277200, 332640, 498960, 554400, 665280, 720720};
  return list;
}

u64 deepspeed_hcn_scale(u64 value) {
  const auto& list = deepspeed_hcn_list();
  // DeepSpeed: index = argmax(HCN > value); HCN[index - 1]. With no HCN above
  // value argmax is 0 and index - 1 picks the last entry.
  auto above = std::upper_bound(list.begin(), list.end(), value);
  if (above == list.end() || above == list.begin()) return list.back();
  return *(above - 1);
}

namespace {

constexpr u64 kSmallPrimes[] = {2,  3,  5,  7,  11, 13, 17, 19, 23, 29, 31, 37, 41,
                                43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97};

void primorial_products(u64 limit, std::size_t index, unsigned max_exponent, u64 value,
                        Factorization& f,
                        const std::function<void(u64, const Factorization&)>& visit) {
  visit(value, f);
  if (index == std::size(kSmallPrimes)) return;
  const u64 p = kSmallPrimes[index];
  u64 v = value;
  for (unsigned e = 1; e <= max_exponent; ++e) {
    if (v > limit / p) break;
    v *= p;
    f.push_back({p, e});
    primorial_products(limit, index + 1, e, v, f, visit);
    f.pop_back();
  }
}

}  // namespace

void for_each_primorial_product(u64 limit,
                                const std::function<void(u64, const Factorization&)>& visit) {
  if (limit == 0) return;
  Factorization f;
  primorial_products(limit, 0, 64, 1, f, visit);
}

}  // namespace ductile::elastic
