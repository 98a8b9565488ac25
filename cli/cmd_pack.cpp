// ductile pack: argument parsing and printing around the pipeline's
// pack_plan (lengths -> micro-batches -> steps -> ranks -> learning rates).
// Also the batching part of `ductile demo`.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <iostream>
#include <new>
#include <optional>
#include <sstream>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "cli_common.hpp"
#include "ductile/batch_sampler.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/files.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/pipeline/deepspeed_batching.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/json.hpp"
#include "ductile/pipeline/pack_plan.hpp"
#include "progress.hpp"

namespace ductile::cli {
namespace {

namespace fs = std::filesystem;

// Options as given on the command line; numbers are kept as text so that bad
// values are reported like every other error (also as JSON with --json).
struct PackFlags {
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
  const char* end = text.data() + text.size();
  // from_chars takes no '+', which the option accepts (it means the same).
  const bool plus = text.size() > 1 && text[0] == '+' && text[1] != '-';
  const char* digits = text.data() + (plus ? 1 : 0);
  const auto [stop, ec] = std::from_chars(digits, end, v);
  if (ec == std::errc::result_out_of_range && stop == end)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{} {} is past the {} integer ({}); must be an integer between {} "
                            "and {}",
                            flag, text, text.front() == '-' ? "smallest" : "largest",
                            text.front() == '-' ? "-2^63" : "2^63-1", min, INT64_MAX));
  if (ec != std::errc() || stop != end || digits == end)
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

int run_pack(const CliContext& context, const PackFlags& o) {
  pipeline::PackSetup setup;
  std::optional<core::Runtime> runtime;
  if (!o.config.empty()) {
    const fs::path config = o.config;
    const std::string text = core::read_user_file(
        config, config.extension() == ".json" ? "DeepSpeed config" : "configuration file");
    if (pipeline::is_json_config(config, text)) {
      runtime.emplace(core::Runtime::from_string("", "command line", context.runtime_options()));
      auto ds = pipeline::parse_deepspeed_batching(text, o.config, config.parent_path(),
                                                   runtime->registry());
      if (!ds.enabled)
        core::logger()->warn(
            "{}: dynamic_batching.enabled is false (DeepSpeed would not batch "
            "dynamically); packing as asked",
            o.config);
      setup = std::move(ds.setup);
    } else {
      runtime.emplace(context.load_runtime(core::ConfigDocument::from_file_text(config, text)));
      setup = pipeline::pack_setup_from_config(runtime->config());
    }
  }
  if (!runtime)
    runtime.emplace(core::Runtime::from_string("", "command line", context.runtime_options()));

  // Flags override the config file; text becomes typed options here, every
  // other check is pack_plan's (named with the flags' spelling) or the
  // plugins' schemas'.
  auto& options = setup.options;
  options.spelling = pipeline::OptionSpelling::cli;
  // A flag that names another plugin than the config keeps only the config's
  // parameters that plugin has; an unknown name is reported by pack_plan.
  auto choose = [&](PluginKind kind, const std::string& name, Params& params) {
    const auto installed = runtime->registry().names(kind);
    if (std::find(installed.begin(), installed.end(), name) != installed.end())
      params = core::schema_params(runtime->registry().find(kind, name), params);
  };
  if (!o.sampler.empty()) {
    options.sampler = o.sampler;
    choose(PluginKind::batching, o.sampler, options.sampler_params);
  }
  // The one conversion of the flag's text; its range is the sampler's schema's.
  if (!o.max_tokens.empty())
    options.max_tokens = parse_int("--max-tokens", o.max_tokens, INT64_MIN);
  if (!o.order.empty()) options.order = o.order;
  if (!o.seed.empty()) options.seed = parse_int("--seed", o.seed, INT64_MIN);
  if (!o.min_batch_size.empty())
    options.min_batch_size = parse_int("--min-batch-size", o.min_batch_size, 0);
  if (!o.max_batch_size.empty())
    options.max_batch_size = parse_int("--max-batch-size", o.max_batch_size, 0);
  if (!o.effective_batch_size.empty())
    options.effective_batch_size = parse_int("--effective-batch-size", o.effective_batch_size, 1);
  if (o.same_size) options.same_size_microbatches = true;
  if (!o.budget.empty()) options.budget = o.budget;
  if (!o.lengths.empty()) {
    setup.lengths = o.lengths;
    setup.read = {};
  }
  if (!o.column.empty()) setup.read.column = o.column;
  if (!o.count_column.empty()) setup.read.count_column = o.count_column;
  if (!o.format.empty()) setup.read.format = pipeline::parse_length_format(o.format);
  if (!o.lr_rule.empty()) {
    options.lr_rule = o.lr_rule;
    choose(PluginKind::lr, o.lr_rule, options.lr_params);
  }
  if (!o.base_lr.empty()) options.schedule.base_lr = parse_double("--base-lr", o.base_lr, 0);
  if (!o.base_batch_size.empty())
    options.base_batch_size = parse_double("--base-batch-size", o.base_batch_size, 1);
  if (!o.schedule.empty()) options.schedule.kind = pipeline::parse_lr_schedule_kind(o.schedule);
  if (!o.warmup_steps.empty())
    options.schedule.warmup_steps = parse_int("--warmup-steps", o.warmup_steps, 0);
  if (!o.total_steps.empty())
    options.schedule.total_steps = parse_int("--total-steps", o.total_steps, 0);
  if (!o.min_lr.empty()) options.schedule.min_lr = parse_double("--min-lr", o.min_lr, 0);
  if (!o.ranks.empty()) options.ranks = parse_int("--ranks", o.ranks, 1);
  const std::int64_t show = parse_int("--show", o.show, 0);
  // The options are checked by pack_plan, once, after the lengths are read.
  if (setup.lengths.empty())
    throw Error(ErrorKind::invalid_argument,
                "no lengths file: give --lengths FILE (or [batching] lengths in the config)");
  // On a terminal, a run past a second shows its progress on stderr; the
  // bar ends before anything is printed on stdout (often the same terminal).
  ProgressBar progress("ductile pack");
  progress.begin_stage("reading lengths", 0);
  // The inputs are bounded (file size, histogram expansion), but a machine
  // may still lack the memory for a large one: that is said in terms of the
  // input rather than as an internal error.
  std::vector<std::int64_t> lengths;
  std::optional<pipeline::PackPlan> packed;
  std::string json;
  try {
    lengths = pipeline::read_lengths(setup.lengths, setup.read);
    packed.emplace(pipeline::pack_plan(*runtime, lengths, options, progress.sink()));
    if (o.json) json = pipeline::to_json(*packed, true, progress.sink());
  } catch (const std::bad_alloc&) {
    throw Error(
        ErrorKind::unsupported,
        fmt::format("--lengths {}: out of memory {}; this machine cannot pack it: split "
                    "the lengths file{}",
                    setup.lengths.string(),
                    lengths.empty() ? std::string("while reading its samples")
                                    : fmt::format("while packing its {} samples", lengths.size()),
                    setup.read.count_column.empty() ? "" : " or lower its histogram counts"));
  }
  const pipeline::PackPlan& plan = *packed;
  const auto& s = plan.stats;
  progress.finish();
  if (o.json) {
    std::cout << json << "\n";
    return kExitOk;
  }

  auto& out = std::cout;
  out << fmt::format("ductile pack: {} ({} samples) with sampler '{}'\n", setup.lengths.string(),
                     lengths.size(), plan.sampler);
  const auto row = [&](const std::string& k, const std::string& v) {
    out << fmt::format("  {:<24} {}\n", k, v);
  };
  row("max_tokens", std::to_string(plan.options.max_tokens));
  row("budget", to_string(plan.options.budget));
  row("effective_batch_size", std::to_string(plan.options.effective_batch_size));
  row("sequences packed", std::to_string(s.sequences));
  row("tokens packed", std::to_string(s.tokens));
  row("micro-batches", std::to_string(plan.microbatch_count()));
  row("steps", std::to_string(plan.step_count()));
  row("dropped (too long)", std::to_string(plan.dropped_ids.size()));
  row("left over", std::to_string(plan.leftover_ids.size()));
  row("token efficiency", fmt::format("{:.4f} %", 100 * s.token_efficiency));
  row("padded efficiency", fmt::format("{:.4f} %", 100 * s.padded_efficiency));
  row("packing time",
      fmt::format("{:.6f} s ({:.3g} sequences/s)", s.seconds,
                  s.seconds > 0 ? static_cast<double>(lengths.size()) / s.seconds : 0.0));
  for (std::int64_t rank = 0; rank < options.ranks; ++rank)
    row(fmt::format("rank {}", rank),
        fmt::format("{} micro-batches",
                    plan.microbatches_of_rank(static_cast<std::size_t>(rank)).size()));
  const std::size_t shown =
      std::min<std::size_t>(static_cast<std::size_t>(show), plan.step_count());
  if (shown > 0) {
    out << fmt::format("  {:>6} {:>10} {:>12}{}\n", "step", "samples", "longest",
                       plan.lr_rule ? "  learning rate" : "");
    for (std::size_t st = 0; st < shown; ++st)
      out << fmt::format("  {:>6} {:>10} {:>12}{}\n", st, plan.batch_sizes[st],
                         plan.batch_max_seqlens[st],
                         plan.lr_rule ? fmt::format("  {:.6g}", plan.lrs[st]) : "");
  }
  return kExitOk;
}

}  // namespace

