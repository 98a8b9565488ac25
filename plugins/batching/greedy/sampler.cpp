// Batching sampler "greedy": DeepSpeed's batch_by_seqlens in linear time.
//
// DeepSpeed tries every end position of the next group of samples and keeps
// the last valid one (quadratic). Validity is an interval in the end position
// (sample count and tokens only grow), so the last valid end is the furthest
// one the upper limits allow, provided it reaches min_batch_size: one
// forward scan per group. DeepSpeed's scan stops one sample short of the end
// (its range() excludes the last end); we reproduce that exactly, then pack
// what it leaves with the same rule allowed to reach the end.
#include <algorithm>
#include <string_view>

#include "ductile/batch_sampler.hpp"
#include "ductile_batching/options.hpp"
#include "ductile_batching/packing.hpp"

namespace {

using ductile::batching::Candidate;
using ductile::batching::Microbatches;

class GreedySampler final : public ductile::BatchSampler {
 public:
  explicit GreedySampler(const ductile::HostContext& ctx)
      : options_(ductile::batching::options_from_params(ctx.params())), warnings_(ctx.logger()) {
    ductile::batching::check_options(options_, "greedy");
  }

  // The validate hook: `ductile config check` reports inconsistent options.
  static void validate(const ductile::Params& params, std::string_view) {
    ductile::batching::check_options(ductile::batching::options_from_params(params), "greedy");
  }

  const ductile::PackOptions& options() const override { return options_; }

  ductile::PackResult pack(const ductile::PackRequest& request) const override {
    const auto& lengths = request.lengths;
    if (!request.subset && options_.order == ductile::PickingOrder::dataloader &&
        !lengths.empty()) {
      // Data-loader order over the whole data set with nothing to drop (the
      // usual case): the samples are the lengths array itself, no copy.
      bool plain = true;
      for (std::size_t i = 0; i < lengths.size() && plain; ++i)
        plain = lengths[i] >= 1 && lengths[i] <= options_.max_tokens;
      if (plain) {
        const SampleView view{nullptr, lengths.data()};
        return finish(view, lengths.size(), lengths, {});
      }
    }
    auto candidates = ductile::batching::collect_candidates(request);
    ductile::batching::order_candidates(candidates, options_.order, options_.seed);
    auto dropped = ductile::batching::drop_too_long(candidates, options_.max_tokens, &warnings_);
    const SampleView view{candidates.data(), nullptr};
    return finish(view, candidates.size(), lengths, std::move(dropped));
  }

 private:
  // The samples in picking order: either candidates (length, id) or, for the
  // whole data set in its own order, the lengths array (id = position).
  struct SampleView {
    const Candidate* candidates;
    const std::int64_t* lengths;
    std::int64_t length(std::size_t i) const {
      return candidates ? candidates[i].length : lengths[i];
    }
    std::int64_t id(std::size_t i) const {
      return candidates ? candidates[i].id : static_cast<std::int64_t>(i);
    }
  };

  ductile::PackResult finish(const SampleView& c, std::size_t n,
                             std::span<const std::int64_t> lengths,
                             std::vector<std::int64_t> dropped) const {
    Microbatches mbs;
    mbs.ids.reserve(n);
    std::size_t pos = 0;
    if (n > 0) {
      // DeepSpeed's part: group ends strictly before n.
      pos = scan(c, pos, n - 1, mbs);
      // The final group(s) DeepSpeed never emits.
      pos = scan(c, pos, n, mbs);
    }
    std::vector<std::int64_t> leftover;
    for (std::size_t i = pos; i < n; ++i) leftover.push_back(c.id(i));
    return ductile::batching::assemble_steps(std::move(mbs), lengths, options_, std::move(leftover),
                                             std::move(dropped));
  }

  bool fits(std::int64_t tokens, std::int64_t longest, std::int64_t count) const {
    if (options_.budget == ductile::TokenBudget::padded)
      return count * longest <= options_.max_tokens;
    return tokens <= options_.max_tokens;
  }

