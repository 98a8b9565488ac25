// The optimal policy's search: the batch size with the most valid GPU counts.
//
// A count n is valid for batch b when m * n divides b for some micro batch m.
// Only micro batches that no other one divides matter (if m2 divides m, every
// b valid through m is valid through m2), so those are dropped first.
// - cap <= kExhaustiveLimit: a sieve over every b in [1, cap] (for each n
//   and m, mark the multiples of m * n, counting each n once per b).
// - larger caps: candidates b = base * k where base is a micro batch or an
//   LCM of several and k a product of primorials (which includes every highly
//   composite number), plus DeepSpeed's v0.1 candidates. Each candidate's
//   count is bounded above by its divisor counts; candidates are evaluated
//   from the highest bound down and the search stops once no bound can reach
//   the best count found.
#include <algorithm>
#include <unordered_set>

#include "search.hpp"

namespace ductile::elastic {
namespace {

// Micro batches (distinct, ascending) that no other one divides.
std::vector<u64> minimal_micro_batches(const std::vector<u64>& micro) {
  MicroBatches distinct(micro);
  std::vector<u64> out;
  for (u64 m : distinct.values)
    if (std::none_of(out.begin(), out.end(), [&](u64 d) { return m % d == 0; })) out.push_back(m);
  return out;
}

bool better(std::size_t count, u64 batch, std::size_t best_count, u64 best_batch,
            bool prefer_larger) {
  if (count != best_count) return count > best_count;
  return prefer_larger ? batch > best_batch : batch < best_batch;
}

SearchOutcome exhaustive(const MicroBatches& micro, u64 cap, u64 lo, u64 hi, bool prefer_larger) {
  std::vector<std::uint32_t> count(cap + 1, 0), last(cap + 1, 0);
  for (u64 n = lo; n <= hi; ++n) {
    for (u64 m : micro.values) {
      const u64 step = m * n;  // m, n <= cap <= 2^21
      if (step > cap) break;   // micro batches ascend
      for (u64 b = step; b <= cap; b += step) {
        if (last[b] == n) continue;
        last[b] = static_cast<std::uint32_t>(n);
        ++count[b];
      }
    }
  }
  u64 best = 0;
  std::uint32_t best_count = 0;
  for (u64 b = 1; b <= cap; ++b) {
    if (count[b] == 0) continue;
    if (count[b] > best_count || (count[b] == best_count && prefer_larger)) {
      best = b;
      best_count = count[b];
    }
  }
  SearchOutcome out;
  out.exhaustive = true;
  if (best_count == 0) return out;
  out.batch = best;
  out.counts = valid_counts(best, factorize(best), micro, lo, hi);
  return out;
}

struct Candidate {
  u64 batch;
  Factorization factors;
  u64 bound;
};

SearchOutcome by_candidates(const MicroBatches& micro, const std::vector<u64>& all_micro, u64 cap,
                            u64 lo, u64 hi, bool prefer_larger) {
  // Bases: LCMs of every non-empty subset of the micro batches (of the first
  // 10 when there are more, then each further one alone and all together).
  std::vector<Factorization> bases;
  const std::size_t subset_count = std::min<std::size_t>(micro.values.size(), 10);
  for (std::size_t mask = 1; mask < (std::size_t{1} << subset_count); ++mask) {
    Factorization f;
    for (std::size_t i = 0; i < subset_count; ++i)
      if (mask & (std::size_t{1} << i)) f = lcm(f, micro.factors[i]);
    bases.push_back(std::move(f));
  }
  Factorization all;
  for (std::size_t i = 0; i < micro.factors.size(); ++i) {
    if (i >= subset_count) bases.push_back(micro.factors[i]);
    all = lcm(all, micro.factors[i]);
  }
  bases.push_back(all);

  std::unordered_set<u64> seen;
  std::vector<Candidate> candidates;
  const u64 range = hi - lo + 1;
  auto add = [&](u64 batch, Factorization factors) {
    if (!seen.insert(batch).second) return;
    u64 bound = 0;
    for (std::size_t i = 0; i < micro.values.size(); ++i) {
      if (batch % micro.values[i] != 0) continue;
      auto q = divide(factors, micro.factors[i]);
      u64 d = divisor_count(*q);
      bound = d > range - bound ? range : bound + d;
    }
    candidates.push_back({batch, std::move(factors), std::min(bound, range)});
  };
  for (const auto& base : bases) {
    auto base_value = value_of(base, cap);
    if (!base_value) continue;
    for_each_primorial_product(cap / *base_value, [&](u64 k, const Factorization& kf) {
      add(*base_value * k, multiply(base, kf));
    });
  }
  // DeepSpeed's v0.1 candidates (a micro batch that another one divides is
  // one of its bases too), so that the result is never worse than v0.1.
  MicroBatches every(all_micro);
  Factorization every_lcm;
  for (const auto& f : every.factors) every_lcm = lcm(every_lcm, f);
  std::vector<Factorization> ds_bases = every.factors;
  ds_bases.push_back(every_lcm);
  for (const auto& base : ds_bases) {
    auto base_value = value_of(base, cap);
    if (!base_value) continue;
    u64 scale = deepspeed_hcn_scale(cap / *base_value);
    add(scale * *base_value, multiply(base, factorize(scale)));
  }

  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return a.bound != b.bound ? a.bound > b.bound : a.batch > b.batch;
  });
  SearchOutcome out;
  std::size_t best_count = 0;
  for (const auto& c : candidates) {
    if (c.bound == 0 || c.bound < best_count) break;
    auto valid = valid_counts(c.batch, c.factors, micro, lo, hi);
    if (!valid.empty() && better(valid.size(), c.batch, best_count, out.batch, prefer_larger)) {
      best_count = valid.size();
      out.batch = c.batch;
      out.counts = std::move(valid);
    }
  }
  return out;
}

}  // namespace

SearchOutcome optimal_search(const std::vector<u64>& micro_in, u64 cap, u64 lo, u64 hi,
                             bool prefer_larger) {
  SearchOutcome none;
  if (cap == 0 || micro_in.empty()) return none;
  MicroBatches micro(minimal_micro_batches(micro_in));
  // No count above cap / smallest micro batch can be valid.
  hi = std::min(hi, cap / micro.smallest());
  if (lo == 0) lo = 1;
  if (lo > hi) return none;
  if (cap <= kExhaustiveLimit) return exhaustive(micro, cap, lo, hi, prefer_larger);
  return by_candidates(micro, micro_in, cap, lo, hi, prefer_larger);
}

}  // namespace ductile::elastic
