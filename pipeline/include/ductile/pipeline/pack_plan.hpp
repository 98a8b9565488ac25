// The packing pipeline as one call: per-sample lengths -> token-budget
// micro-batches (a batching plugin) -> optimizer steps -> data-parallel ranks
// -> each step's learning rate (an lr plugin and a base schedule). This is
// what `ductile pack` prints, what `ductile demo` shows, and what the Python
// package (ductile.batching.pack) returns as arrays.
//
//   auto runtime = ductile::core::Runtime::from_string("", "my job");
//   ductile::pipeline::PackPlanOptions options;
//   options.max_tokens = 8192;
//   options.effective_batch_size = 2;
//   options.ranks = 4;
//   options.lr_rule = "sqrt";
//   options.base_batch_size = 16;
//   auto plan = ductile::pipeline::pack_plan(runtime, lengths, options);
//   // plan.microbatch(i), plan.microbatch_steps[i], plan.microbatch_ranks[i], plan.lrs[step]
//
// Options are typed values; every check names the option, the bad value and
// what is valid. Option names are spelled as in this header ("max_tokens",
// the Python keyword arguments) or, with OptionSpelling::cli, as the CLI's
// flags ("--max-tokens"); the text is otherwise the same.
//
// Ownership: pack_plan borrows `lengths` for the duration of the call only;
// the PackPlan it returns is a plain value owned by the caller, holding no
// reference to the runtime, the lengths or any plugin. The plugins it creates
// (one sampler, at most one lr rule) are released before it returns.
// Threading: pack_plan keeps no state between calls. Calls may run
// concurrently on different runtimes; on one shared Runtime they may also run
// concurrently, since they only read its registry and call Runtime::create
// (see runtime.hpp). The pack_options_from_* helpers
// are pure functions.
// Errors: ductile::Error. ErrorKind::invalid_argument for a bad option (named
// as above) or a bad length (a length <= 0, named by its sample id);
// ErrorKind::config (ConfigError) when a sampler or rule rejects a parameter
// against its schema (unknown key, wrong type, out of range such as
// max_tokens = 0: "batching plugin 'greedy': max_tokens = 0 is out of range:
// must be between 1 and 2147483647"); ErrorKind::not_found /
// ErrorKind::plugin when a plugin is missing or fails to load;
// ErrorKind::incompatible (type "NotEnoughSamples") when the samples cannot
// fill one step. Nothing is returned half done: an error leaves no result.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ductile/batch_sampler.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/params.hpp"
#include "ductile/pipeline/lengths.hpp"
#include "ductile/pipeline/lr_schedule.hpp"
#include "ductile/pipeline/progress.hpp"

namespace ductile::pipeline {

// How messages name options: "max_tokens" (api) or "--max-tokens" (cli).
enum class OptionSpelling { api, cli };

// The most data-parallel ranks a plan assigns micro-batches to: the
// assignment holds a table per rank, so a bound keeps a typo (2**62) an
// error, not an out-of-memory kill. 2^20 is far above any job's size.
inline constexpr std::int64_t kMaxPackRanks = std::int64_t{1} << 20;

// Every option of `ductile pack`. An unset optional keeps the sampler's
// schema default (or the value in `sampler_params`, which a set field
// overrides).
struct PackPlanOptions {
  // Batching plugin name: any installed one ("greedy", DeepSpeed's algorithm;
  // "bfd", best-fit decreasing; or an out-of-tree sampler).
  std::string sampler = "greedy";
  // Token budget of a micro-batch. Required, here or in sampler_params; its
  // range is the sampler's schema's (the bundled samplers': 1 to
  // kMaxTokenBudget), checked when the sampler is created.
  std::optional<std::int64_t> max_tokens;
  // Greedy picking order: "dataloader", "seqlen" or "random" (samplers whose
  // schema has no `order` reject it).
  std::optional<std::string> order;
  std::optional<std::int64_t> seed;                  // seed of the random order (any value)
  std::optional<std::int64_t> min_batch_size;        // fewest samples a micro-batch (>= 0)
  std::optional<std::int64_t> max_batch_size;        // most samples a micro-batch (>= 0; 0: none)
  std::optional<std::int64_t> effective_batch_size;  // micro-batches per step (>= 1)
  // Every micro-batch of a step holds as many samples (pipeline parallelism).
  std::optional<bool> same_size_microbatches;
  std::optional<std::string> budget;  // "sum" (packed) or "padded" (samples x longest)
  // Further parameters of the sampler (its schema's keys, e.g. those of a
  // custom sampler, or a TOML [batching] section's); the fields above win.
  Params sampler_params;

  // Data-parallel ranks to assign micro-batches to (1 .. kMaxPackRanks); 0:
  // no assignment.
  std::int64_t ranks = 0;

  // Learning-rate scaling rule: any installed lr plugin ("linear", "sqrt",
  // "none" or an out-of-tree rule). Unset: no learning rates are computed.
  std::optional<std::string> lr_rule;
  Params lr_params;  // the rule's parameters (its schema's keys)
  // The batch size schedule.base_lr is tuned for (> 0, finite). Required
  // when lr_rule is set.
  std::optional<double> base_batch_size;
  // The base schedule (kind, base_lr, min_lr, warmup_steps, total_steps);
  // checked by check_lr_schedule() when lr_rule is set.
  LrScheduleSpec schedule;

