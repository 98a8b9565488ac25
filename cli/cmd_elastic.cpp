// ductile elastic --config FILE [--world-size N] [--json]: the elastic plan of
// a configuration (TOML, or a DeepSpeed JSON config), like DeepSpeed's
// ds_elastic; and the elasticity part of `ductile demo`.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/files.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/elasticity_policy.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/json.hpp"

namespace ductile::cli {
namespace {

struct ElasticOptions {
  std::string config;
  std::int64_t world_size = 0;
  bool world_size_given = false;
  bool micro_batch = false;
  bool json = false;
};

pipeline::LoadedElasticity load(const CliContext& context, const std::string& file) {
  // Checks the file (regular, within the cap) and tells JSON from TOML.
  const std::string text = core::read_user_file(file, "configuration file");
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
  j["policy"] = loaded.source.policy;
  j["source"] = loaded.source.origin;
  std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
}

void print_human(const pipeline::LoadedElasticity& loaded, const ElasticityResult& r) {
  const std::string rule(42, '-');
  std::cout << rule << "\nElasticity config (policy " << loaded.source.policy << ", from "
            << loaded.source.origin << "):\n"
            << rule << "\n";
  for (const auto& [key, value] : loaded.effective_params.values())
    std::cout << fmt::format("  {} = {}\n", key, core::format_param_value(value));
  std::cout << rule << "\n";
  if (r.world_size)
    std::cout << fmt::format("Calculated results for world size {}:\n", *r.world_size);
  else
    std::cout << "Calculated results:\n";
  std::cout << rule << "\n";
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

int run_elastic(const CliContext& context, const ElasticOptions& options) {
  if (options.world_size_given && options.world_size < 1)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("--world-size {} is invalid: give the total number of GPUs (>= 1)",
                            options.world_size),
                kElasticityError);
  auto loaded = load(context, options.config);
  pipeline::check_scheduler_elasticity(
      pipeline::fingerprint_of(loaded.source.policy, loaded.effective_params), core::logger(),
      loaded.runtime.registry());
  ElasticityRequest request;
  request.world_size = options.world_size_given ? options.world_size : 0;
  request.require_micro_batch = options.micro_batch;
  auto result = loaded.policy->compute(request);
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
