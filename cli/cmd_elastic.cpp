// ductile elastic --config FILE [--world-size N] [--json]: the elastic plan of
// a configuration (TOML, or a DeepSpeed JSON config), like DeepSpeed's
// ds_elastic, with DeepSpeedConfig's rules for a DeepSpeed config's batch keys
// (a disabled block: the batch of a non-elastic job); and the elasticity part
// of `ductile demo`.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/files.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/elasticity_policy.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/json.hpp"
#include "progress.hpp"

namespace ductile::cli {
namespace {

// How the built-in policies say that a request lacked the world size.
constexpr std::string_view kNoWorldSize = "no world size was given";
constexpr auto npos = std::string_view::npos;

struct ElasticOptions {
  std::string config;
  std::int64_t world_size = 0;
  bool world_size_given = false;
  bool micro_batch = false;
  bool json = false;
};

// Called in a handler of `e`, raised by the policy's compute(). The
// policies word a missing world size for every caller; here the way to give
// one is this command's option. (Other messages stay as the policy wrote
// them: the Python API raises the same text.)
[[noreturn]] void rethrow_with_option(const Error& e, const ElasticOptions& options) {
  const std::string_view message = e.what();
  if (options.world_size_given || message.find(kNoWorldSize) == npos) throw;
  throw Error(e.kind(), fmt::format("{} (ductile elastic: pass --world-size N)", message),
              e.type());
}

pipeline::LoadedElasticity load(const CliContext& context, const std::string& file,
                                const std::string& text) {
  if (pipeline::is_json_config(file, text))
    return pipeline::load_elasticity(file, text, context.runtime_options());
  return pipeline::elasticity_from_runtime(
      context.load_runtime(core::ConfigDocument::from_file_text(file, text)));
}

// "[a, b, c]". A valid GPU list has thousands of entries: fmt::join would
// parse the format of every one of them.
std::string list_text(const std::vector<std::int64_t>& v) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) out += ", ";
    const fmt::format_int digits(v[i]);
    out.append(digits.data(), digits.size());
  }
  return out + "]";
}

void print_json(const pipeline::LoadedElasticity& loaded, const ElasticityResult& r) {
  nlohmann::json j = pipeline::to_json(r);
  j["elastic"] = true;  // false: a disabled block's non-elastic batch (run_non_elastic)
  j["policy"] = loaded.source.policy;
  j["source"] = loaded.source.origin;
  std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
}

// The rule above the results, their heading (the world size when given),
// and the rule under it.
void print_results_heading(const ElasticityResult& r, const std::string& rule) {
  std::cout << rule << "\n";
  if (r.world_size)
    std::cout << fmt::format("Calculated results for world size {}:\n", *r.world_size);
  else
    std::cout << "Calculated results:\n";
  std::cout << rule << "\n";
}

void print_human(const pipeline::LoadedElasticity& loaded, const ElasticityResult& r) {
  const std::string rule(42, '-');
  std::cout << rule << "\nElasticity config (policy " << loaded.source.policy << ", from "
            << loaded.source.origin << "):\n"
            << rule << "\n";
  for (const auto& [key, value] : loaded.effective_params.values())
    std::cout << fmt::format("  {} = {}\n", key, core::format_param_value(value));
  print_results_heading(r, rule);
  std::cout << fmt::format("final_batch_size .... {}\n", r.final_batch_size);
  std::cout << fmt::format("valid_gpus .......... {}\n", list_text(r.valid_gpus));
  if (r.model_parallel_size > 1)
    std::cout << fmt::format("valid_dp_sizes ...... {} (model_parallel_size {})\n",
                             list_text(r.valid_dp_sizes), r.model_parallel_size);
  if (r.micro_batch_size) {
    std::cout << fmt::format("micro_batch_size .... {}\n", *r.micro_batch_size);
    std::cout << fmt::format("gradient_accumulation_steps .... {}\n",
                             *r.gradient_accumulation_steps);
  }
  if (r.fallback)
    std::cout << "fallback ............ true (batch valid for this world size only)\n";
  for (const auto& w : r.warnings) std::cout << "warning: " << w << "\n";
}

