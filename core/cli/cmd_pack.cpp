// ductile pack: packs per-sample lengths into token-budget micro-batches
// with a batching plugin, groups them into steps, and optionally computes
// each step's scaled learning rate. Also the batching part of `ductile demo`.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "batching/deepspeed_batching.hpp"
#include "cli_common.hpp"
#include "ductile/batch_sampler.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/lengths.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/core/lr_schedule.hpp"
#include "ductile/lr_scaling_rule.hpp"

namespace ductile::cli {
namespace {

namespace fs = std::filesystem;

// Options as given on the command line; numbers are kept as text so that bad
// values are reported like every other error (also as JSON with --json).
struct PackCliOptions {
  std::string config, lengths, column, count_column, format;
  std::string max_tokens, sampler, order, seed, min_batch_size, max_batch_size,
      effective_batch_size, budget, ranks;
  bool same_size = false;
  std::string lr_rule, base_lr, base_batch_size, schedule, warmup_steps, total_steps, min_lr;
  std::string show = "5";
  bool json = false;
};

std::int64_t parse_int(const std::string& flag, const std::string& text, std::int64_t min) {
  std::int64_t v = 0;
  std::size_t used = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    throw Error(ErrorKind::invalid_argument, fmt::format("{} '{}' is not an integer", flag, text));
  if (v < min)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{} {} is out of range; must be >= {}", flag, v, min));
  return v;
}

double parse_double(const std::string& flag, const std::string& text, double min) {
  double v = 0;
  std::size_t used = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !std::isfinite(v))
    throw Error(ErrorKind::invalid_argument, fmt::format("{} '{}' is not a number", flag, text));
  if (v < min)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{} {} is out of range; must be >= {}", flag, v, min));
  return v;
}

std::string one_of(const std::string& flag, const std::string& value,
                   std::initializer_list<const char*> valid) {
  std::vector<std::string> names(valid.begin(), valid.end());
  for (const auto& n : names)
    if (n == value) return value;
  throw Error(ErrorKind::invalid_argument,
              fmt::format("{} '{}' is not valid; valid: {}", flag, value, fmt::join(names, ", ")));
}

// Everything needed to pack, after merging config file and flags.
struct PackSetup {
  std::string sampler = "greedy";
  Params sampler_params;
  fs::path lengths;
  core::LengthReadOptions read;
  std::optional<std::string> lr_rule;
  std::optional<double> base_batch_size;
  core::LrScheduleSpec schedule;
};

void keep_schema_keys(Params& params, const core::PluginInfo& info) {
  Params kept;
  for (const auto& [key, value] : params.values())
    for (const auto& spec : info.params)
      if (key == spec.key) kept.set(key, value);
  params = kept;
}

struct Packed {
  PackSetup setup;
  std::vector<std::int64_t> lengths;
  PackOptions options;
  PackResult result;
  double seconds = 0;
  std::vector<double> lrs;
};

struct Stats {
  std::int64_t sequences = 0, tokens = 0, padded_tokens = 0;
  double token_efficiency = 0, padded_efficiency = 0;
};

Stats stats_of(const Packed& p) {
  Stats s;
  const auto& r = p.result;
  for (std::size_t m = 0; m < r.microbatch_count(); ++m) {
    std::int64_t longest = 0;
    for (auto id : r.microbatch(m)) {
      const auto len = p.lengths[static_cast<std::size_t>(id)];
      s.tokens += len;
      longest = std::max(longest, len);
    }
    s.padded_tokens += longest * static_cast<std::int64_t>(r.microbatch(m).size());
  }
  s.sequences = static_cast<std::int64_t>(r.sample_ids.size());
  const double budget =
      static_cast<double>(r.microbatch_count()) * static_cast<double>(p.options.max_tokens);
  s.token_efficiency = budget > 0 ? static_cast<double>(s.tokens) / budget : 0;
  s.padded_efficiency = s.padded_tokens > 0
                            ? static_cast<double>(s.tokens) / static_cast<double>(s.padded_tokens)
                            : 0;
  return s;
}

// Packs with an already merged setup: loads lengths, creates the plugins from
// `runtime`, packs (timed), and computes learning rates when a rule is set.
Packed pack_with(core::Runtime& runtime, PackSetup setup) {
  Packed p;
  if (setup.lengths.empty())
    throw Error(ErrorKind::invalid_argument,
                "no lengths file: give --lengths FILE (or [batching] lengths in the config)");
  p.lengths = core::read_lengths(setup.lengths, setup.read);
  auto sampler = runtime.create<BatchSampler>(setup.sampler, setup.sampler_params);
  p.options = sampler->options();
  const auto start = std::chrono::steady_clock::now();
  p.result = sampler->pack(PackRequest{p.lengths, std::nullopt});
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (setup.lr_rule) {
    if (!setup.base_batch_size)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("learning-rate rule '{}' needs the base batch size: give "
                              "--base-batch-size B (or [lr] base_batch_size)",
                              *setup.lr_rule));
    auto rule = runtime.create<LrScalingRule>(*setup.lr_rule, Params{});
    core::VariableBatchLrSchedule schedule(setup.schedule, rule, *setup.base_batch_size,
                                           p.result.batch_sizes);
    p.lrs.reserve(p.result.step_count());
    for (std::size_t s = 0; s < p.result.step_count(); ++s) {
      p.lrs.push_back(schedule.lr());
      schedule.step();
    }
  }
  p.setup = std::move(setup);
  return p;
}

