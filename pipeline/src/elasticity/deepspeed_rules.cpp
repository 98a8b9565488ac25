// DeepSpeedConfig's rules for an elasticity block beside a config's batch
// keys, and the batch of a non-elastic job. See ductile/pipeline/elasticity.hpp.
#include <algorithm>
#include <cstdint>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ductile/core/text.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/json.hpp"
#include "elasticity/elasticity_internal.hpp"

namespace ductile::pipeline {

using json = nlohmann::json;
using detail::elasticity_config_error;

namespace {

constexpr const char* kTrainBatch = "train_batch_size";
constexpr const char* kMicroBatch = "train_micro_batch_size_per_gpu";
constexpr const char* kAccumulation = "gradient_accumulation_steps";
constexpr const char* kIgnoreKey = "ignore_non_elastic_batch_info";

// A value DeepSpeed reads as true or false; absent: `absent`.
bool flag_of(const json& block, const char* key, bool absent, std::string_view origin) {
  auto it = block.find(key);
  if (it == block.end()) return absent;
  if (!it->is_boolean())
    elasticity_config_error(fmt::format("{}: elasticity.{} = {} is invalid: give true or false",
                                        origin, key, json_excerpt(*it)));
  return it->get<bool>();
}

// "train_batch_size = 8, gradient_accumulation_steps = 2".
std::string given_text(const json& root, const std::vector<std::string>& keys) {
  std::vector<std::string> parts;
  for (const auto& key : keys) parts.push_back(key + " = " + json_excerpt(root.at(key)));
  return core::join(parts);
}

// Reads one batch key of a non-elastic job into `slot`: an integer >= 1,
// "auto", or null (absent, as DeepSpeed's default None).
void read_batch_key(const json& root, const char* key, std::optional<std::int64_t>& slot,
                    DeepSpeedBatchKeys& keys, std::string_view origin) {
  auto it = root.find(key);
  if (it == root.end() || it->is_null()) return;
  if (it->is_string() && it->get_ref<const std::string&>() == "auto") {
    keys.automatic.emplace_back(key);
    return;
  }
  if (!it->is_number_integer() || it->get<std::int64_t>() < 1)
    elasticity_config_error(fmt::format(
        "{}: {} = {} is invalid for a non-elastic job (the elasticity block is disabled): "
        "give an integer >= 1",
        origin, key, json_excerpt(*it)));
  slot = it->get<std::int64_t>();
}

[[noreturn]] void no_batch_size(std::string_view origin, const std::string& enabled_text) {
  elasticity_config_error(fmt::format(
      "{}: elasticity is disabled ({}), so this is a non-elastic job, and it gives no batch "
      "size: set {} or {} (integers >= 1), or elasticity.enabled = true for an elastic plan",
      origin, enabled_text, kTrainBatch, kMicroBatch));
}

std::string enabled_text(const json& block) {
  auto it = block.find("enabled");
  return it == block.end() ? "elasticity.enabled is absent; its default is false"
                           : "elasticity.enabled = " + json_excerpt(*it);
}

// micro x accumulation x world, or nullopt above 2^63 - 1.
std::optional<std::int64_t> product(std::int64_t a, std::int64_t b, std::int64_t c) {
  std::int64_t ab = 0, abc = 0;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) return std::nullopt;
  return abc;
}

std::string keys_text(const DeepSpeedBatchKeys& k) {
  std::vector<std::string> parts;
  if (k.train_batch_size) parts.push_back(fmt::format("{} = {}", kTrainBatch, *k.train_batch_size));
  if (k.micro_batch_per_gpu)
    parts.push_back(fmt::format("{} = {}", kMicroBatch, *k.micro_batch_per_gpu));
  if (k.gradient_accumulation_steps)
    parts.push_back(fmt::format("{} = {}", kAccumulation, *k.gradient_accumulation_steps));
  return core::join(parts);
}

}  // namespace

DeepSpeedElasticityMode parse_deepspeed_elasticity_mode(std::string_view json_text,
                                                        std::string_view origin) {
  const json root = parse_bounded_json(json_text, origin, "invalid JSON", ErrorKind::config,
                                       kElasticityConfigError);
  return deepspeed_elasticity_mode(root, origin);
}

