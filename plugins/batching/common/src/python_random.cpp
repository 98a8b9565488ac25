// MT19937 as CPython's _randommodule.c uses it (init_by_array seeding).
#include "ductile_batching/python_random.hpp"

#include <bit>

namespace ductile::batching {

PythonRandom::PythonRandom(std::int64_t seed) {
  // abs() of INT64_MIN does not fit; go through the unsigned magnitude.
  std::uint64_t magnitude =
      seed < 0 ? ~static_cast<std::uint64_t>(seed) + 1u : static_cast<std::uint64_t>(seed);
  std::uint32_t key[2] = {static_cast<std::uint32_t>(magnitude),
                          static_cast<std::uint32_t>(magnitude >> 32)};
  // Python uses as many words as the magnitude's bit length needs (one for 0).
  init_by_array(key, (magnitude >> 32) != 0 ? 2 : 1);
}

void PythonRandom::init_genrand(std::uint32_t s) {
  mt_[0] = s;
  for (int i = 1; i < 624; ++i)
    mt_[i] = 1812433253u * (mt_[i - 1] ^ (mt_[i - 1] >> 30)) + static_cast<std::uint32_t>(i);
  index_ = 624;
}

void PythonRandom::init_by_array(const std::uint32_t* key, int length) {
  init_genrand(19650218u);
  int i = 1, j = 0;
  for (int k = 624 > length ? 624 : length; k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1664525u)) + key[j] +
             static_cast<std::uint32_t>(j);
    ++i;
    ++j;
    if (i >= 624) {
      mt_[0] = mt_[623];
      i = 1;
    }
    if (j >= length) j = 0;
  }
  for (int k = 623; k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1566083941u)) -
             static_cast<std::uint32_t>(i);
    ++i;
    if (i >= 624) {
      mt_[0] = mt_[623];
      i = 1;
    }
  }
  mt_[0] = 0x80000000u;
}

void PythonRandom::generate() {
  constexpr std::uint32_t kUpper = 0x80000000u, kLower = 0x7fffffffu, kMatrix = 0x9908b0dfu;
  auto twist = [&](int kk, int next, int far) {
    const std::uint32_t y = (mt_[kk] & kUpper) | (mt_[next] & kLower);
    mt_[kk] = mt_[far] ^ (y >> 1) ^ ((y & 1u) ? kMatrix : 0u);
  };
  int kk = 0;
  for (; kk < 624 - 397; ++kk) twist(kk, kk + 1, kk + 397);
  for (; kk < 623; ++kk) twist(kk, kk + 1, kk + 397 - 624);
  twist(623, 0, 396);
  index_ = 0;
}

std::uint32_t PythonRandom::next_u32() {
  if (index_ >= 624) generate();
  std::uint32_t y = mt_[index_++];
  y ^= (y >> 11);
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= (y >> 18);
  return y;
}

std::uint64_t PythonRandom::getrandbits(int k) {
  if (k <= 32) return next_u32() >> (32 - k);
  // Words are drawn least significant first; only the last is shifted.
  std::uint64_t low = next_u32();
  std::uint64_t high = next_u32() >> (64 - k);
  return low | (high << 32);
}

std::uint64_t PythonRandom::randbelow(std::uint64_t n) {
  const int k = std::bit_width(n);
  std::uint64_t r = getrandbits(k);
  while (r >= n) r = getrandbits(k);
  return r;
}

}  // namespace ductile::batching