  // Emits groups from `pos` while a valid one exists whose end is <= end_limit;
  // returns where packing stopped.
  std::size_t scan(const SampleView& c, std::size_t pos, std::size_t end_limit,
                   Microbatches& mbs) const {
    const std::size_t width = options_.same_size_microbatches
                                  ? static_cast<std::size_t>(options_.effective_batch_size)
                                  : 1;
    const auto max_count = options_.max_batch_size > 0
                               ? static_cast<std::size_t>(options_.max_batch_size)
                               : static_cast<std::size_t>(-1);
    const auto min_count = static_cast<std::size_t>(options_.min_batch_size);
    if (width == 1 && options_.budget == ductile::TokenBudget::sum) {
      // The common case (no pipeline constraint, packed budget), kept tight:
      // this loop is the sampler's throughput.
      const std::int64_t cap = options_.max_tokens;
      while (pos < end_limit) {
        const std::size_t room = std::min(end_limit - pos, max_count);
        std::size_t k = 0;
        std::int64_t tokens = 0, longest = 0;
        for (; k < room; ++k) {
          const std::int64_t len = c.length(pos + k);
          if (tokens + len > cap) break;
          tokens += len;
          longest = std::max(longest, len);
        }
        if (k == 0 || k < min_count) break;
        for (std::size_t j = 0; j < k; ++j) mbs.ids.push_back(c.id(pos + j));
        mbs.close(longest);
        pos += k;
      }
      return pos;
    }
    // A group is `width` micro-batches of at least one sample: with fewer
    // samples left there is none (and width, effective_batch_size, may be
    // any int64: no table of that size is made).
    if (pos >= end_limit || width > end_limit - pos) return pos;
    std::vector<std::int64_t> tokens(width), longest(width);
    while (pos < end_limit) {
      // k samples per micro-batch; micro-batch b takes c[pos + b], c[pos + b + width], ...
      std::size_t k = 0;
      std::fill(tokens.begin(), tokens.end(), 0);
      std::fill(longest.begin(), longest.end(), 0);
      while (k + 1 <= max_count && pos + (k + 1) * width <= end_limit) {
        bool all_fit = true;
        const std::size_t row = pos + k * width;
        for (std::size_t b = 0; b < width && all_fit; ++b) {
          const std::int64_t len = c.length(row + b);
          all_fit =
              fits(tokens[b] + len, std::max(longest[b], len), static_cast<std::int64_t>(k + 1));
        }
        if (!all_fit) break;
        for (std::size_t b = 0; b < width; ++b) {
          tokens[b] += c.length(row + b);
          longest[b] = std::max(longest[b], c.length(row + b));
        }
        ++k;
      }
      if (k == 0 || k < min_count) break;  // no valid group: DeepSpeed stops here
      for (std::size_t b = 0; b < width; ++b) {
        for (std::size_t j = 0; j < k; ++j) mbs.ids.push_back(c.id(pos + b + j * width));
        mbs.close(longest[b]);
      }
      pos += k * width;
    }
    return pos;
  }

  ductile::PackOptions options_;
  // Packing the same data again gives the same warning: logged once, counted.
  mutable ductile::batching::RepeatedWarnings warnings_;
};

constexpr ductile::ParamSpec kSchema[] = {
    ductile::batching::kMaxTokensParam,
    ductile::batching::kMinBatchSizeParam,
    ductile::batching::kMaxBatchSizeParam,
    ductile::batching::kEffectiveBatchSizeParam,
    ductile::batching::kSameSizeParam,
    ductile::batching::kBudgetParam,
    {.key = "order",
     .type = ductile::ParamType::string,
     .default_value = "\"dataloader\"",
     .allowed_values = ductile::batching::kOrderValues,
     .doc = "Picking order: dataloader (as given), seqlen (ascending length, then id) or random "
            "(Python's random.Random(seed).shuffle)"},
    {.key = "seed",
     .type = ductile::ParamType::integer,
     .default_value = "1234",
     .doc = "Seed of the random order (DeepSpeed's data_efficiency.seed)"},
};

}  // namespace

DUCTILE_PLUGIN(GreedySampler, "greedy", "1.0.0",
               "DeepSpeed's batch_by_seqlens token-budget packing, in linear time", kSchema)
