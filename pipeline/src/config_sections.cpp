// What the pipeline reads from a configuration file beside the plugins'
// parameters, registered with the core as its library loads: [batching]'s
// lengths file, [lr]'s base schedule and DeepSpeed's `version = 0.1` naming
// the [elasticity] policy. The core validates these keys like any other and
// holds none of their words.
#include <cstdlib>

#include <fmt/format.h>

#include "ductile/core/config.hpp"
#include "ductile/core/text.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/lengths.hpp"
#include "ductile/pipeline/lr_schedule.hpp"

namespace ductile::pipeline {
namespace {

std::string policy_for_version_key(std::string_view text,
                                   const std::optional<std::string>& selected) {
  const std::string value(text);
  const std::string policy = policy_for_elasticity_version(std::strtod(value.c_str(), nullptr),
                                                           value, "[elasticity] version");
  // A file may keep DeepSpeed's version while naming a policy of its own;
  // naming another of the versions' policies is a contradiction.
  if (selected && *selected != policy && selected->starts_with("v"))
    throw Error(ErrorKind::config,
                fmt::format("[elasticity] version = {} contradicts policy = \"{}\"; give one "
                            "of them",
                            core::excerpt(value), core::excerpt(*selected)));
  return selected ? *selected : policy;
}

bool register_sections() {
  core::extend_section(
      "batching",
      {{"lengths", ParamType::string, 0, nullptr, 0, 0, nullptr,
        "File of per-sample lengths (text, CSV, .npy or DeepSpeed metric prefix), "
        "relative to the config file"},
       {"column", ParamType::string, 0, nullptr, 0, 0, nullptr, "CSV column holding the lengths"},
       {"count_column", ParamType::string, 0, nullptr, 0, 0, nullptr,
        "CSV column of counts: the file is a histogram (length, count)"},
       {"format", ParamType::string, 0, "\"auto\"", 0, 0, kLengthFormatNames,
        "Format of the lengths file (auto: from the extension)"}});
  core::extend_section(
      "lr", {{"base_lr", ParamType::floating, param_has_min, "0.001", 0, 0, nullptr,
              "Learning rate tuned for base_batch_size (peak of the schedule)"},
             {"base_batch_size", ParamType::floating, param_has_min, nullptr, 1, 0, nullptr,
              "Batch size (samples) that base_lr is tuned for"},
             {"schedule", ParamType::string, 0, "\"constant\"", 0, 0, kLrScheduleNames,
              "Base schedule: constant, warmup_linear or warmup_cosine"},
             {"warmup_steps", ParamType::integer, param_has_min, "0", 0, 0, nullptr,
              "Steps of linear warm-up from min_lr to base_lr"},
             {"total_steps", ParamType::integer, param_has_min, "0", 0, 0, nullptr,
              "Step at which the decay reaches min_lr"},
             {"min_lr", ParamType::floating, param_has_min, "0.0", 0, 0, nullptr,
              "Learning rate at the start of warm-up and the end of decay"}});
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