// Reads a [batching]/[lr] TOML section pair into a setup.
void setup_from_runtime(const core::Runtime& runtime, PackSetup& setup) {
  const auto& config = runtime.config();
  if (const auto* b = config.section(PluginKind::batching)) {
    setup.sampler = b->plugin;
    setup.sampler_params = b->params;
    const auto& host = b->host_params;
    if (host.has("lengths")) {
      fs::path file = host.get_string("lengths");
      if (file.is_relative()) file = config.base_dir() / file;
      setup.lengths = file;
    }
    setup.read.column = host.get_string_or("column", "");
    setup.read.count_column = host.get_string_or("count_column", "");
    setup.read.format = core::parse_length_format(host.get_string_or("format", "auto"));
  }
  if (const auto* l = config.section(PluginKind::lr)) {
    setup.lr_rule = l->plugin;
    const auto& host = l->host_params;
    if (host.has("base_batch_size")) setup.base_batch_size = host.get_double("base_batch_size");
    setup.schedule.base_lr = host.get_double_or("base_lr", 1e-3);
    setup.schedule.min_lr = host.get_double_or("min_lr", 0.0);
    setup.schedule.kind = core::parse_lr_schedule_kind(host.get_string_or("schedule", "constant"));
    setup.schedule.warmup_steps = host.get_int_or("warmup_steps", 0);
    setup.schedule.total_steps = host.get_int_or("total_steps", 0);
  }
}

