// The packing pipeline (see ductile/pipeline/pack_plan.hpp): options checked
// against the runtime's plugins, one sampler run, ranks and learning rates
// derived from its result, each stage reported to an optional ProgressSink.
#include "ductile/pipeline/pack_plan.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ductile/lr_scaling_rule.hpp"
#include "ductile/pipeline/progress.hpp"

namespace ductile::pipeline {
namespace {

Error bad_option(const std::string& message) {
  return Error(ErrorKind::invalid_argument, message);
}

// "max_tokens" or "--max-tokens".
std::string option_name(const PackPlanOptions& o, std::string_view api_name) {
  if (o.spelling == OptionSpelling::api) return std::string(api_name);
  std::string flag = "--";
  for (char c : api_name) flag += c == '_' ? '-' : c;
  return flag;
}

void check_at_least(const PackPlanOptions& o, std::string_view name,
                    const std::optional<std::int64_t>& value, std::int64_t min) {
  if (value && *value < min)
    throw bad_option(
        fmt::format("{} {} is out of range; must be >= {}", option_name(o, name), *value, min));
}

// Nothing to check against when `valid` is empty.
void check_one_of(const PackPlanOptions& o, std::string_view name, const std::string& value,
                  const std::vector<std::string>& valid) {
  if (valid.empty() || std::find(valid.begin(), valid.end(), value) != valid.end()) return;
  throw bad_option(fmt::format("{} '{}' is not valid; valid: {}", option_name(o, name), value,
                               fmt::join(valid, ", ")));
}

// The sampler's parameters: sampler_params with the typed fields laid over.
Params sampler_params_of(const PackPlanOptions& o) {
  Params p = o.sampler_params;
  if (o.max_tokens) p.set("max_tokens", *o.max_tokens);
  if (o.order) p.set("order", *o.order);
  if (o.seed) p.set("seed", *o.seed);
  if (o.min_batch_size) p.set("min_batch_size", *o.min_batch_size);
  if (o.max_batch_size) p.set("max_batch_size", *o.max_batch_size);
  if (o.effective_batch_size) p.set("effective_batch_size", *o.effective_batch_size);
  if (o.same_size_microbatches) p.set("same_size_microbatches", *o.same_size_microbatches);
  if (o.budget) p.set("budget", *o.budget);
  return p;
}

// Totals over every micro-batch: each sample is below 2^31, so a total
// passes 2^63 - 1 only past 2^32 samples (a 32 GiB lengths file), and is
// then an error rather than a wrapped count.
// The throw stays out of line: the check runs once per packed sample.
[[noreturn, gnu::cold, gnu::noinline]] void throw_total_overflow(const char* what) {
  throw Error(ErrorKind::invalid_argument,
              fmt::format("the packing's {} exceed 2^63 - 1: pack fewer samples at a time", what));
}

inline void add_checked(std::int64_t& total, std::int64_t value, const char* what) {
  if (__builtin_add_overflow(total, value, &total)) throw_total_overflow(what);
}

void fill_stats(PackPlan& plan, std::span<const std::int64_t> lengths, ProgressSink* progress) {
  auto& s = plan.stats;
  report_stage(progress, "counting tokens", plan.microbatch_count());
  for_each_reporting(plan.microbatch_count(), progress, [&](std::size_t m) {
    std::int64_t longest = 0, tokens = 0;
    const auto ids = plan.microbatch(m);
    for (auto id : ids) {
      const auto len = lengths[static_cast<std::size_t>(id)];
      add_checked(tokens, len, "tokens");
      longest = std::max(longest, len);
    }
    add_checked(s.tokens, tokens, "tokens");
    std::int64_t padded = 0;
    if (__builtin_mul_overflow(longest, static_cast<std::int64_t>(ids.size()), &padded))
      padded = std::numeric_limits<std::int64_t>::max();  // then the sum below fails
    add_checked(s.padded_tokens, padded, "padded tokens");
  });
  s.sequences = static_cast<std::int64_t>(plan.sample_ids.size());
  const double budget =
      static_cast<double>(plan.microbatch_count()) * static_cast<double>(plan.options.max_tokens);
  s.token_efficiency = budget > 0 ? static_cast<double>(s.tokens) / budget : 0;
  s.padded_efficiency = s.padded_tokens > 0
                            ? static_cast<double>(s.tokens) / static_cast<double>(s.padded_tokens)
                            : 0;
}

void assign_ranks(PackPlan& plan, std::int64_t ranks, ProgressSink* progress) {
  if (ranks <= 0) return;
  const std::size_t count = plan.microbatch_count();
  // Two passes over the micro-batches: their owners, then each rank's list.
  report_stage(progress, "assigning ranks", 2 * static_cast<std::uint64_t>(count));
  plan.microbatch_ranks.resize(count);
  for_each_reporting(count, progress, [&](std::size_t i) {
    plan.microbatch_ranks[i] = static_cast<std::int64_t>(i % static_cast<std::size_t>(ranks));
  });
  plan.rank_offsets.assign(1, 0);
  for (std::int64_t r = 0; r < ranks; ++r) {
    for (auto m : ductile::microbatches_of_rank(count, r, ranks))
      plan.rank_microbatches.push_back(static_cast<std::int64_t>(m));
    plan.rank_offsets.push_back(static_cast<std::int64_t>(plan.rank_microbatches.size()));
    report_progress(progress, std::min<std::uint64_t>(2 * static_cast<std::uint64_t>(count),
                                                      count + plan.rank_microbatches.size()));
  }
}

PackPlan plan_from_result(PackResult result, const PackOptions& options, std::string sampler,
                          double seconds) {
  PackPlan plan;
  plan.sample_ids = std::move(result.sample_ids);
  plan.microbatch_offsets.assign(result.microbatch_offsets.begin(),
                                 result.microbatch_offsets.end());
  plan.microbatch_steps = std::move(result.microbatch_steps);
  plan.batch_sizes = std::move(result.batch_sizes);
  plan.batch_max_seqlens = std::move(result.batch_max_seqlens);
  plan.dropped_ids = std::move(result.dropped_ids);
  plan.leftover_ids = std::move(result.leftover_ids);
  plan.sampler = std::move(sampler);
  plan.options = options;
  plan.stats.seconds = seconds;
  return plan;
}

std::vector<double> step_lrs(const LrScheduleSpec& spec, std::shared_ptr<const LrScalingRule> rule,
                             double base_batch_size, const std::vector<std::int64_t>& batch_sizes,
                             ProgressSink* progress = nullptr) {
  std::vector<double> lrs;
  if (batch_sizes.empty()) return lrs;
  report_stage(progress, "learning rates", batch_sizes.size());
  VariableBatchLrSchedule schedule(spec, std::move(rule), base_batch_size, batch_sizes);
  lrs.reserve(batch_sizes.size());
  for_each_reporting(batch_sizes.size(), progress, [&](std::size_t) {
    lrs.push_back(schedule.lr());
    schedule.step();
  });
  return lrs;
}

// Packs with `sampler`, timing pack() alone.
PackPlan run_sampler(const BatchSampler& sampler, std::string name,
                     std::span<const std::int64_t> lengths, ProgressSink* progress = nullptr) {
  // The sampler is a plugin: it reports nothing while it packs.
  report_stage(progress, "packing", 0);
  const auto start = std::chrono::steady_clock::now();
  PackResult result = sampler.pack(PackRequest{lengths, std::nullopt});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  PackPlan plan = plan_from_result(std::move(result), sampler.options(), std::move(name), seconds);
  fill_stats(plan, lengths, progress);
  return plan;
}

// The checks pack_plan makes before creating any plugin (see pack_plan.hpp).
void check_pack_plan_options(const core::Runtime& runtime, const PackPlanOptions& o) {
  const auto& registry = runtime.registry();
  check_one_of(o, "sampler", o.sampler, registry.names(PluginKind::batching));
  // max_tokens' range is the sampler's schema's (the bundled samplers': 1 to
  // kMaxTokenBudget), checked once, when pack_plan creates the sampler.
  if (!o.max_tokens && !o.sampler_params.has("max_tokens")) {
    if (o.spelling == OptionSpelling::cli)
      throw bad_option("no token budget: give --max-tokens N (or max_tokens in the config)");
    throw bad_option("no token budget: give max_tokens (the token budget of a micro-batch, >= 1)");
  }
  // The sampler's schema holds the valid orders and budgets (a sampler
  // without the key refuses it when its parameters are checked).
  const core::PluginInfo& sampler = registry.find(PluginKind::batching, o.sampler);
  if (o.order) check_one_of(o, "order", *o.order, core::schema_allowed_values(sampler, "order"));
  check_at_least(o, "min_batch_size", o.min_batch_size, 0);
  check_at_least(o, "max_batch_size", o.max_batch_size, 0);
  check_at_least(o, "effective_batch_size", o.effective_batch_size, 1);
  if (o.budget)
    check_one_of(o, "budget", *o.budget, core::schema_allowed_values(sampler, "budget"));
  if (o.ranks < 0 || o.ranks > kMaxPackRanks)
    throw bad_option(
        fmt::format("{} {} is out of range; must be between 0 and {} (0: no rank assignment)",
                    option_name(o, "ranks"), o.ranks, kMaxPackRanks));
  if (!o.lr_rule) return;
  check_one_of(o, "lr_rule", *o.lr_rule, registry.names(PluginKind::lr));
  if (!o.base_batch_size) {
    if (o.spelling == OptionSpelling::cli)
      throw bad_option(
          fmt::format("learning-rate rule '{}' needs the base batch size: give "
                      "--base-batch-size B (or [lr] base_batch_size)",
                      *o.lr_rule));
    throw bad_option(
        fmt::format("learning-rate rule '{}' needs the base batch size: give base_batch_size "
                    "(the batch size base_lr is tuned for, > 0)",
                    *o.lr_rule));
  }
  if (!std::isfinite(*o.base_batch_size) || *o.base_batch_size <= 0)
    throw bad_option(fmt::format("{} {} is out of range; must be a finite number > 0",
                                 option_name(o, "base_batch_size"), *o.base_batch_size));
  check_lr_schedule(o.schedule);
}

}  // namespace

std::span<const std::int64_t> PackPlan::microbatch(std::size_t i) const {
  const auto begin = static_cast<std::size_t>(microbatch_offsets.at(i));
  const auto end = static_cast<std::size_t>(microbatch_offsets.at(i + 1));
  return std::span<const std::int64_t>(sample_ids).subspan(begin, end - begin);
}

std::span<const std::int64_t> PackPlan::microbatches_of_rank(std::size_t rank) const {
  if (rank + 1 >= rank_offsets.size())
    throw Error(ErrorKind::invalid_argument,
                fmt::format("rank {} is out of range; the plan has {} ranks", rank,
                            rank_offsets.empty() ? 0 : rank_offsets.size() - 1));
  const auto begin = static_cast<std::size_t>(rank_offsets[rank]);
  const auto end = static_cast<std::size_t>(rank_offsets[rank + 1]);
  return std::span<const std::int64_t>(rank_microbatches).subspan(begin, end - begin);
}

PackPlan pack_plan(core::Runtime& runtime, std::span<const std::int64_t> lengths,
                   const PackPlanOptions& options, ProgressSink* progress) {
  check_pack_plan_options(runtime, options);
  // Creating the rule before packing reports its parameter errors first.
  std::shared_ptr<const LrScalingRule> rule;
  if (options.lr_rule) rule = runtime.create<LrScalingRule>(*options.lr_rule, options.lr_params);
  auto sampler = runtime.create<BatchSampler>(options.sampler, sampler_params_of(options));
  PackPlan plan = run_sampler(*sampler, options.sampler, lengths, progress);
  assign_ranks(plan, options.ranks, progress);
  if (rule) {
    plan.lr_rule = options.lr_rule;
    plan.lrs =
        step_lrs(options.schedule, rule, *options.base_batch_size, plan.batch_sizes, progress);
  }
  return plan;
}

PackPlan pack_plan_configured(core::Runtime& runtime, std::span<const std::int64_t> lengths) {
  const auto& config = runtime.config();
  const auto* batching = config.section(PluginKind::batching);
  if (!batching)
    throw Error(ErrorKind::config,
                fmt::format("{}: no [batching] section; add one with sampler = \"greedy\" or "
                            "\"bfd\" and max_tokens",
                            config.source_name()));
  const PackSetup setup = pack_setup_from_config(config);
  auto sampler = runtime.get<BatchSampler>();
  PackPlan plan = run_sampler(*sampler, batching->plugin, lengths);
  if (runtime.has(PluginKind::lr)) {
    if (!setup.options.base_batch_size)
      throw Error(ErrorKind::config, "[lr] needs base_batch_size to scale the learning rate");
    plan.lr_rule = setup.options.lr_rule;
    plan.lrs = step_lrs(setup.options.schedule, runtime.get<LrScalingRule>(),
                        *setup.options.base_batch_size, plan.batch_sizes);
  }
  return plan;
}

}  // namespace ductile::pipeline
