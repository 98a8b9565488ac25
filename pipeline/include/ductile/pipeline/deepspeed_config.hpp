// DeepSpeed JSON configs read as ductile configurations: the one mapping of
// DeepSpeed's keys onto ductile's sections, for the CLI, the Python package
// and the agent alike.
//
//   elasticity.{version, policy, enabled, <the policy's keys>}  -> [elasticity]
//   zero_optimization.stage3_prefetch_bucket_size    -> [zero] prefetch_bucket_size
//   zero_optimization.stage3_max_live_parameters     -> [zero] max_live_parameters
//   zero_optimization.stage3_max_reuse_distance      -> [zero] max_reuse_distance
//   zero_optimization.stage3_param_persistence_threshold
//                                                    -> [zero] param_persistence_threshold
//   zero_optimization.offload_param {device "nvme", nvme_path, buffer_count}
//                                                    -> [zero] nvme_path, nvme_buffer_count
//   zero_optimization.offload_param {device "cpu"}   -> [zero] offload_param
//   zero_optimization.offload_optimizer {device, pin_memory, ratio}
//                                                    -> [zero] offload_optimizer,
//                                                       offload_pin_memory, offload_ratio
//   data_efficiency.data_sampling.dynamic_batching {max_tokens, min_batch_size,
//     max_batch_size, sequence_picking_order, metrics_path}, data_efficiency.seed,
//   train_batch_size (or micro batch x gradient accumulation)
//                                                    -> [batching] sampler "greedy" and its keys,
//                                                       lengths (metrics_path's seqlen files)
//   dynamic_batching.{lr_scaling_method, lr_scaling_params}, optimizer.params.lr,
//   scheduler WarmupDecayLR {warmup_min_lr, warmup_max_lr, warmup_num_steps, total_num_steps}
//                                                    -> [lr] rule and its keys, base_lr,
//                                                       base_batch_size, schedule, ...
//
// [zero] only for stage 3; [batching] and [lr] when DeepSpeedOptions::
// read_batching asks (parse_deepspeed_batching, deepspeed_batching.hpp).
// What configures the training framework rather than a plugin is read in the
// same pass, when DeepSpeedOptions::read_training asks, into
// DeepSpeedTraining: bf16 / fp16 (with fp16's loss scaling),
// gradient_clipping, optimizer {type Adam or AdamW, params}, scheduler
// {type, params} (deepspeed_schedules.hpp), the batch triple,
// steps_per_print, wall_clock_breakdown, log_level, dataloader_drop_last.
// Each value is
// typed once, here, by the schema of the plugin that takes it, and then
// checked by core::Config::validate like a TOML file's: bounds, allowed
// strings and the plugin's validate hook. Every message names the user's
// file and the user's key ("zero_optimization.stage3_prefetch_bucket_size").
// A value "auto" (Hugging Face's placeholder) keeps ductile's default.
// Every top-level key and every zero_optimization key is accounted for
// (deepspeed_keys.cpp): one ductile does not act on is warned about by
// name; one that would change what is trained (amp, progressive layer drop,
// ...) is refused when read_training asks, and warned about otherwise
// (check_training: the same keys checked, the engine's refusals warned); a
// key DeepSpeed does not have is warned about.
//
// Errors: core::ConfigError for values the schemas refuse; Error typed
// ElasticityConfigError (ErrorKind::config) for an elasticity block
// DeepSpeed would refuse (same wording); Error(config) for invalid JSON,
// nesting deeper than 64 levels, and what DeepSpeedOptions requires.
// Threading: no shared state; a registry is only read.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ductile/core/config.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/pipeline/deepspeed_schedules.hpp"

