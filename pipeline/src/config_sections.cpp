// What the pipeline reads from a configuration file beside the plugins'
// parameters, registered with the core as its library loads: [batching]'s
// lengths file, [lr]'s base schedule and DeepSpeed's `version = 0.1` naming
// the [elasticity] policy. The core validates these keys like any other and
// holds none of their words.
#include <fmt/format.h>

#include "ductile/core/config.hpp"
#include "ductile/core/text.hpp"
#include "ductile/pipeline/deepspeed_config.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/lengths.hpp"
#include "ductile/pipeline/lr_schedule.hpp"

namespace ductile::pipeline {
namespace {

std::string policy_for_version_key(std::string_view text,
                                   const std::optional<std::string>& selected) {
  const std::string value(text);
  const std::string policy =
      policy_for_elasticity_version(value, core::excerpt(value), "[elasticity] version");
  // A file may keep DeepSpeed's version while naming a policy of its own;
  // naming another of the versions' policies is a contradiction.
  if (selected && *selected != policy && selected->starts_with("v"))
    throw Error(ErrorKind::config,
                fmt::format("[elasticity] version = {} contradicts policy = \"{}\"; give one "
                            "of them",
                            core::excerpt(value), core::excerpt(*selected)));
  return selected ? *selected : policy;
}

constexpr const char* kOffloadDevices[] = {"none", "cpu", nullptr};

bool register_sections() {
  core::extend_section(
      "batching",
      {{.key = "lengths",
        .type = ParamType::string,
        .doc = "File of per-sample lengths (text, CSV, .npy or DeepSpeed metric prefix), "
               "relative to the config file"},
       {.key = "column", .type = ParamType::string, .doc = "CSV column holding the lengths"},
       {.key = "count_column",
        .type = ParamType::string,
        .doc = "CSV column of counts: the file is a histogram (length, count)"},
       {.key = "format",
        .type = ParamType::string,
        .default_value = "\"auto\"",
        .allowed_values = kLengthFormatNames,
        .doc = "Format of the lengths file (auto: from the extension)"}});
  // What the front ends that run ZeRO-3 (ductile.torch.zero3) read beside
  // the coordinator's keys; DeepSpeed's zero_optimization.offload_optimizer
  // and offload_param (device "cpu"), the engine's progress lines, and its
  // in-memory snapshots (DeepSpeed spelling: the top-level "snapshot" object).
  core::extend_section(
      "zero",
      {{.key = "offload_optimizer",
        .type = ParamType::string,
        .default_value = "\"none\"",
        .allowed_values = kOffloadDevices,
        .doc = "Where the optimizer state and step live: none (the device) or cpu (host memory, "
               "stepped by cpu_adam)"},
       {.key = "offload_param",
        .type = ParamType::string,
        .default_value = "\"none\"",
        .allowed_values = kOffloadDevices,
        .doc = "Where the parameter shards live: none (the device) or cpu (pinned host memory, "
               "copied to the device for each gather; the optimizer is offloaded with them)"},
       {.key = "offload_ratio",
        .type = ParamType::floating,
        .flags = param_has_min | param_has_max,
        .default_value = "1.0",
        .max_value = 1,
        .doc = "Share of the optimizer bytes offloaded when offload_optimizer is cpu"},
       {.key = "offload_pin_memory",
        .type = ParamType::boolean,
        .default_value = "true",
        .doc = "Pinned host buffers for the offloaded state (cuda)"},
       {.key = "offload_pipeline",
        .type = ParamType::boolean,
        .default_value = "false",
        .doc = "With offload_optimizer cpu: the backward that syncs gradients steps each "
               "offloaded group on a worker thread as soon as its gradient is on the host "
               "(clipping, fp16 loss scaling and a measured norm wait for every gradient: "
               "their steps run in step())"},
       {.key = "log_interval",
        .type = ParamType::integer,
        .flags = param_has_min | param_has_max,
        .default_value = "0",
        .max_value = static_cast<double>(kMaxLogInterval),
        .doc = "Optimizer steps between the engine's progress lines (logger ductile.zero3, "
               "rank 0): step, loss scale, learning rate, step time, throughput, peak memory, "
               "gather wait, offload traffic; 0: off"},
       {.key = "snapshot_interval",
        .type = ParamType::integer,
        .flags = param_has_min,
        .default_value = "1",
        .doc = "Optimizer steps between in-memory snapshots of the training state, written "
               "into DUCTILE_SNAPSHOT_DIR (set by `ductile agent`) when the step is a multiple "
               "of it; 0: none"},
       {.key = "snapshot_replicas",
        .type = ParamType::integer,
        .flags = param_has_min,
        .default_value = "1",
        .doc = "Other nodes that hold a copy of each node's newest snapshot (the agents "
               "replicate it); 0: none"}});
  core::extend_section("lr",
                       {{.key = "base_lr",
                         .type = ParamType::floating,
                         .flags = param_has_min,
                         .default_value = "0.001",
                         .doc = "Learning rate tuned for base_batch_size (peak of the schedule)"},
                        {.key = "base_batch_size",
                         .type = ParamType::floating,
                         .flags = param_has_min,
                         .min_value = 1,
                         .doc = "Batch size (samples) that base_lr is tuned for"},
                        {.key = "schedule",
                         .type = ParamType::string,
                         .default_value = "\"constant\"",
                         .allowed_values = kLrScheduleNames,
                         .doc = "Base schedule: constant, warmup_linear or warmup_cosine"},
                        {.key = "warmup_steps",
                         .type = ParamType::integer,
                         .flags = param_has_min,
                         .default_value = "0",
                         .doc = "Steps of linear warm-up from min_lr to base_lr"},
                        {.key = "total_steps",
                         .type = ParamType::integer,
                         .flags = param_has_min,
                         .default_value = "0",
                         .doc = "Step at which the decay reaches min_lr"},
                        {.key = "min_lr",
                         .type = ParamType::floating,
                         .flags = param_has_min,
                         .default_value = "0.0",
                         .doc = "Learning rate at the start of warm-up and the end of decay"}});
  core::extend_section(
      "elasticity", {},
      core::SelectorAlias{"version", "a number such as 0.1 or 0.2", policy_for_version_key});
  return true;
}

// Runs when libductile_pipeline is loaded, before anything of it can be
// called: every process that can read a pipeline key has them registered.
[[maybe_unused]] const bool registered = register_sections();

}  // namespace
}  // namespace ductile::pipeline
