// Exact integer arithmetic for the elasticity policies: overflow-checked
// products, factorization (trial division, Miller-Rabin, Pollard-Brent), and
// divisors within a range enumerated from a factorization, so that no search
// ever loops up to a GPU count or a batch size.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace ductile::elastic {

using u64 = std::uint64_t;

// Every configuration value must stay at or below this (2^62): products of
// two admitted values are then checked rather than assumed to fit.
inline constexpr u64 kMaxValue = u64{1} << 62;

// a * b, or nullopt when it exceeds `limit`.
std::optional<u64> checked_mul(u64 a, u64 b, u64 limit = kMaxValue);

struct PrimePower {
  u64 prime;
  unsigned exponent;
};
// Prime factors in increasing order; 1 has none.
using Factorization = std::vector<PrimePower>;

// n >= 1. Fast for n <= 2^40 (microseconds); correct up to 2^64.
Factorization factorize(u64 n);
// The value of a factorization; nullopt if it exceeds `limit`.
std::optional<u64> value_of(const Factorization& f, u64 limit = kMaxValue);
Factorization multiply(const Factorization& a, const Factorization& b);
Factorization lcm(const Factorization& a, const Factorization& b);
// a / b when b divides a.
std::optional<Factorization> divide(const Factorization& a, const Factorization& b);
// Number of divisors, saturating at UINT64_MAX.
u64 divisor_count(const Factorization& f);

// Appends every divisor d of the number with lo <= d <= hi (unsorted).
void divisors_in_range(const Factorization& f, u64 lo, u64 hi, std::vector<u64>& out);

// DeepSpeed's table of the 38 smallest highly composite numbers (up to
// 720720).
const std::vector<u64>& deepspeed_hcn_list();
// DeepSpeed's scale for a base: the largest listed HCN <= value (value >= 1);
// 720720 for anything larger, as DeepSpeed's table ends there.
u64 deepspeed_hcn_scale(u64 value);

// Calls visit(k, factorization of k) for every k <= limit whose prime
// exponents do not increase with the prime (2^a 3^b 5^c ... with a >= b >=
// c ...): the products of primorials, which include every highly composite
// number.
void for_each_primorial_product(u64 limit,
                                const std::function<void(u64, const Factorization&)>& visit);

}  // namespace ductile::elastic
