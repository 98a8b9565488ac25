// DeepSpeed JSON configurations for dynamic batching:
// data_efficiency.data_sampling.dynamic_batching (same keys and defaults as
// DeepSpeed) as the greedy sampler's parameters, the LR scaling rule and the
// base learning-rate schedule. The keys are mapped by the one DeepSpeed
// mapping (deepspeed_config.hpp, read_batching) onto [batching] and [lr],
// which are validated as a TOML file's and read as a TOML file's
// (pack_setup_from_config): one route for both formats.
//
// DeepSpeed keys read: dynamic_batching.{enabled (false), max_tokens
// (required), lr_scaling_method ("linear"), sequence_picking_order
// ("dataloader"; the older name sentence_picking_order is accepted),
// min_batch_size (1), max_batch_size (null), metrics_path
// ("./curriculum_output/"), verbose (false)}; data_efficiency.seed (1234);
// train_batch_size (the micro-batches of one step and the LR's base batch
// size, as DeepSpeed's engine passes them; else micro batch x gradient
// accumulation; else 1); optimizer.params.lr; scheduler WarmupDecayLR with
// warmup_type "linear" (others are refused with a clear error).
//
// Errors: core::ConfigError (ErrorKind::config) naming the source, the key
// path and the bad value; Error(unsupported) for a scheduler with no ductile
// equivalent. Threading: no shared state; safe to call concurrently (a
// registry is only read).
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "ductile/core/registry.hpp"
#include "ductile/params.hpp"
#include "ductile/pipeline/pack_plan.hpp"

namespace ductile::pipeline {

struct DeepSpeedBatching {
  bool enabled = false;  // dynamic_batching.enabled: DeepSpeed batches dynamically only then
  // The greedy sampler with DeepSpeed's parameters, the lr rule and base
  // schedule, lengths from <metrics_path>/seqlen/seqlen_sample_to_metric
  // (DeepSpeed's metric files): what pack_setup_from_config reads from the
  // [batching] and [lr] sections the config maps onto.
  PackSetup setup;
};

// `source` names the text in messages; relative metrics paths resolve
// against `base_dir`. lr_scaling_method names any lr plugin of `registry`
// (case-insensitive; null means "none"), and the optional ductile key
// lr_scaling_params (an object) gives that rule's parameters, typed by its
// schema. Without a registry, one on PluginRegistry::default_search_path()
// (DUCTILE_PLUGIN_PATH, then the built-in plugins) is used.
DeepSpeedBatching parse_deepspeed_batching(std::string_view json_text, std::string_view source,
                                           const std::filesystem::path& base_dir = {});
DeepSpeedBatching parse_deepspeed_batching(std::string_view json_text, std::string_view source,
                                           const std::filesystem::path& base_dir,
                                           const core::PluginRegistry& registry);

}  // namespace ductile::pipeline