namespace ductile::pipeline {

// The largest train_batch_size, train_micro_batch_size_per_gpu and
// gradient_accumulation_steps (2^31-1): the engine multiplies them with the
// world size, which stays far from 64 bits.
inline constexpr std::int64_t kMaxDeepSpeedBatchValue = 2147483647;
// The most optimizer steps between two progress lines: [zero] log_interval's
// bound in its schema, DeepSpeed's steps_per_print's (which sets it) and the
// engine's log_interval attribute's.
inline constexpr std::int64_t kMaxLogInterval = 1000000000;

// What the caller needs from the config; what it lacks is then an error
// naming the key to add.
struct DeepSpeedOptions {
  // An enabled "elasticity" block (DeepSpeed's messages when it is missing
  // or disabled).
  bool require_elasticity = false;
  // zero_optimization.stage = 3.
  bool require_zero_stage3 = false;
  // [accelerator] backend for the [zero] section ("cuda", "cpu"); empty: no
  // [accelerator] section. A DeepSpeed config names no backend: the caller
  // knows the device.
  std::string accelerator_backend{};
  // Also read what configures the training framework (DeepSpeedTraining):
  // zero3 builds torch objects from it. Off, those keys are not looked at
  // (an elastic job's config may name any optimizer DeepSpeed has).
  bool read_training = false;
  // Read and check the same keys, by the same rules, as read_training does,
  // but for a config DeepSpeed itself may train: what only ductile's engine
  // refuses (a refused top-level key, an optimizer other than Adam or AdamW)
  // is a warning naming it. `ductile config check` asks.
  bool check_training = false;
  // Also map data_efficiency.data_sampling.dynamic_batching, when present,
  // onto [batching] (the greedy sampler, DeepSpeed's batch_by_seqlens) and
  // [lr] (lr_scaling_method's rule, optimizer.params.lr, WarmupDecayLR):
  // `ductile config check` and parse_deepspeed_batching ask.
  bool read_batching = false;
  // The dynamic_batching block must be there (parse_deepspeed_batching).
  bool require_batching = false;
};

// What a DeepSpeed config sets for the training framework (the torch objects
// ductile.torch.zero3 builds), typed and checked; "auto" or absent keeps the
// default written here.
struct DeepSpeedTraining {
  // "bf16" (bf16.enabled, or bfloat16.enabled), "fp16" (fp16.enabled) or
  // "fp32"; both enabled is an error.
  std::string precision = "fp32";
  // fp16: a static scale (loss_scale > 0), or dynamic scaling (loss_scale 0)
  // from 2^initial_scale_power, grown after loss_scale_window steps without
  // overflow, backed off after `hysteresis` overflows, never below
  // min_loss_scale.
  double loss_scale = 0.0;
  std::int64_t initial_scale_power = 16;
  std::int64_t loss_scale_window = 1000;
  std::int64_t hysteresis = 2;
  double min_loss_scale = 1.0;
  // gradient_clipping > 0 (0 or absent: no clipping).
  std::optional<double> gradient_clipping;
  // optimizer {type, params}: Adam or AdamW (DeepSpeed's Adam decouples its
  // weight decay unless params.adam_w_mode is false); a parameter not given
  // keeps the framework's default.
  struct Optimizer {
    std::string type;  // as written
    bool decoupled_weight_decay = true;
    std::optional<double> lr, eps, weight_decay;
    std::optional<std::array<double, 2>> betas;
  };
  std::optional<Optimizer> optimizer;
  // The batch triple as written (each >= 1; the engine completes it with
  // the world size as DeepSpeed does), steps_per_print (absent: no
  // progress lines), wall_clock_breakdown, dataloader_drop_last.
  std::optional<std::int64_t> train_batch_size, train_micro_batch_size_per_gpu,
      gradient_accumulation_steps, steps_per_print;
  bool wall_clock_breakdown = false;
  bool dataloader_drop_last = false;
  // log_level, lower case ("debug" ... "critical"): the level of the
  // engine's progress lines' logger, as DeepSpeed's; absent: "warning".
  std::string log_level = "warning";
  // scheduler {type, params}: one of DeepSpeed's five schedulers
  // (deepspeed_schedules.hpp), each parameter typed and checked; a parameter
  // the type does not have is warned about and dropped. nullopt: no
  // scheduler (the optimizer's rate throughout).
  std::optional<DeepSpeedScheduleSpec> scheduler;
};

struct DeepSpeedSections {
  core::ConfigDocument document;      // entries naming the user's keys
  std::vector<std::string> warnings;  // keys accepted but not acted on
  DeepSpeedTraining training;
  bool batching_enabled = false;  // dynamic_batching.enabled (read_batching)
};

// Maps `json_text` (a whole DeepSpeed config; for elasticity also the block
// alone) onto ductile's sections, typing each value by `registry`'s schemas.
// `origin` names the file in messages; relative paths resolve against
// `base_dir`.
DeepSpeedSections deepspeed_sections(std::string_view json_text, std::string_view origin,
                                     const std::filesystem::path& base_dir,
                                     const core::PluginRegistry& registry,
                                     const DeepSpeedOptions& options = {});

// A runtime of a DeepSpeed config: the plugins found once (`options`' extra
// directories, DUCTILE_PLUGIN_PATH, the built-in ones), the config mapped by
// deepspeed_sections and validated, every plugin's validate hook included
// (a problem is then named by the file and the user's DeepSpeed key). Only
// a caller that requires the elasticity block may leave the hooks out
// (`runtime_options.plugin_checks` false): the policy then reports its
// typed errors (ElasticityConfigError) from compute(). Warnings are
// appended to `warnings` when given, else logged.
core::Runtime runtime_from_deepspeed(std::string_view json_text, std::string_view origin,
                                     const std::filesystem::path& base_dir,
                                     core::RuntimeOptions runtime_options,
                                     const DeepSpeedOptions& options = {},
                                     std::vector<std::string>* warnings = nullptr);

// The same for the text of `file` that the caller has read already: named
// by the file, relative paths resolved against its directory.
core::Runtime runtime_from_deepspeed_file(const std::filesystem::path& file,
                                          std::string_view json_text,
                                          core::RuntimeOptions runtime_options,
                                          const DeepSpeedOptions& options = {},
                                          std::vector<std::string>* warnings = nullptr);

// The same on the registry of `base` (shared with the result); the
// framework's settings are stored in `training` when given.
core::Runtime runtime_from_deepspeed(const core::Runtime& base, std::string_view json_text,
                                     std::string_view origin, const std::filesystem::path& base_dir,
                                     bool plugin_checks, const DeepSpeedOptions& options = {},
                                     std::vector<std::string>* warnings = nullptr,
                                     DeepSpeedTraining* training = nullptr);

// [zero]'s optimizer offload keys (offload_optimizer, offload_ratio,
// offload_pin_memory, defaults filled in) of `json_object`, a DeepSpeed
// offload_optimizer object given apart from a config (zero3.initialize's
// offload_optimizer argument), mapped and checked exactly as the one inside
// zero_optimization; messages name `origin` and "offload_optimizer.<key>".
// Warnings as runtime_from_deepspeed's. Throws core::ConfigError, or
// Error(config) for invalid JSON.
Params deepspeed_offload_optimizer(std::string_view json_object, std::string_view origin,
                                   const core::PluginRegistry& registry,
                                   std::vector<std::string>* warnings);

}  // namespace ductile::pipeline