int run_pack(const CliContext& context, const PackCliOptions& o) {
  PackSetup setup;
  std::optional<core::Runtime> runtime;
  if (!o.config.empty()) {
    const fs::path config = o.config;
    if (config.extension() == ".json") {
      std::ifstream in(config);
      if (!in)
        throw Error(ErrorKind::not_found,
                    fmt::format("{}: cannot open the DeepSpeed config", o.config));
      std::stringstream text;
      text << in.rdbuf();
      auto ds = core::parse_deepspeed_batching(text.str(), o.config, config.parent_path());
      if (!ds.enabled)
        core::logger()->warn(
            "{}: dynamic_batching.enabled is false (DeepSpeed would not batch "
            "dynamically); packing as asked",
            o.config);
      setup.sampler = ds.sampler;
      setup.sampler_params = ds.sampler_params;
      setup.lengths = ds.lengths_prefix;
      setup.read.format = core::LengthFormat::mmidx;
      setup.lr_rule = ds.lr_rule;
      setup.base_batch_size = ds.base_batch_size;
      setup.schedule = ds.schedule;
    } else {
      runtime.emplace(context.load_runtime(config));
      setup_from_runtime(*runtime, setup);
    }
  }
  if (!runtime)
    runtime.emplace(core::Runtime::from_string("", "command line", context.runtime_options()));

  // Flags override the config file.
  if (!o.sampler.empty()) {
    setup.sampler = one_of("--sampler", o.sampler, {"greedy", "bfd"});
    keep_schema_keys(setup.sampler_params,
                     runtime->registry().find(PluginKind::batching, setup.sampler));
  }
  auto& sp = setup.sampler_params;
  if (!o.max_tokens.empty()) sp.set("max_tokens", parse_int("--max-tokens", o.max_tokens, 1));
  if (!sp.has("max_tokens"))
    throw Error(ErrorKind::invalid_argument,
                "no token budget: give --max-tokens N (or max_tokens in the config)");
  if (!o.order.empty())
    sp.set("order", one_of("--order", o.order, {"dataloader", "seqlen", "random"}));
  if (!o.seed.empty()) sp.set("seed", parse_int("--seed", o.seed, INT64_MIN));
  if (!o.min_batch_size.empty())
    sp.set("min_batch_size", parse_int("--min-batch-size", o.min_batch_size, 0));
  if (!o.max_batch_size.empty())
    sp.set("max_batch_size", parse_int("--max-batch-size", o.max_batch_size, 0));
  if (!o.effective_batch_size.empty())
    sp.set("effective_batch_size", parse_int("--effective-batch-size", o.effective_batch_size, 1));
  if (o.same_size) sp.set("same_size_microbatches", true);
  if (!o.budget.empty()) sp.set("budget", one_of("--budget", o.budget, {"sum", "padded"}));
  if (!o.lengths.empty()) {
    setup.lengths = o.lengths;
    setup.read = {};
  }
  if (!o.column.empty()) setup.read.column = o.column;
  if (!o.count_column.empty()) setup.read.count_column = o.count_column;
  if (!o.format.empty()) setup.read.format = core::parse_length_format(o.format);
  if (!o.lr_rule.empty())
    setup.lr_rule = one_of("--lr-rule", o.lr_rule, {"linear", "sqrt", "none"});
  if (!o.base_lr.empty()) setup.schedule.base_lr = parse_double("--base-lr", o.base_lr, 0);
  if (!o.base_batch_size.empty())
    setup.base_batch_size = parse_double("--base-batch-size", o.base_batch_size, 1);
  if (!o.schedule.empty()) setup.schedule.kind = core::parse_lr_schedule_kind(o.schedule);
  if (!o.warmup_steps.empty())
    setup.schedule.warmup_steps = parse_int("--warmup-steps", o.warmup_steps, 0);
  if (!o.total_steps.empty())
    setup.schedule.total_steps = parse_int("--total-steps", o.total_steps, 0);
  if (!o.min_lr.empty()) setup.schedule.min_lr = parse_double("--min-lr", o.min_lr, 0);
  const std::int64_t ranks = o.ranks.empty() ? 0 : parse_int("--ranks", o.ranks, 1);
  const std::int64_t show = parse_int("--show", o.show, 0);
  if (setup.lr_rule) core::check_lr_schedule(setup.schedule);

  Packed p = pack_with(*runtime, std::move(setup));
  const Stats s = stats_of(p);
  const auto& r = p.result;

  if (o.json) {
    nlohmann::json out;
    nlohmann::json mbs = nlohmann::json::array();
    for (std::size_t m = 0; m < r.microbatch_count(); ++m) {
      auto ids = r.microbatch(m);
      mbs.push_back({r.microbatch_steps[m], std::vector<std::int64_t>(ids.begin(), ids.end())});
    }
    out["microbatch_ids"] = std::move(mbs);
    out["batch_sizes"] = r.batch_sizes;
    out["batch_max_seqlens"] = r.batch_max_seqlens;
    out["dropped_ids"] = r.dropped_ids;
    out["leftover_ids"] = r.leftover_ids;
    if (p.setup.lr_rule) out["lrs"] = p.lrs;
    if (ranks > 0) {
      nlohmann::json per_rank = nlohmann::json::array();
      for (std::int64_t rank = 0; rank < ranks; ++rank)
        per_rank.push_back(microbatches_of_rank(r.microbatch_count(), rank, ranks));
      out["ranks"] = std::move(per_rank);
    }
    out["stats"] = {{"sequences", s.sequences},
                    {"tokens", s.tokens},
                    {"microbatches", r.microbatch_count()},
                    {"steps", r.step_count()},
                    {"dropped", r.dropped_ids.size()},
                    {"leftover", r.leftover_ids.size()},
                    {"token_efficiency", s.token_efficiency},
                    {"padded_efficiency", s.padded_efficiency},
                    {"seconds", p.seconds}};
    std::cout << out.dump() << "\n";
    return kExitOk;
  }

  auto& out = std::cout;
  out << fmt::format("ductile pack: {} ({} samples) with sampler '{}'\n", p.setup.lengths.string(),
                     p.lengths.size(), p.setup.sampler);
  const auto row = [&](const std::string& k, const std::string& v) {
    out << fmt::format("  {:<24} {}\n", k, v);
  };
  row("max_tokens", std::to_string(p.options.max_tokens));
  row("budget", to_string(p.options.budget));
  row("effective_batch_size", std::to_string(p.options.effective_batch_size));
  row("sequences packed", std::to_string(s.sequences));
  row("tokens packed", std::to_string(s.tokens));
  row("micro-batches", std::to_string(r.microbatch_count()));
  row("steps", std::to_string(r.step_count()));
  row("dropped (too long)", std::to_string(r.dropped_ids.size()));
  row("left over", std::to_string(r.leftover_ids.size()));
  row("token efficiency", fmt::format("{:.4f} %", 100 * s.token_efficiency));
  row("padded efficiency", fmt::format("{:.4f} %", 100 * s.padded_efficiency));
  row("packing time",
      fmt::format("{:.6f} s ({:.3g} sequences/s)", p.seconds,
                  p.seconds > 0 ? static_cast<double>(p.lengths.size()) / p.seconds : 0.0));
  if (ranks > 0)
    for (std::int64_t rank = 0; rank < ranks; ++rank)
      row(fmt::format("rank {}", rank),
          fmt::format("{} micro-batches",
                      microbatches_of_rank(r.microbatch_count(), rank, ranks).size()));
  const std::size_t shown = std::min<std::size_t>(static_cast<std::size_t>(show), r.step_count());
  if (shown > 0) {
    out << fmt::format("  {:>6} {:>10} {:>12}{}\n", "step", "samples", "longest",
                       p.setup.lr_rule ? "  learning rate" : "");
    for (std::size_t st = 0; st < shown; ++st)
      out << fmt::format("  {:>6} {:>10} {:>12}{}\n", st, r.batch_sizes[st],
                         r.batch_max_seqlens[st],
                         p.setup.lr_rule ? fmt::format("  {:.6g}", p.lrs[st]) : "");
  }
  return kExitOk;
}

}  // namespace

