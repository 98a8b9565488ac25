// Batching sampler "bfd": decreasing-order bin packing to the fewest
// micro-batches under the token budget, deterministic.
//
// Samples of one length are interchangeable, so packing works on the
// histogram of distinct lengths, never on single samples:
// - a micro-batch opens with the longest sample left, is filled with the
//   longest samples that still fit (first-fit decreasing, bin by bin), and
//   its last two free slots, when max_batch_size limits the count, take the
//   best pair (largest total that fits, ties to the longer first sample):
//   with at most 3 samples per micro-batch that choice is what matters;
// - the chosen composition ("template") is repeated as many times as the
//   counts allow before anything changes, so the work grows with the number
//   of distinct lengths, not of samples; sample ids are then dealt out in
//   ascending order within each length.
// With the padded budget (samples x longest <= max_tokens) micro-batches are
// runs of the length-sorted samples, each as long as its first sample allows.
#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <string_view>

#include <fmt/format.h>

#include "ductile/batch_sampler.hpp"
#include "ductile_batching/options.hpp"
#include "ductile_batching/packing.hpp"
#include "plan.hpp"

namespace {

using ductile::batching::Candidate;
using ductile::batching::Microbatches;

// A set of indices 0..n-1 with "next member >= i" in O(log64 n).
class IndexSet {
 public:
  explicit IndexSet(std::size_t n) {
    std::size_t size = n;
    do {
      const std::size_t words = (size + 63) / 64;
      std::vector<std::uint64_t> level(words, ~std::uint64_t{0});
      if (size % 64) level.back() = (std::uint64_t{1} << (size % 64)) - 1;
      levels_.push_back(std::move(level));
      size = words;
    } while (size > 1);
  }
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  void erase(std::size_t i) {
    for (auto& level : levels_) {
      level[i / 64] &= ~(std::uint64_t{1} << (i % 64));
      if (level[i / 64] != 0) return;
      i /= 64;
    }
  }
  std::size_t next(std::size_t i) const { return next_at(0, i); }

 private:
  std::size_t next_at(std::size_t depth, std::size_t i) const {
    const auto& level = levels_[depth];
    std::size_t w = i / 64;
    if (w >= level.size()) return npos;
    std::uint64_t bits = level[w] & (~std::uint64_t{0} << (i % 64));
    if (bits == 0) {
      if (depth + 1 == levels_.size()) return npos;
      w = next_at(depth + 1, w + 1);
      if (w == npos) return npos;
      bits = level[w];
    }
    return w * 64 + static_cast<std::size_t>(std::countr_zero(bits));
  }
  std::vector<std::vector<std::uint64_t>> levels_;
};

class BfdSampler final : public ductile::BatchSampler {
 public:
  explicit BfdSampler(const ductile::HostContext& ctx)
      : options_(ductile::batching::options_from_params(ctx.params())), warnings_(ctx.logger()) {
    ductile::batching::check_options(options_, "bfd");
  }

  // The validate hook: `ductile config check` reports inconsistent options.
  static void validate(const ductile::Params& params, std::string_view) {
    ductile::batching::check_options(ductile::batching::options_from_params(params), "bfd");
  }

  const ductile::PackOptions& options() const override { return options_; }

  ductile::PackResult pack(const ductile::PackRequest& request) const override {
    std::vector<std::int64_t> dropped, leftover;
    const bool small_budget = options_.max_tokens <= (std::int64_t{1} << 22);
    if (!request.subset && !request.lengths.empty() && small_budget &&
        options_.budget == ductile::TokenBudget::sum && options_.min_batch_size <= 1 &&
        !(options_.same_size_microbatches && options_.effective_batch_size > 1)) {
      // Whole data set, nothing to repair: the plan is written straight into
      // the result (see plan.hpp), the same micro-batches as below.
      auto classes = ductile::bfd::count_lengths(request.lengths, options_.max_tokens, dropped);
      warn_dropped(dropped.size());
      ductile::bfd::Plan plan = best_plan(classes);
      return ductile::bfd::emit_plan(plan, classes, request.lengths, options_, std::move(dropped));
    }
    Microbatches bins;
    if (!request.subset && !request.lengths.empty() &&
        options_.max_tokens <= (std::int64_t{1} << 22)) {
      // Whole data set, small budget: the histogram straight from the
      // lengths, without an intermediate list of samples.
      bins =
          pack_histogram(histogram_of_lengths(request.lengths, dropped), request.lengths, leftover);
    } else {
      auto candidates = ductile::batching::collect_candidates(request);
      dropped = ductile::batching::drop_too_long(candidates, options_.max_tokens, &warnings_);
      bins = pack_all(std::move(candidates), request.lengths, leftover);
    }
    if (options_.same_size_microbatches && options_.effective_batch_size > 1)
      bins = equalize_steps(std::move(bins), request.lengths, leftover);
    return ductile::batching::assemble_steps(std::move(bins), request.lengths, options_,
                                             std::move(leftover), std::move(dropped));
  }