// A DeepSpeed config whose elasticity block is disabled: DeepSpeed trains it
// as a non-elastic job with the batch of its batch keys, so the answer is
// that batch (for --world-size, its micro batch and accumulation steps).
int run_non_elastic(const ElasticOptions& options, const pipeline::DeepSpeedElasticityMode& mode,
                    const std::string& enabled_shown) {
  if (options.micro_batch && !options.world_size_given)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{}: --micro-batch needs --world-size: the micro batch of a "
                            "non-elastic job depends on the world size",
                            options.config),
                kElasticityError);
  const auto r = pipeline::non_elastic_plan(
      mode.batch, options.world_size_given ? options.world_size : 0, options.config);
  if (options.json) {
    auto j = pipeline::non_elastic_json(mode.batch, r);
    j["policy"] = nullptr;
    j["source"] = options.config;
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
    return kExitOk;
  }
  const std::string rule(42, '-');
  std::cout << rule << "\nElasticity is disabled in " << options.config << " (elasticity.enabled"
            << enabled_shown << "): a non-elastic job; DeepSpeed takes its batch from\n";
  for (const auto& [key, value] :
       {std::pair{"train_batch_size", mode.batch.train_batch_size},
        {"train_micro_batch_size_per_gpu", mode.batch.micro_batch_per_gpu},
        {"gradient_accumulation_steps", mode.batch.gradient_accumulation_steps}})
    if (value) std::cout << fmt::format("  {} = {}\n", key, *value);
  print_results_heading(r, rule);
  if (r.final_batch_size > 0)
    std::cout << fmt::format("final_batch_size .... {}\n", r.final_batch_size);
  else
    std::cout << "final_batch_size .... train_micro_batch_size_per_gpu x "
                 "gradient_accumulation_steps x world size (give --world-size)\n";
  if (r.micro_batch_size) {
    std::cout << fmt::format("micro_batch_size .... {}\n", *r.micro_batch_size);
    std::cout << fmt::format("gradient_accumulation_steps .... {}\n",
                             *r.gradient_accumulation_steps);
  }
  return kExitOk;
}

bool is_disabled_without_batch(const nlohmann::json& root) {
  if (!root.is_object() || !root.contains("elasticity")) return false;
  const auto& block = root.at("elasticity");
  if (!block.is_object()) return false;
  const auto enabled = block.find("enabled");
  if (enabled != block.end() && (!enabled->is_boolean() || enabled->get<bool>())) return false;
  for (const char* key :
       {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"})
    if (root.contains(key)) return false;
  return true;
}

int run_elastic(const CliContext& context, const ElasticOptions& options) {
  if (options.world_size_given && options.world_size < 1)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("--world-size {} is invalid: give the total number of GPUs (>= 1)",
                            options.world_size),
                kElasticityError);
  // Checks the file (regular, within the cap) and tells JSON from TOML.
  const std::string text = core::read_user_file(options.config, "configuration file");
  std::vector<std::string> rule_warnings;
  if (pipeline::is_json_config(options.config, text)) {
    // DeepSpeedConfig's rules for the block beside the batch keys, first.
    const auto root = pipeline::parse_bounded_json(text, options.config, "invalid JSON",
                                                   ErrorKind::config, kElasticityConfigError);
    // A disabled block without any batch key is neither an elastic nor a
    // non-elastic job: the policy refuses it below, as compute_elastic_config does.
    if (!is_disabled_without_batch(root)) {
      const auto mode = pipeline::deepspeed_elasticity_mode(root, options.config);
      // (A bare block, the scheduler's form, has no batch keys beside it.)
      if (mode.has_block && !mode.elastic && root.contains("elasticity")) {
        const auto& block = root.at("elasticity");
        const auto enabled = block.find("enabled");
        return run_non_elastic(options, mode,
                               enabled == block.end() ? std::string(" absent, default false")
                                                      : " = " + pipeline::json_excerpt(*enabled));
      }
      rule_warnings = mode.warnings;
    }
  }
  auto loaded = load(context, options.config, text);
  pipeline::check_scheduler_elasticity(
      pipeline::fingerprint_of(loaded.source.policy, loaded.effective_params), core::logger(),
      loaded.runtime.registry());
  ElasticityRequest request;
  request.world_size = options.world_size_given ? options.world_size : 0;
  request.require_micro_batch = options.micro_batch;
  // A policy's search (the optimal policy's over a large cap) can take
  // seconds and reports nothing while it runs: on a terminal, a bar shows
  // the time it has taken so far, ended before the results are printed.
  ProgressBar progress("ductile elastic");
  progress.begin_stage(
      loaded.source.policy == "optimal" ? "searching batch sizes" : "computing the plan", 0);
  ElasticityResult result;
  try {
    result = loaded.policy->compute(request);
  } catch (const Error& e) {
    rethrow_with_option(e, options);
  }
  progress.finish();
  result.warnings.insert(result.warnings.begin(), rule_warnings.begin(), rule_warnings.end());
  if (options.json)
    print_json(loaded, result);
  else
    print_human(loaded, result);
  return kExitOk;
}

}  // namespace