void register_pack_command(CLI::App& app, CliContext& context) {
  auto o = std::make_shared<PackFlags>();
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
  pack->add_option("--sampler", o->sampler,
                   "greedy (DeepSpeed), bfd, or any installed batching plugin (default greedy)");
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
  pack->add_option("--lr-rule", o->lr_rule,
                   "linear, sqrt, none or any installed lr plugin: learning rate of each step");
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

// The batching part of `ductile demo`: packs the configured lengths with the
// configured sampler and shows the first steps with their learning rates.
void demo_batching(DemoContext& demo) {
  if (!demo.runtime.has(PluginKind::batching)) return;
  auto& out = demo.out;
  out << "\n-- dynamic batching --\n";
  const auto setup = pipeline::pack_setup_from_config(demo.runtime.config());
  if (setup.lengths.empty()) {
    out << "  [batching] names no lengths file; nothing to pack\n";
    return;
  }
  const auto lengths = pipeline::read_lengths(setup.lengths, setup.read);
  // The configured instances (not new ones), as a training job would use them.
  const auto plan = pipeline::pack_plan_configured(demo.runtime, lengths);
  const auto& s = plan.stats;
  out << fmt::format("  sampler '{}' packed {} of {} samples from {}\n", plan.sampler, s.sequences,
                     lengths.size(), setup.lengths.filename().string());
  out << fmt::format("  max_tokens {} ({} budget), {} micro-batches in {} steps of {}\n",
                     plan.options.max_tokens, to_string(plan.options.budget),
                     plan.microbatch_count(), plan.step_count(), plan.options.effective_batch_size);
  out << fmt::format(
      "  token efficiency {:.3f} %, padded efficiency {:.3f} %, {} dropped, {} left "
      "over, {:.4f} s\n",
      100 * s.token_efficiency, 100 * s.padded_efficiency, plan.dropped_ids.size(),
      plan.leftover_ids.size(), s.seconds);
  const auto& lr = setup.options;
  if (plan.lr_rule)
    out << fmt::format("  learning rate: rule '{}', base {} for {} samples, schedule {}\n",
                       *plan.lr_rule, lr.schedule.base_lr, *lr.base_batch_size,
                       pipeline::to_string(lr.schedule.kind));
  out << fmt::format("  {:>6} {:>8} {:>8}{}\n", "step", "samples", "longest",
                     plan.lr_rule ? "  learning rate" : "");
  // A few steps across the run: bfd opens with long sequences (few per step)
  // and ends with short ones (many), so batch size and learning rate move.
  const std::size_t steps = plan.step_count();
  std::vector<std::size_t> shown = {0, 1, 2, steps / 4, steps / 2, 3 * steps / 4, steps - 1};
  std::sort(shown.begin(), shown.end());
  shown.erase(std::unique(shown.begin(), shown.end()), shown.end());
  for (std::size_t st : shown) {
    if (st >= steps) continue;
    out << fmt::format("  {:>6} {:>8} {:>8}{}\n", st, plan.batch_sizes[st],
                       plan.batch_max_seqlens[st],
                       plan.lr_rule ? fmt::format("  {:.6g}", plan.lrs[st]) : "");
  }
}

}  // namespace ductile::cli