DeepSpeedElasticityMode deepspeed_elasticity_mode(const json& root, std::string_view origin) {
  if (!root.is_object())
    elasticity_config_error(fmt::format("{}: a DeepSpeed config must be a JSON object, got {}",
                                        origin, json_excerpt(root)));
  DeepSpeedElasticityMode mode;
  auto block_it = root.find("elasticity");
  if (block_it == root.end()) {
    // The scheduler's copy is the block alone: nothing beside it.
    if (detail::looks_like_block(root)) {
      mode.has_block = true;
      mode.elastic = flag_of(root, "enabled", false, origin);
    }
    return mode;
  }
  const json& block = *block_it;
  if (!block.is_object())
    elasticity_config_error(
        fmt::format("{}: 'elasticity' must be an object, got {}", origin, json_excerpt(block)));
  mode.has_block = true;
  mode.elastic = flag_of(block, "enabled", false, origin);
  for (const char* key : {kTrainBatch, kMicroBatch, kAccumulation})
    if (root.contains(key)) mode.batch.given.emplace_back(key);

  if (mode.elastic) {
    if (mode.batch.given.empty()) return mode;
    const std::string given = given_text(root, mode.batch.given);
    if (!flag_of(block, kIgnoreKey, false, origin))
      elasticity_config_error(fmt::format(
          "{}: {} {} beside an enabled elasticity block, which sets the batch itself "
          "(DeepSpeed refuses this config too): remove {}, or set elasticity.{} = true to have "
          "the elastic plan override {}",
          origin, given, mode.batch.given.size() == 1 ? "is set" : "are set",
          mode.batch.given.size() == 1 ? "it" : "them", kIgnoreKey,
          mode.batch.given.size() == 1 ? "it" : "them"));
    for (const auto& key : mode.batch.given)
      mode.warnings.push_back(
          fmt::format("{}: {} = {} is ignored: the elastic plan sets the batch "
                      "(elasticity.{} = true)",
                      origin, key, json_excerpt(root.at(key)), kIgnoreKey));
    return mode;
  }

  // A non-elastic job: DeepSpeed takes its batch from these keys.
  auto& k = mode.batch;
  read_batch_key(root, kTrainBatch, k.train_batch_size, k, origin);
  read_batch_key(root, kMicroBatch, k.micro_batch_per_gpu, k, origin);
  read_batch_key(root, kAccumulation, k.gradient_accumulation_steps, k, origin);
  auto automatic = [&](const char* key) {
    return std::find(k.automatic.begin(), k.automatic.end(), key) != k.automatic.end();
  };
  if (!k.train_batch_size && !k.micro_batch_per_gpu && !automatic(kTrainBatch) &&
      !automatic(kMicroBatch))
    no_batch_size(origin, enabled_text(block));
  if (k.train_batch_size) {
    // Valid for some world size: train_batch_size a multiple of the rest.
    const std::int64_t micro = k.micro_batch_per_gpu.value_or(1);
    const std::int64_t steps = k.gradient_accumulation_steps.value_or(1);
    const auto per_rank = product(micro, steps, 1);
    if (!per_rank || *k.train_batch_size % *per_rank != 0)
      elasticity_config_error(fmt::format(
          "{}: {} fit no world size: DeepSpeed needs {} = {} x {} x world size, so {} must be a "
          "multiple of {} x {} = {}",
          origin, keys_text(k), kTrainBatch, kMicroBatch, kAccumulation, kTrainBatch, micro, steps,
          per_rank ? fmt::format("{}", *per_rank) : std::string("more than 2^63 - 1")));
  }
  return mode;
}

