// DeepSpeed JSON configs read as ductile configurations: the one mapping of
// DeepSpeed's keys onto ductile's sections, for the CLI, the Python package
// and the agent alike.
//
//   elasticity.{version, policy, enabled, <the policy's keys>}  -> [elasticity]
//   zero_optimization.stage3_prefetch_bucket_size                -> [zero] prefetch_bucket_size
//   zero_optimization.stage3_max_live_parameters                 -> [zero] max_live_parameters
//   zero_optimization.stage3_max_reuse_distance                  -> [zero] max_reuse_distance
//   zero_optimization.stage3_param_persistence_threshold         -> [zero]
//   param_persistence_threshold zero_optimization.offload_param {device "nvme", nvme_path,
//   buffer_count}
//                                                  -> [zero] nvme_path, nvme_buffer_count
//   zero_optimization.offload_optimizer {device, pin_memory, ratio}
//                                                  -> [zero] offload_optimizer, offload_pin_memory,
//                                                     offload_ratio
//
// ([zero] only for stage 3; dynamic batching and its learning rate are read
// by parse_deepspeed_batching, deepspeed_batching.hpp.) Each value is typed
// once, here, by the schema of the plugin that takes it, and then checked by
// core::Config::validate like a TOML file's: bounds, allowed strings and the
// plugin's validate hook. Every message names the user's file and the
// user's key ("zero_optimization.stage3_prefetch_bucket_size"). A value
// "auto" (Hugging Face's placeholder) keeps ductile's default. Keys DeepSpeed
// has and ductile does not act on are dropped with a warning saying so.
//
// Errors: core::ConfigError for values the schemas refuse; Error typed
// ElasticityConfigError (ErrorKind::config) for an elasticity block
// DeepSpeed would refuse (same wording); Error(config) for invalid JSON,
// nesting deeper than 64 levels, and what DeepSpeedOptions requires.
// Threading: no shared state; a registry is only read.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "ductile/core/config.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/core/runtime.hpp"

namespace ductile::pipeline {

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
};

struct DeepSpeedSections {
  core::ConfigDocument document;      // entries naming the user's keys
  std::vector<std::string> warnings;  // keys accepted but not acted on
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
// deepspeed_sections and validated (with `runtime_options.plugin_checks`,
// every plugin's validate hook too). Warnings are appended to `warnings`
// when given, else logged.
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

// The same on the registry of `base` (shared with the result).
core::Runtime runtime_from_deepspeed(const core::Runtime& base, std::string_view json_text,
                                     std::string_view origin, const std::filesystem::path& base_dir,
                                     bool plugin_checks, const DeepSpeedOptions& options = {},
                                     std::vector<std::string>* warnings = nullptr);

}  // namespace ductile::pipeline