void register_pack_command(CLI::App& app, CliContext& context) {
  auto o = std::make_shared<PackCliOptions>();
  auto* pack = app.add_subcommand(
      "pack", "Pack sample lengths into token-budget micro-batches and steps (dynamic batching)");
  pack->add_option("--lengths", o->lengths,
                   "Lengths file: text (one a line), CSV (--column), .npy, or DeepSpeed metric "
                   "PREFIX(.bin/.idx)")
      ->type_name("FILE");
  pack->add_option("--column", o->column, "CSV column holding the lengths")->type_name("NAME");
  pack->add_option("--count-column", o->count_column,
                   "CSV column of counts (the file is a length histogram)")
      ->type_name("NAME");
  pack->add_option("--format", o->format, "auto, text, csv, npy or mmidx (default: by extension)");
  pack->add_option("--config", o->config,
                   "TOML config ([batching], [lr]) or DeepSpeed JSON config "
                   "(data_efficiency.data_sampling.dynamic_batching); flags override it")
      ->type_name("FILE");
  pack->add_option("--max-tokens", o->max_tokens, "Token budget of a micro-batch")->type_name("N");
  pack->add_option("--sampler", o->sampler, "greedy (DeepSpeed) or bfd (default greedy)");
  pack->add_option("--order", o->order, "greedy picking order: dataloader, seqlen or random");
  pack->add_option("--seed", o->seed, "Seed of the random order (default 1234)")->type_name("S");
  pack->add_option("--min-batch-size", o->min_batch_size, "Fewest samples a micro-batch")
      ->type_name("N");
  pack->add_option("--max-batch-size", o->max_batch_size, "Most samples a micro-batch (0: none)")
      ->type_name("N");
  pack->add_option("--effective-batch-size", o->effective_batch_size, "Micro-batches per step")
      ->type_name("N");
  pack->add_flag("--same-size-microbatches", o->same_size,
                 "All micro-batches of a step hold as many samples (pipeline parallelism)");
  pack->add_option("--budget", o->budget, "sum (packed) or padded (samples x longest)");
  pack->add_option("--ranks", o->ranks, "Assign micro-batches to R data-parallel ranks")
      ->type_name("R");
  pack->add_option("--lr-rule", o->lr_rule, "linear, sqrt or none: learning rate of each step");
  pack->add_option("--base-lr", o->base_lr, "Learning rate tuned for --base-batch-size")
      ->type_name("X");
  pack->add_option("--base-batch-size", o->base_batch_size, "Batch size the base LR is tuned for")
      ->type_name("B");
  pack->add_option("--schedule", o->schedule, "constant, warmup_linear or warmup_cosine");
  pack->add_option("--warmup-steps", o->warmup_steps, "Warm-up steps")->type_name("N");
  pack->add_option("--total-steps", o->total_steps, "Step where the decay ends")->type_name("N");
  pack->add_option("--min-lr", o->min_lr, "Learning rate at warm-up start and decay end")
      ->type_name("X");
  pack->add_option("--show", o->show, "Steps to list in the summary (default 5)")->type_name("N");
  pack->add_flag("--json", o->json, "Machine-readable output (and errors) on stdout");
  set_action(
      pack, context, [&context, o] { return run_pack(context, *o); }, &o->json);
}