 private:
  // Samples grouped by length: distinct lengths descending, and for each the
  // ids (ascending) at ids[start[d] .. start[d] + count[d]).
  struct Histogram : ductile::bfd::LengthClasses {
    std::vector<std::size_t> start;
    std::vector<std::int64_t> ids;
  };

  // Groups samples by length, lengths descending, ids ascending within a
  // length: a counting sort when lengths are small integers.
  static Histogram histogram_of(std::vector<Candidate>& c) {
    Histogram h;
    std::int64_t max_len = 0;
    for (const auto& x : c) max_len = std::max(max_len, x.length);
    const bool ids_ascending = std::is_sorted(
        c.begin(), c.end(), [](const Candidate& a, const Candidate& b) { return a.id < b.id; });
    h.ids.resize(c.size());
    if (ids_ascending && max_len <= (std::int64_t{1} << 22) &&
        static_cast<std::size_t>(max_len) <= 4 * c.size() + 1024) {
      std::vector<std::size_t> pos(static_cast<std::size_t>(max_len) + 1, 0);
      for (const auto& x : c) ++pos[static_cast<std::size_t>(x.length)];
      std::size_t next = 0;
      for (std::int64_t len = max_len; len >= 1; --len) {
        const std::size_t n = pos[static_cast<std::size_t>(len)];
        if (n == 0) continue;
        h.length.push_back(len);
        h.count.push_back(static_cast<std::int64_t>(n));
        h.start.push_back(next);
        pos[static_cast<std::size_t>(len)] = next;
        next += n;
      }
      for (const auto& x : c) h.ids[pos[static_cast<std::size_t>(x.length)]++] = x.id;
      return h;
    }
    std::sort(c.begin(), c.end(), [](const Candidate& a, const Candidate& b) {
      return a.length != b.length ? a.length > b.length : a.id < b.id;
    });
    for (std::size_t i = 0; i < c.size(); ++i) {
      if (i == 0 || c[i].length != c[i - 1].length) {
        h.length.push_back(c[i].length);
        h.count.push_back(0);
        h.start.push_back(i);
      }
      ++h.count.back();
      h.ids[i] = c[i].id;
    }
    return h;
  }

  bool fits(std::int64_t tokens, std::int64_t longest, std::int64_t count) const {
    if (options_.budget == ductile::TokenBudget::padded)
      return count * longest <= options_.max_tokens;
    return tokens <= options_.max_tokens;
  }