ElasticityResult non_elastic_plan(const DeepSpeedBatchKeys& keys, std::int64_t world_size,
                                  std::string_view origin) {
  if (!keys.automatic.empty())
    elasticity_config_error(
        fmt::format("{}: {} = \"auto\" is a placeholder Hugging Face's integration fills in; the "
                    "non-elastic batch needs the number: give an integer >= 1",
                    origin, keys.automatic.front()));
  if (!keys.train_batch_size && !keys.micro_batch_per_gpu)
    no_batch_size(origin, "elasticity.enabled is false");
  if (world_size < 0)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("world size {} is invalid: give a positive GPU count (or 0 for none)",
                            world_size),
                kElasticityError);
  ElasticityResult r;
  r.final_batch_size = keys.train_batch_size.value_or(0);
  if (world_size == 0) return r;

  // DeepSpeedConfig._set_batch_related_parameters: the missing keys from
  // the given ones, with its floor divisions.
  std::int64_t batch = keys.train_batch_size.value_or(0);
  std::int64_t micro = keys.micro_batch_per_gpu.value_or(0);
  std::int64_t steps = keys.gradient_accumulation_steps.value_or(0);
  const bool has_batch = keys.train_batch_size.has_value();
  const bool has_micro = keys.micro_batch_per_gpu.has_value();
  const bool has_steps = keys.gradient_accumulation_steps.has_value();
  std::optional<std::int64_t> derived_batch = batch;
  if (has_batch && has_micro && !has_steps) {
    steps = batch / micro / world_size;
  } else if (has_batch && has_steps && !has_micro) {
    micro = batch / world_size / steps;
  } else if (!has_batch && has_micro && has_steps) {
    derived_batch = product(micro, steps, world_size);
  } else if (has_batch && !has_micro && !has_steps) {
    steps = 1;
    micro = batch / world_size;
  } else if (!has_batch && has_micro && !has_steps) {
    steps = 1;
    derived_batch = product(micro, 1, world_size);
  }
  const std::string shown = keys_text(keys);
  if (!derived_batch)
    elasticity_config_error(fmt::format(
        "{}: {} on world size {}: the global batch exceeds 2^63 - 1", origin, shown, world_size));
  batch = *derived_batch;
  const auto whole = product(micro, steps, world_size);
  if (micro < 1 || steps < 1 || !whole || *whole != batch) {
    // Which world sizes would do: those dividing batch / (micro x accumulation)
    // as given (all three given: exactly that quotient).
    std::int64_t per_rank = 1;
    if (has_micro) per_rank *= keys.micro_batch_per_gpu.value();
    if (has_steps) per_rank *= keys.gradient_accumulation_steps.value();
    const std::int64_t quotient = batch / per_rank;
    const std::string valid = has_micro && has_steps
                                  ? fmt::format("valid: world size {} only", quotient)
                                  : fmt::format("valid: world sizes that divide {}", quotient);
    throw Error(ErrorKind::incompatible,
                fmt::format("{}: the non-elastic batch ({}) does not fit world size {}: DeepSpeed "
                            "needs {} = {} x {} x world size, here {} != {} x {} x {}; {}",
                            origin, shown, world_size, kTrainBatch, kMicroBatch, kAccumulation,
                            batch, micro, steps, world_size, valid),
                kElasticityIncompatibleWorldSize);
  }
  r.final_batch_size = batch;
  r.world_size = world_size;
  r.data_parallel_size = world_size;
  r.micro_batch_size = micro;
  r.gradient_accumulation_steps = steps;
  return r;
}

json non_elastic_json(const DeepSpeedBatchKeys& keys, const ElasticityResult& result) {
  auto optional = [](const std::optional<std::int64_t>& v) { return v ? json(*v) : json(nullptr); };
  json given = json::object();
  given[kTrainBatch] = optional(keys.train_batch_size);
  given[kMicroBatch] = optional(keys.micro_batch_per_gpu);
  given[kAccumulation] = optional(keys.gradient_accumulation_steps);
  return json{
      {"elastic", false},
      {"final_batch_size",
       result.final_batch_size > 0 ? json(result.final_batch_size) : json(nullptr)},
      {"valid_gpus", nullptr},
      {"world_size", optional(result.world_size)},
      {"data_parallel_size", optional(result.data_parallel_size)},
      {"micro_batch_size", optional(result.micro_batch_size)},
      {"gradient_accumulation_steps", optional(result.gradient_accumulation_steps)},
      {"batch_keys", std::move(given)},
      {"warnings", result.warnings},
  };
}

}  // namespace ductile::pipeline
