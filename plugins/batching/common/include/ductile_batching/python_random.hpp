// Python's random.Random, bit for bit, for what the greedy sampler needs:
// seeding from an integer, getrandbits(k) and shuffle(). DeepSpeed shuffles
// with random.Random(seed).shuffle, so packings in "random" order match it.
#pragma once

#include <cstdint>
#include <span>
#include <utility>

namespace ductile::batching {

class PythonRandom {
 public:
  // random.Random(seed): Python seeds from abs(seed) split into 32-bit words.
  explicit PythonRandom(std::int64_t seed);

  std::uint32_t next_u32();  // genrand_uint32
  // getrandbits(k) for 1 <= k <= 64.
  std::uint64_t getrandbits(int k);
  // _randbelow(n) for n >= 1: rejection sampling on bit_length(n) bits.
  std::uint64_t randbelow(std::uint64_t n);

  // random.shuffle(x): i from n-1 down to 1 swaps x[i] with x[randbelow(i+1)].
  // The swap targets depend only on the generator, so they are drawn a few
  // steps ahead and their cache lines prefetched: on arrays larger than the
  // cache the random accesses, not the generator, set the pace.
  template <class T>
  void shuffle(std::span<T> x) {
    constexpr std::size_t kAhead = 16;
    std::size_t ahead[kAhead];
    const std::size_t n = x.size();
    if (n < 2) return;
    std::size_t drawn = n;  // next i whose target is not yet drawn
    auto draw = [&] {
      --drawn;
      const std::size_t j = static_cast<std::size_t>(randbelow(drawn + 1));
      __builtin_prefetch(&x[j], 1);
      ahead[drawn % kAhead] = j;
    };
    for (std::size_t k = 0; k < kAhead && drawn > 1; ++k) draw();
    for (std::size_t i = n; i-- > 1;) {
      const std::size_t j = ahead[i % kAhead];
      if (drawn > 1) draw();
      std::swap(x[i], x[j]);
    }
  }

 private:
  void init_genrand(std::uint32_t s);
  void init_by_array(const std::uint32_t* key, int length);
  void generate();

  std::uint32_t mt_[624];
  int index_ = 624;
};

}  // namespace ductile::batching