  // Packs `items` into micro-batches that satisfy every per-micro-batch
  // constraint; samples that cannot be placed validly go to `leftover`.
  // Same result as collect_candidates + drop_too_long + histogram_of for a
  // request without subset (lengths descending, ids ascending).
  Histogram histogram_of_lengths(std::span<const std::int64_t> lengths,
                                 std::vector<std::int64_t>& dropped) const {
    const auto cap = static_cast<std::size_t>(options_.max_tokens);
    std::vector<std::size_t> pos(cap + 1, 0);
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      const std::int64_t len = lengths[i];
      if (len < 1)
        throw ductile::Error(
            ductile::ErrorKind::invalid_argument,
            fmt::format("sample {} has length {}; every length must be >= 1", i, len));
      if (len > options_.max_tokens)
        dropped.push_back(static_cast<std::int64_t>(i));
      else
        ++pos[static_cast<std::size_t>(len)];
    }
    warn_dropped(dropped.size());
    Histogram h;
    std::size_t next = 0;
    for (std::size_t len = cap; len >= 1; --len) {
      const std::size_t n = pos[len];
      if (n == 0) continue;
      h.length.push_back(static_cast<std::int64_t>(len));
      h.count.push_back(static_cast<std::int64_t>(n));
      h.start.push_back(next);
      pos[len] = next;
      next += n;
    }
    h.ids.resize(next);
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      const std::int64_t len = lengths[i];
      if (len <= options_.max_tokens)
        h.ids[pos[static_cast<std::size_t>(len)]++] = static_cast<std::int64_t>(i);
    }
    return h;
  }

  Microbatches pack_all(std::vector<Candidate> items, std::span<const std::int64_t> lengths,
                        std::vector<std::int64_t>& leftover) const {
    if (items.empty()) return {};
    Histogram h = histogram_of(items);
    items = {};
    return pack_histogram(std::move(h), lengths, leftover);
  }

  Microbatches pack_histogram(Histogram h, std::span<const std::int64_t> lengths,
                              std::vector<std::int64_t>& leftover) const {
    Microbatches bins;
    if (h.ids.empty()) return bins;
    bins.ids.reserve(h.ids.size());
    bins.offsets.reserve(h.ids.size() / 2 + 2);
    if (options_.budget == ductile::TokenBudget::padded)
      pack_padded(h, bins);
    else
      pack_sum(h, bins);
    if (options_.min_batch_size > 1) repair_small(bins, lengths, leftover);
    return bins;
  }

  void pack_padded(const Histogram& h, Microbatches& bins) const {
    const std::size_t n = h.ids.size();
    std::size_t d = 0;  // distinct length of position i
    for (std::size_t i = 0; i < n;) {
      while (i >= h.start[d] + static_cast<std::size_t>(h.count[d])) ++d;
      const std::int64_t longest = h.length[d];
      auto room = static_cast<std::size_t>(options_.max_tokens / longest);
      if (options_.max_batch_size > 0)
        room = std::min(room, static_cast<std::size_t>(options_.max_batch_size));
      const std::size_t end = std::min(n, i + room);
      bins.ids.insert(bins.ids.end(), h.ids.begin() + static_cast<std::ptrdiff_t>(i),
                      h.ids.begin() + static_cast<std::ptrdiff_t>(end));
      bins.close(longest);
      i = end;
    }
  }

  using Plan = ductile::bfd::Plan;

  // Plans the packing of a histogram. `balance` steers the best-pair choice
  // among equally good fills: the longer of the pair is chosen closest to
  // balance x the room left for the pair (0.5: two similar samples, 1: one
  // long and one very short).
  // fit_from[room] = the first length index whose length is <= room, for
  // every room up to max_tokens: one load instead of a binary search in the
  // planner's innermost loops. Empty (binary search) above 2^20 tokens.
  std::vector<std::uint32_t> fitting_table(const ductile::bfd::LengthClasses& h) const {
    std::vector<std::uint32_t> fit_from;
    const std::int64_t cap = options_.max_tokens;
    if (cap > (std::int64_t{1} << 20)) return fit_from;
    fit_from.resize(static_cast<std::size_t>(cap) + 1);
    std::size_t index = h.length.size();
    for (std::int64_t room = 0; room <= cap; ++room) {
      while (index > 0 && h.length[index - 1] <= room) --index;
      fit_from[static_cast<std::size_t>(room)] = static_cast<std::uint32_t>(index);
    }
    return fit_from;
  }

  Plan plan_sum(const ductile::bfd::LengthClasses& h, double balance, bool two_fit,
                const std::vector<std::uint32_t>& fit_from) const {
    Plan plan;
    const std::size_t kinds = h.length.size();
    std::vector<std::int64_t> count(h.count);
    IndexSet available(kinds);
    const std::int64_t cap = options_.max_tokens;
    const std::int64_t max_count = options_.max_batch_size > 0 ? options_.max_batch_size : -1;
    // Uses of each length by the template being built (few entries).
    std::vector<std::pair<std::size_t, std::int64_t>> uses;
    std::vector<std::size_t> members;
    auto used = [&](std::size_t d) {
      for (const auto& [k, u] : uses)
        if (k == d) return u;
      return std::int64_t{0};
    };
    auto take = [&](std::size_t d) {
      members.push_back(d);
      for (auto& [k, u] : uses)
        if (k == d) {
          ++u;
          return;
        }
      uses.emplace_back(d, 1);
    };
    // First length index whose length is <= room.
    auto first_fitting = [&](std::int64_t room) {
      if (!fit_from.empty())
        return static_cast<std::size_t>(fit_from[static_cast<std::size_t>(room)]);
      return static_cast<std::size_t>(
          std::lower_bound(h.length.begin(), h.length.end(), room, std::greater<>()) -
          h.length.begin());
    };
    // Next length index >= i with at least `need` samples not yet in the template.
    auto next_left = [&](std::size_t i, std::int64_t need) {
      for (std::size_t d = available.next(i); d != IndexSet::npos; d = available.next(d + 1))
        if (count[d] - used(d) >= need) return d;
      return IndexSet::npos;
    };

    auto untake = [&](std::size_t d) {
      members.pop_back();
      for (std::size_t i = 0; i < uses.size(); ++i)
        if (uses[i].first == d && --uses[i].second == 0)
          uses.erase(uses.begin() + static_cast<std::ptrdiff_t>(i));
    };
    // Best pair for `room`: the largest total that fits; among equal totals
    // the one whose longer sample is closest to balance x room (then the
    // longer). c may be npos (a single sample fills best).
    struct Pair {
      std::size_t b = IndexSet::npos, c = IndexSet::npos;
      std::int64_t sum = 0;
    };
    auto find_pair = [&](std::int64_t room, bool first_exact) {
      const double target = balance * static_cast<double>(room);
      Pair best;
      double best_distance = 0;
      int tries = 0;
      for (std::size_t b = next_left(first_fitting(room), 1); b != IndexSet::npos;
           b = next_left(b + 1, 1)) {
        // The scan is bounded so that data with many distinct lengths stays
        // linear in the number of samples.
        if (2 * h.length[b] < best.sum || ++tries > 512) break;
        const std::int64_t rest = room - h.length[b];
        std::size_t c = IndexSet::npos;
        if (rest > 0) {
          const std::size_t from = std::max(first_fitting(rest), b);
          if (from == b)  // b itself fits twice when two of it are left
            c = count[b] - used(b) >= 2 ? b : next_left(b + 1, 1);
          else
            c = next_left(from, 1);
        }
        const std::int64_t sum = h.length[b] + (c == IndexSet::npos ? 0 : h.length[c]);
        const double distance = std::abs(static_cast<double>(h.length[b]) - target);
        if (sum > best.sum || (sum == best.sum && distance < best_distance)) {
          best = {b, c, sum};
          best_distance = distance;
          if (first_exact && sum == room) break;
        }
      }
      return best;
    };

    for (std::size_t first = available.next(0); first != IndexSet::npos;
         first = available.next(0)) {
      uses.clear();
      members.clear();
      take(first);
      std::int64_t room = cap - h.length[first];
      std::int64_t slots = max_count < 0 ? -1 : max_count - 1;
      // Longest that fits, while more than two slots are left.
      while (room > 0 && (slots < 0 || slots > 2)) {
        const std::size_t d = next_left(first_fitting(room), 1);
        if (d == IndexSet::npos) break;
        take(d);
        room -= h.length[d];
        if (slots > 0) --slots;
      }
      if (room > 0 && slots == 2) {
        const Pair pair = find_pair(room, false);
        if (pair.b != IndexSet::npos) {
          take(pair.b);
          if (pair.c != IndexSet::npos) take(pair.c);
        }
      } else if (room > 0 && slots == 1) {
        const std::size_t d = next_left(first_fitting(room), 1);
        if (d != IndexSet::npos) take(d);
      } else if (two_fit && room > 0 && members.size() >= 2) {
        // Nothing more fits: the last (shortest) sample may give way to a
        // pair that fills more ("best two fit").
        const std::size_t last = members.back();
        untake(last);
        const Pair pair = find_pair(room + h.length[last], true);
        if (pair.b != IndexSet::npos && pair.sum > h.length[last]) {
          take(pair.b);
          if (pair.c != IndexSet::npos) take(pair.c);
        } else {
          take(last);
        }
      }
      // Repeat the template while every length it uses has enough samples.
      std::int64_t repeat = INT64_MAX;
      for (const auto& [d, u] : uses) repeat = std::min(repeat, count[d] / u);
      plan.members.insert(plan.members.end(), members.begin(), members.end());
      plan.template_start.push_back(plan.members.size());
      plan.repeat.push_back(repeat);
      plan.bins += repeat;
      for (const auto& [d, u] : uses) {
        count[d] -= u * repeat;
        if (count[d] == 0) available.erase(d);
      }
    }
    return plan;
  }

  // The plan with the fewest micro-batches among the balances and
  // best-two-fit settings tried.
  Plan best_plan(const ductile::bfd::LengthClasses& h) const {
    // With a small max_batch_size the pair choice decides the outcome and no
    // single balance suits every length distribution: plans are cheap (they
    // work on distinct lengths), so try a range and keep the fewest bins.
    // Histogram-like data (few distinct lengths) keeps the sweep cheap; with
    // thousands of distinct lengths one balanced plan is used. Best two fit
    // helps most distributions but not all, so with and without are compared.
    const bool sweep = options_.max_batch_size > 2 && h.length.size() <= 1024;
    const bool try_two_fit = options_.max_batch_size == 0 || options_.max_batch_size > 3;
    // The balanced best-two-fit plan first: it is the one that most often
    // reaches the lower bound, and then no other is made.
    const auto fit_from = fitting_table(h);
    const std::int64_t fewest = fewest_bins(h);
    Plan best = plan_sum(h, 0.5, try_two_fit, fit_from);
    for (int two_fit = 0; two_fit <= (try_two_fit ? 1 : 0); ++two_fit) {
      for (int step = 0; step <= (sweep ? 50 : 0); ++step) {
        if (step == 0 && two_fit == (try_two_fit ? 1 : 0)) continue;  // made first
        // No plan has fewer bins than the bound: stop once one reaches it.
        if (best.bins <= fewest) return best;
        Plan candidate = plan_sum(h, 0.5 + 0.01 * step, two_fit == 1, fit_from);
        if (candidate.bins < best.bins) best = std::move(candidate);
      }
    }
    return best;
  }

  // A lower bound on the micro-batches of any packing: the tokens over the
  // budget, and the samples over max_batch_size, rounded up. 128-bit sums:
  // counts times lengths may pass 2^63 (lengths <= 2^31, any count).
  std::int64_t fewest_bins(const ductile::bfd::LengthClasses& h) const {
    unsigned __int128 tokens = 0, samples = 0;
    for (std::size_t d = 0; d < h.length.size(); ++d) {
      tokens +=
          static_cast<unsigned __int128>(h.length[d]) * static_cast<unsigned __int128>(h.count[d]);
      samples += static_cast<unsigned __int128>(h.count[d]);
    }
    const auto cap = static_cast<unsigned __int128>(options_.max_tokens);
    unsigned __int128 bound = (tokens + cap - 1) / cap;
    if (options_.max_batch_size > 0) {
      const auto most = static_cast<unsigned __int128>(options_.max_batch_size);
      bound = std::max(bound, (samples + most - 1) / most);
    }
    // Every sample fits a bin on its own, so bound <= samples < 2^63.
    return static_cast<std::int64_t>(bound);
  }

  void pack_sum(const Histogram& h, Microbatches& bins) const {
    const Plan best = best_plan(h);
    std::vector<std::size_t> cursor(h.start);
    for (std::size_t t = 0; t + 1 < best.template_start.size(); ++t) {
      for (std::int64_t r = 0; r < best.repeat[t]; ++r) {
        for (std::size_t m = best.template_start[t]; m < best.template_start[t + 1]; ++m) {
          const std::size_t d = best.members[m];
          bins.ids.push_back(h.ids[cursor[d]++]);
        }
        bins.close(h.length[best.members[best.template_start[t]]]);
      }
    }
  }

  // Micro-batches with fewer than min_batch_size samples are dissolved and
  // their samples packed again shortest first, which gives the most samples
  // per micro-batch; what still cannot reach the minimum is left over.
  void repair_small(Microbatches& bins, std::span<const std::int64_t> lengths,
                    std::vector<std::int64_t>& leftover) const {
    const auto min_count = static_cast<std::size_t>(options_.min_batch_size);
    Microbatches kept;
    std::vector<Candidate> small;
    for (std::size_t i = 0; i < bins.count(); ++i) {
      const auto* first = bins.ids.data() + bins.offsets[i];
      if (bins.size(i) >= min_count) {
        kept.ids.insert(kept.ids.end(), first, first + bins.size(i));
        kept.close();
      } else {
        for (std::size_t k = 0; k < bins.size(i); ++k)
          small.push_back({lengths[static_cast<std::size_t>(first[k])], first[k]});
      }
    }
    if (small.empty()) return;
    std::sort(small.begin(), small.end(), [](const Candidate& a, const Candidate& b) {
      return a.length != b.length ? a.length < b.length : a.id < b.id;
    });
    const auto max_count = options_.max_batch_size > 0
                               ? static_cast<std::size_t>(options_.max_batch_size)
                               : static_cast<std::size_t>(-1);
    std::size_t i = 0;
    while (i < small.size()) {
      std::int64_t tokens = 0, longest = 0;
      std::size_t j = i;
      while (j < small.size() && j - i < max_count &&
             fits(tokens + small[j].length, std::max(longest, small[j].length),
                  static_cast<std::int64_t>(j - i + 1))) {
        tokens += small[j].length;
        longest = std::max(longest, small[j].length);
        ++j;
      }
      if (j - i < min_count) break;  // the shortest samples left cannot reach the minimum
      for (std::size_t k = i; k < j; ++k) kept.ids.push_back(small[k].id);
      kept.close();
      i = j;
    }
    for (; i < small.size(); ++i) leftover.push_back(small[i].id);
    bins = std::move(kept);
  }

  // Makes every step's micro-batches equally large: micro-batches are sorted
  // by size and taken effective_batch_size at a time; each group is cut to
  // its smallest member (the shortest samples of the larger ones come off)
  // and what comes off is packed again, a few rounds at most.
  Microbatches equalize_steps(Microbatches pool, std::span<const std::int64_t> lengths,
                              std::vector<std::int64_t>& leftover) const {
    const auto width = static_cast<std::size_t>(options_.effective_batch_size);
    Microbatches out;
    for (int round = 0; round < 64 && pool.count() > 0; ++round) {
      std::vector<std::size_t> order(pool.count());
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t a, std::size_t b) { return pool.size(a) > pool.size(b); });
      std::vector<Candidate> excess;
      const std::size_t groups = order.size() / width;
      for (std::size_t g = 0; g < groups; ++g) {
        std::size_t target = static_cast<std::size_t>(-1);
        for (std::size_t b = 0; b < width; ++b)
          target = std::min(target, pool.size(order[g * width + b]));
        for (std::size_t b = 0; b < width; ++b) {
          const std::size_t m = order[g * width + b];
          for (std::size_t k = 0; k < pool.size(m); ++k) {
            const std::int64_t id = pool.ids[pool.offsets[m] + k];
            if (k < target)
              out.ids.push_back(id);
            else
              excess.push_back({lengths[static_cast<std::size_t>(id)], id});
          }
          out.close();
        }
      }
      for (std::size_t i = groups * width; i < order.size(); ++i) {
        const std::size_t m = order[i];
        for (std::size_t k = 0; k < pool.size(m); ++k) {
          const std::int64_t id = pool.ids[pool.offsets[m] + k];
          excess.push_back({lengths[static_cast<std::size_t>(id)], id});
        }
      }
      if (excess.empty()) return out;
      if (groups == 0 || round == 63) {  // too few micro-batches left for one step
        for (const auto& c : excess) leftover.push_back(c.id);
        break;
      }
      std::sort(excess.begin(), excess.end(),
                [](const Candidate& a, const Candidate& b) { return a.id < b.id; });
      pool = pack_all(std::move(excess), lengths, leftover);
    }
    return out;
  }

  void warn_dropped(std::size_t dropped) const {
    ductile::batching::warn_dropped(&warnings_, dropped, options_.max_tokens);
  }

  ductile::PackOptions options_;
  // Packing the same data again gives the same warning: logged once, counted.
  mutable ductile::batching::RepeatedWarnings warnings_;
};

constexpr ductile::ParamSpec kSchema[] = {
    ductile::batching::kMaxTokensParam,    ductile::batching::kMinBatchSizeParam,
    ductile::batching::kMaxBatchSizeParam, ductile::batching::kEffectiveBatchSizeParam,
    ductile::batching::kSameSizeParam,     ductile::batching::kBudgetParam,
};

}  // namespace

DUCTILE_PLUGIN(BfdSampler, "bfd", "1.0.0",
               "best-fit-decreasing token-budget packing to the fewest micro-batches", kSchema)