void register_elastic_command(CLI::App& app, CliContext& context) {
  auto options = std::make_shared<ElasticOptions>();
  auto* elastic = app.add_subcommand(
      "elastic",
      "Compute the elastic plan of a configuration: the global batch size, the valid "
      "GPU counts and, for one world size, micro batch and gradient accumulation");
  elastic
      ->add_option("--config", options->config,
                   "ductile TOML configuration with an [elasticity] section, or a DeepSpeed JSON "
                   "config with an \"elasticity\" block (chosen by extension, else by content)")
      ->required();
  elastic
      ->add_option_function<std::int64_t>(
          "--world-size",
          [options](std::int64_t n) {
            options->world_size = n;
            options->world_size_given = true;
          },
          "Total number of GPUs of the job (model-parallel ranks included)")
      ->type_name("N");
  elastic->add_flag("--micro-batch", options->micro_batch,
                    "Fail unless a micro batch size can be given (needs --world-size), like "
                    "DeepSpeed's return_microbatch");
  elastic->add_flag("--json", options->json,
                    "Print one JSON object on stdout (errors as {\"error\": {\"type\", "
                    "\"message\"}})");
  set_action(
      elastic, context, [&context, options] { return run_elastic(context, *options); },
      &options->json);
}

void demo_elasticity(DemoContext& demo) {
  if (!demo.runtime.has(PluginKind::elasticity)) return;
  const auto* section = demo.runtime.config().section(PluginKind::elasticity);
  if (!section) return;
  auto& out = demo.out;
  out << fmt::format("\n-- elasticity: policy '{}' --\n", section->plugin);
  auto policy = demo.runtime.get<ElasticityPolicy>();
  auto plan = [&](std::int64_t world_size) -> std::optional<ElasticityResult> {
    try {
      return policy->compute(ElasticityRequest{world_size, false});
    } catch (const Error& e) {
      out << fmt::format("  world size {:>5}: rejected ({}): {}\n", world_size,
                         e.type().empty() ? to_string(e.kind()) : e.type(), e.what());
      return std::nullopt;
    }
  };
  std::vector<std::int64_t> sizes;
  std::optional<ElasticityResult> base;
  try {
    base = policy->compute(ElasticityRequest{});
    out << fmt::format("  final batch size {} is valid on {} GPU counts: {}\n",
                       base->final_batch_size, base->valid_gpus.size(),
                       list_text(base->valid_gpus));
    const auto& v = base->valid_gpus;
    if (!v.empty()) {
      sizes = {v.front(), v[v.size() / 2], v.back()};
      // And one count that is not in the list, to show the rejection.
      for (std::int64_t n = v.front() + 1; n < v.back(); ++n)
        if (!std::binary_search(v.begin(), v.end(), n)) {
          sizes.push_back(n);
          break;
        }
    }
  } catch (const Error& e) {
    out << fmt::format("  without a world size: {}\n", e.what());
    sizes = std::vector<std::int64_t>{8, 16, 24, 64};
  }
  for (auto n : sizes) {
    auto r = plan(n);
    if (!r) continue;
    out << fmt::format(
        "  world size {:>5}: batch {} = micro {} x accumulation {} x data-parallel "
        "{}{}\n",
        n, r->final_batch_size, *r->micro_batch_size, *r->gradient_accumulation_steps,
        *r->data_parallel_size, r->fallback ? "  [fallback: valid for this size only]" : "");
  }
  // The same settings under the optimal policy, when it is not the one chosen.
  if (base && section->plugin != "optimal") {
    try {
      auto optimal = demo.runtime.create<ElasticityPolicy>("optimal", section->params);
      auto r = optimal->compute(ElasticityRequest{});
      out << fmt::format(
          "  optimal policy on the same settings: batch {} valid on {} GPU counts "
          "(policy '{}': {})\n",
          r.final_batch_size, r.valid_gpus.size(), section->plugin, base->valid_gpus.size());
    } catch (const std::exception&) {
      // A custom policy's parameters need not suit the optimal policy.
    }
  }
}

}  // namespace ductile::cli
