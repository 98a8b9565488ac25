// The BatchSampler interface (plugin kind PluginKind::batching): packs
// samples of variable length into micro-batches under a token budget and
// groups micro-batches into optimizer steps.
//
// Vocabulary:
// - sample id: the index of a sample in the lengths array of a request.
// - micro-batch: the samples one data loader (one rank) processes in one
//   forward/backward pass; its tokens stay within `max_tokens`.
// - step: `effective_batch_size` consecutive micro-batches that make one
//   optimizer step. A step's batch size is its number of samples; the learning
//   rate of that step is scaled by it (see lr_scaling_rule.hpp).
//
// Conventions for every call below:
// - Ownership: requests borrow the caller's arrays for the duration of the
//   call only; results are plain values owned by the caller.
// - Threading: a sampler's configuration is immutable after creation, so
//   pack() and options() may be called concurrently from several threads.
// - Errors: ductile::Error. ErrorKind::invalid_argument for a bad request (a
//   length <= 0, a sample id outside the lengths array), with the offending
//   position and value in the message; ErrorKind::incompatible when the
//   samples cannot fill one micro-batch per step slot (type
//   "NotEnoughSamples"). Configuration problems are caught by the core's
//   schema validation before the sampler exists.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ductile/plugin.hpp"

namespace ductile {

// How a micro-batch's size is measured against max_tokens.
enum class TokenBudget : std::uint32_t {
  sum = 0,     // total tokens of its samples (packed attention; DeepSpeed)
  padded = 1,  // samples x longest sample (padded attention; fairseq)
};

// The order in which a greedy sampler takes samples.
enum class PickingOrder : std::uint32_t {
  dataloader = 0,  // the order of the request
  seqlen = 1,      // ascending length, ties by ascending sample id
  random = 2,      // Python's random.Random(seed).shuffle of the request order
};

DUCTILE_SDK_API inline const char* to_string(TokenBudget b) noexcept {
  return b == TokenBudget::padded ? "padded" : "sum";
}
DUCTILE_SDK_API inline const char* to_string(PickingOrder o) noexcept {
  switch (o) {
    case PickingOrder::dataloader:
      return "dataloader";
    case PickingOrder::seqlen:
      return "seqlen";
    case PickingOrder::random:
      return "random";
  }
  return "dataloader";
}

// The largest token budget of a micro-batch, 2^31 - 1. Samples longer than the
// budget are dropped before packing, so every sum a sampler forms (a
// micro-batch's tokens, its longest sample times its sample count) stays
// below 2^62 and no int64 arithmetic on lengths can overflow. Checked by the
// max_tokens key of the bundled samplers' schema and by pipeline::pack_plan.
inline constexpr std::int64_t kMaxTokenBudget = (std::int64_t{1} << 31) - 1;

// The validated configuration of a sampler, as given by its parameters.
struct PackOptions {
  // Token budget of one micro-batch (1..kMaxTokenBudget). No default: the
  // key is required by the schema, so the value always comes from it.
  std::int64_t max_tokens;
  std::int64_t min_batch_size = 1;        // fewest samples in a micro-batch (0 = no minimum)
  std::int64_t max_batch_size = 0;        // most samples in a micro-batch (0 = no maximum)
  std::int64_t effective_batch_size = 1;  // micro-batches per step (>= 1)
  bool same_size_microbatches = false;    // every micro-batch of a step has as many samples
  TokenBudget budget = TokenBudget::sum;
  PickingOrder order = PickingOrder::dataloader;  // greedy samplers only
  std::int64_t seed = 1234;                       // for PickingOrder::random (as Python: abs)
};

// What to pack.
struct PackRequest {
  // The length (tokens) of every sample, indexed by sample id. Every length
  // packed must be >= 1.
  std::span<const std::int64_t> lengths;
  // When set, only these sample ids are packed, in this order (the data
  // loader order); ids may repeat. When unset, every sample in id order.
  std::optional<std::span<const std::int64_t>> subset;
};

// The packing. Micro-batches are stored flat: micro-batch i holds
// sample_ids[microbatch_offsets[i] .. microbatch_offsets[i + 1]) and belongs
// to step microbatch_steps[i]. Steps are numbered 0, 1, ... and every step
// has exactly effective_batch_size micro-batches, in order.
struct PackResult {
  std::vector<std::int64_t> sample_ids;
  std::vector<std::size_t> microbatch_offsets{0};  // microbatch_count() + 1 entries
  std::vector<std::int64_t> microbatch_steps;
  // Per step: number of samples, and the longest sample (the padding length
  // when all micro-batches of a step must share one sequence length).
  std::vector<std::int64_t> batch_sizes;
  std::vector<std::int64_t> batch_max_seqlens;
  // Samples longer than max_tokens (ascending ids): they fit no micro-batch.
  std::vector<std::int64_t> dropped_ids;
  // Samples that fit but are in no micro-batch: those cut when trimming to
  // whole steps, and those for which no valid micro-batch could be formed
  // (min_batch_size, equal micro-batch sizes). Ascending ids.
  std::vector<std::int64_t> leftover_ids;

  std::size_t microbatch_count() const noexcept { return microbatch_steps.size(); }
  std::size_t step_count() const noexcept { return batch_sizes.size(); }
  std::span<const std::int64_t> microbatch(std::size_t i) const {
    return std::span<const std::int64_t>(sample_ids)
        .subspan(microbatch_offsets[i], microbatch_offsets[i + 1] - microbatch_offsets[i]);
  }
};

// The micro-batches data-parallel rank `rank` of `ranks` processes, as
// indices into the result, like torch's DistributedSampler without shuffling
// and without dropping: the list is padded to a multiple of `ranks` by
// repeating micro-batches from its start, then rank r takes r, r + ranks, ...
// Pure function. Throws Error(invalid_argument) unless 0 <= rank < ranks.
DUCTILE_SDK_API inline std::vector<std::size_t> microbatches_of_rank(std::size_t microbatch_count,
                                                                     std::int64_t rank,
                                                                     std::int64_t ranks) {
  if (ranks < 1 || rank < 0 || rank >= ranks)
    throw Error(ErrorKind::invalid_argument, "rank " + std::to_string(rank) + " of " +
                                                 std::to_string(ranks) +
                                                 " ranks: need ranks >= 1 and 0 <= rank < ranks");
  std::vector<std::size_t> out;
  if (microbatch_count == 0) return out;
  const auto r = static_cast<std::size_t>(rank);
  const auto n = static_cast<std::size_t>(ranks);
  const std::size_t padded = (microbatch_count + n - 1) / n * n;
  for (std::size_t i = r; i < padded; i += n) out.push_back(i % microbatch_count);
  return out;
}

class DUCTILE_SDK_API BatchSampler : public Plugin {
 public:
  static constexpr PluginKind kind = PluginKind::batching;

  // The sampler's configuration. The reference stays valid for the
  // sampler's lifetime.
  virtual const PackOptions& options() const = 0;

  // Packs the request. Samples longer than max_tokens are dropped (listed in
  // dropped_ids, one warning on the sampler's logger counting them). Every
  // other requested sample is either in exactly one micro-batch (or as often
  // as the subset names it) or in leftover_ids. Deterministic: the same
  // request and options give the same result on every machine.
  // Throws as described at the top of this file.
  virtual PackResult pack(const PackRequest& request) const = 0;
};

}  // namespace ductile