namespace {

// The batching part of `ductile demo`: packs the configured lengths with the
// configured sampler and shows the first steps with their learning rates.
void run_batching_demo(DemoContext& demo) {
  auto& out = demo.out;
  out << "\n-- dynamic batching --\n";
  PackSetup setup;
  setup_from_runtime(demo.runtime, setup);
  if (setup.lengths.empty()) {
    out << "  [batching] names no lengths file; nothing to pack\n";
    return;
  }
  // The configured instances (not new ones), as a training job would use them.
  auto sampler = demo.runtime.get<BatchSampler>();
  Packed p;
  p.lengths = core::read_lengths(setup.lengths, setup.read);
  p.options = sampler->options();
  const auto start = std::chrono::steady_clock::now();
  p.result = sampler->pack(PackRequest{p.lengths, std::nullopt});
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const Stats s = stats_of(p);
  const auto& r = p.result;
  out << fmt::format("  sampler '{}' packed {} of {} samples from {}\n", setup.sampler, s.sequences,
                     p.lengths.size(), setup.lengths.filename().string());
  out << fmt::format("  max_tokens {} ({} budget), {} micro-batches in {} steps of {}\n",
                     p.options.max_tokens, to_string(p.options.budget), r.microbatch_count(),
                     r.step_count(), p.options.effective_batch_size);
  out << fmt::format(
      "  token efficiency {:.3f} %, padded efficiency {:.3f} %, {} dropped, {} left "
      "over, {:.4f} s\n",
      100 * s.token_efficiency, 100 * s.padded_efficiency, r.dropped_ids.size(),
      r.leftover_ids.size(), p.seconds);
  std::optional<core::VariableBatchLrSchedule> schedule;
  if (demo.runtime.has(PluginKind::lr)) {
    if (!setup.base_batch_size)
      throw Error(ErrorKind::config, "[lr] needs base_batch_size to scale the learning rate");
    schedule.emplace(setup.schedule, demo.runtime.get<LrScalingRule>(), *setup.base_batch_size,
                     r.batch_sizes);
    out << fmt::format("  learning rate: rule '{}', base {} for {} samples, schedule {}\n",
                       *setup.lr_rule, setup.schedule.base_lr, *setup.base_batch_size,
                       core::to_string(setup.schedule.kind));
  }
  out << fmt::format("  {:>6} {:>8} {:>8}{}\n", "step", "samples", "longest",
                     schedule ? "  learning rate" : "");
  // A few steps across the run: bfd opens with long sequences (few per step)
  // and ends with short ones (many), so batch size and learning rate move.
  const std::size_t steps = r.step_count();
  std::vector<std::size_t> shown = {0, 1, 2, steps / 4, steps / 2, 3 * steps / 4, steps - 1};
  std::sort(shown.begin(), shown.end());
  shown.erase(std::unique(shown.begin(), shown.end()), shown.end());
  for (std::size_t st : shown) {
    if (st >= steps) continue;
    // A training loop calls step() once per optimizer step; lr_at() gives
    // the same rate without walking there.
    out << fmt::format(
        "  {:>6} {:>8} {:>8}{}\n", st, r.batch_sizes[st], r.batch_max_seqlens[st],
        schedule ? fmt::format("  {:.6g}", schedule->lr_at(static_cast<std::int64_t>(st))) : "");
  }
}

}  // namespace

void demo_batching(DemoContext& demo) {
  if (!demo.runtime.has(PluginKind::batching)) return;
  run_batching_demo(demo);
}

}  // namespace ductile::cli