  OptionSpelling spelling = OptionSpelling::api;
};

// What pack_plan computes. Micro-batches are stored flat, as in PackResult:
// micro-batch i holds sample_ids[microbatch_offsets[i] ..
// microbatch_offsets[i + 1]) (sample ids index the lengths given) and belongs
// to step microbatch_steps[i]; every step has exactly effective_batch_size
// consecutive micro-batches.
struct PackPlan {
  std::vector<std::int64_t> sample_ids;
  std::vector<std::int64_t> microbatch_offsets{0};  // microbatch_count() + 1 entries
  std::vector<std::int64_t> microbatch_steps;
  // Data-parallel ranks (when options.ranks > 0; else empty). Like torch's
  // DistributedSampler without shuffling or dropping (see
  // microbatches_of_rank in batch_sampler.hpp): the list of micro-batches is
  // padded to a multiple of `ranks` by repeating micro-batches from its
  // start, and rank r takes slots r, r + ranks, r + 2 ranks, ...
  // - microbatch_ranks[i] = i % ranks: the rank that owns micro-batch i.
  // - rank r processes rank_microbatches[rank_offsets[r] ..
  //   rank_offsets[r + 1]) in order: its own micro-batches, then, when
  //   microbatch_count() is not a multiple of ranks, one repeat: padded slot
  //   p (microbatch_count() <= p < padded) goes to rank p % ranks and
  //   carries micro-batch p % microbatch_count(). Every rank has the same
  //   number of entries, ceil(microbatch_count() / ranks) (0 when there are
  //   no micro-batches).
  std::vector<std::int64_t> microbatch_ranks;
  std::vector<std::int64_t> rank_microbatches;
  std::vector<std::int64_t> rank_offsets;  // ranks + 1 entries when ranks > 0
  // Per step: samples, longest sample, learning rate (lrs empty without a rule).
  std::vector<std::int64_t> batch_sizes;
  std::vector<std::int64_t> batch_max_seqlens;
  std::vector<double> lrs;
  // Samples longer than max_tokens, and samples that fit but are in no
  // micro-batch (trimmed to whole steps, or no valid micro-batch); ascending.
  std::vector<std::int64_t> dropped_ids;
  std::vector<std::int64_t> leftover_ids;

  // The sampler's effective configuration (schema defaults filled in) and
  // the plugins used.
  std::string sampler;
  PackOptions options;
  std::optional<std::string> lr_rule;

  struct Stats {
    std::int64_t sequences = 0;      // samples in micro-batches
    std::int64_t tokens = 0;         // their tokens
    std::int64_t padded_tokens = 0;  // sum over micro-batches of samples x longest
    // tokens / (micro-batches x max_tokens), and tokens / padded_tokens (0 when empty).
    double token_efficiency = 0;
    double padded_efficiency = 0;
    double seconds = 0;  // the sampler's pack() call alone, wall clock
  } stats;

  std::size_t microbatch_count() const noexcept { return microbatch_steps.size(); }
  std::size_t step_count() const noexcept { return batch_sizes.size(); }
  std::span<const std::int64_t> microbatch(std::size_t i) const;
  std::span<const std::int64_t> microbatches_of_rank(std::size_t rank) const;
  std::size_t rank_count() const noexcept {
    return rank_offsets.empty() ? 0 : rank_offsets.size() - 1;
  }
};

// Checks the options first: sampler and lr_rule installed, a token budget
// given, the other options in range, the base batch size given when a rule
// is, the schedule valid (max_tokens' range is the sampler's schema's,
// checked when the sampler is created). Then packs `lengths` (each >= 1;
// sample id = index) with a new instance of options.sampler created from
// `runtime` (so the runtime's registry and plugin search path decide which
// plugins exist), assigns ranks, and, when options.lr_rule is set, computes
// every step's learning rate with a VariableBatchLrSchedule (rate of step s = the base schedule at
// s, scaled by the rule for batch_sizes[s] / base_batch_size).
// The stages are reported to `progress` (nullptr: none) from the calling
// thread: "packing" (the sampler's call, of unknown length), then "counting
// tokens" (micro-batches), "assigning ranks" (with options.ranks) and
// "learning rates" (steps, with options.lr_rule). The sink is borrowed for
// the call.
PackPlan pack_plan(core::Runtime& runtime, std::span<const std::int64_t> lengths,
                   const PackPlanOptions& options, ProgressSink* progress = nullptr);

// The same with the runtime's configured instances: the sampler and rule of
// its [batching] and [lr] sections (as a training job uses them), their
// options from the config. Throws Error(config) when the config has no
// [batching] section, or has [lr] without base_batch_size.
PackPlan pack_plan_configured(core::Runtime& runtime, std::span<const std::int64_t> lengths);

// The plan as `ductile pack --json` writes it, the one writer of that format
// (the CLI and Python's PackPlan.to_json): microbatch_ids ([step, [sample
// ids]] per micro-batch), batch_sizes, batch_max_seqlens, dropped_ids,
// leftover_ids, lrs (with a rule), ranks (micro-batches per rank, when
// assigned) and, `with_stats`, stats. One line of JSON, no newline.
// Reports "writing JSON" (micro-batches, then ranks) and "formatting JSON"
// (of unknown length) to `progress` (nullptr: none).
std::string to_json(const PackPlan& plan, bool with_stats = true, ProgressSink* progress = nullptr);

// Where a configuration says the lengths are, with the options it gives.
struct PackSetup {
  PackPlanOptions options;
  std::filesystem::path lengths;  // empty: none named
  LengthReadOptions read;
  std::string origin;  // the configuration file
};

// From a TOML configuration's [batching] and [lr] sections (relative paths
// resolve against the config's folder); a missing section leaves defaults.
PackSetup pack_setup_from_config(const core::Config& config);

}  // namespace ductile::pipeline
