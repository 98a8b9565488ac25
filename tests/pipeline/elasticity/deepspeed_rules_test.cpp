// DeepSpeedConfig's elasticity rules (deepspeed_rules.cpp): an elasticity
// block beside the batch keys, disabled blocks as non-elastic jobs, and the
// batch DeepSpeed derives for a world size. tests/python/
// test_deepspeed_config_rules.py runs the same configs against DeepSpeed.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ductile/pipeline/elasticity.hpp"

using namespace ductile;
using json = nlohmann::json;
using pipeline::deepspeed_elasticity_mode;
using pipeline::non_elastic_plan;

namespace {

const json kBlock = json::parse(
    R"({"enabled": true, "version": 0.1, "max_train_batch_size": 2000,
        "micro_batch_sizes": [2, 4, 6], "max_gpus": 64})");

json with_block(json config, json block) {
  config["elasticity"] = std::move(block);
  return config;
}

// The error's type and message.
std::pair<std::string, std::string> error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return {e.type(), e.what()};
  }
  return {"", "no error"};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("an enabled block beside batch keys is refused unless told to ignore them") {
  for (const char* key :
       {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}) {
    CAPTURE(key);
    const json config = with_block({{key, 8}}, kBlock);
    auto [type, message] = error_of([&] { deepspeed_elasticity_mode(config, "ds.json"); });
    CHECK(type == "ElasticityConfigError");
    CHECK(contains(message, std::string("ds.json: ") + key + " = 8 is set beside an enabled"));
    CHECK(contains(message, "set elasticity.ignore_non_elastic_batch_info = true"));
    // false is the default, and null is a key given (DeepSpeed's `in`).
    auto with_false = kBlock;
    with_false["ignore_non_elastic_batch_info"] = false;
    CHECK(error_of([&] {
            deepspeed_elasticity_mode(with_block({{key, 8}}, with_false), "x");
          }).first == "ElasticityConfigError");
    CHECK(error_of([&] {
            deepspeed_elasticity_mode(with_block({{key, nullptr}}, kBlock), "x");
          }).first == "ElasticityConfigError");

    auto ignoring = kBlock;
    ignoring["ignore_non_elastic_batch_info"] = true;
    const auto mode = deepspeed_elasticity_mode(with_block({{key, 8}}, ignoring), "ds.json");
    CHECK(mode.has_block);
    CHECK(mode.elastic);
    REQUIRE(mode.warnings.size() == 1);
    CHECK(contains(mode.warnings[0], std::string(key) + " = 8 is ignored"));
  }
  auto several = with_block({{"train_batch_size", 8}, {"gradient_accumulation_steps", 2}}, kBlock);
  CHECK(contains(error_of([&] { deepspeed_elasticity_mode(several, "ds.json"); }).second,
                 "train_batch_size = 8, gradient_accumulation_steps = 2 are set beside"));
  auto odd = kBlock;
  odd["ignore_non_elastic_batch_info"] = "yes";
  CHECK(contains(error_of([&] {
                   deepspeed_elasticity_mode(with_block({{"train_batch_size", 8}}, odd), "x");
                 }).second,
                 "elasticity.ignore_non_elastic_batch_info = \"yes\" is invalid: give true or "
                 "false"));
  // Nothing beside it, or no block at all: nothing to say.
  CHECK(deepspeed_elasticity_mode(with_block(json::object(), kBlock), "x").elastic);
  const auto none = deepspeed_elasticity_mode(json{{"train_batch_size", 8}}, "x");
  CHECK_FALSE(none.has_block);
}

TEST_CASE("a disabled block is a non-elastic job with DeepSpeed's batch arithmetic") {
  auto disabled = kBlock;
  disabled["enabled"] = false;
  auto absent = kBlock;
  absent.erase("enabled");
  for (const json& block : {disabled, absent}) {
    const auto mode = deepspeed_elasticity_mode(
        with_block({{"train_batch_size", 32}, {"gradient_accumulation_steps", 2}}, block), "x");
    CHECK(mode.has_block);
    CHECK_FALSE(mode.elastic);
    CHECK(mode.batch.train_batch_size == 32);
    CHECK(mode.batch.gradient_accumulation_steps == 2);
    CHECK_FALSE(mode.batch.micro_batch_per_gpu);

    auto plan = non_elastic_plan(mode.batch, 4, "x");
    CHECK(plan.final_batch_size == 32);
    CHECK(plan.micro_batch_size == 4);  // 32 / 4 ranks / 2 steps
    CHECK(plan.gradient_accumulation_steps == 2);
    CHECK(plan.world_size == 4);
    CHECK(plan.valid_gpus.empty());
    auto [type, message] = error_of([&] { non_elastic_plan(mode.batch, 3, "ds.json"); });
    CHECK(type == "ElasticityIncompatibleWorldSize");
    CHECK(contains(message,
                   "ds.json: the non-elastic batch (train_batch_size = 32, "
                   "gradient_accumulation_steps = 2) does not fit world size 3"));
    CHECK(contains(message, "valid: world sizes that divide 16"));
    // Without a world size: the batch as given.
    CHECK(non_elastic_plan(mode.batch, 0, "x").final_batch_size == 32);
    CHECK_FALSE(non_elastic_plan(mode.batch, 0, "x").micro_batch_size);
  }

  // A micro batch alone: the batch grows with the world size.
  auto micro = deepspeed_elasticity_mode(
      with_block({{"train_micro_batch_size_per_gpu", 4}, {"gradient_accumulation_steps", 3}},
                 disabled),
      "x");
  auto grown = non_elastic_plan(micro.batch, 5, "x");
  CHECK(grown.final_batch_size == 60);
  CHECK(grown.gradient_accumulation_steps == 3);
  CHECK(non_elastic_plan(micro.batch, 0, "x").final_batch_size == 0);

  // All three: one world size only.
  auto all = deepspeed_elasticity_mode(with_block({{"train_batch_size", 24},
                                                   {"train_micro_batch_size_per_gpu", 4},
                                                   {"gradient_accumulation_steps", 2}},
                                                  disabled),
                                       "x");
  CHECK(non_elastic_plan(all.batch, 3, "x").micro_batch_size == 4);
  CHECK(contains(error_of([&] { non_elastic_plan(all.batch, 2, "x"); }).second,
                 "valid: world size 3 only"));
}

TEST_CASE("a non-elastic job needs a batch size that fits some world size") {
  auto disabled = kBlock;
  disabled["enabled"] = false;
  auto message_of = [&](json config) {
    return error_of(
        [&] { deepspeed_elasticity_mode(with_block(std::move(config), disabled), "ds.json"); });
  };
  auto [type, none] = message_of(json::object());
  CHECK(type == "ElasticityConfigError");
  CHECK(contains(none,
                 "ds.json: elasticity is disabled (elasticity.enabled = false), so this is "
                 "a non-elastic job, and it gives no batch size: set train_batch_size or "
                 "train_micro_batch_size_per_gpu"));
  CHECK(contains(message_of({{"gradient_accumulation_steps", 2}}).second, "gives no batch size"));
  CHECK(contains(message_of({{"train_batch_size", 0}}).second,
                 "ds.json: train_batch_size = 0 is invalid for a non-elastic job"));
  CHECK(contains(message_of({{"train_micro_batch_size_per_gpu", 2.5}}).second,
                 "train_micro_batch_size_per_gpu = 2.5 is invalid"));
  CHECK(
      contains(message_of({{"train_batch_size", 30}, {"train_micro_batch_size_per_gpu", 4}}).second,
               "so train_batch_size must be a multiple of 4 x 1 = 4"));
  // "auto" is Hugging Face's to fill in: the file is fine, the plan needs the number.
  auto automatic =
      deepspeed_elasticity_mode(with_block({{"train_batch_size", "auto"}}, disabled), "ds.json");
  CHECK(automatic.batch.automatic == std::vector<std::string>{"train_batch_size"});
  CHECK(contains(error_of([&] { non_elastic_plan(automatic.batch, 2, "ds.json"); }).second,
                 "train_batch_size = \"auto\" is a placeholder"));
}

TEST_CASE("the non-elastic plan's JSON says it is not elastic") {
  pipeline::DeepSpeedBatchKeys keys;
  keys.train_batch_size = 16;
  const auto j = pipeline::non_elastic_json(keys, non_elastic_plan(keys, 2, "x"));
  CHECK(j["elastic"] == false);
  CHECK(j["final_batch_size"] == 16);
  CHECK(j["micro_batch_size"] == 8);
  CHECK(j["gradient_accumulation_steps"] == 1);
  CHECK(j["valid_gpus"].is_null());
  CHECK(j["batch_keys"]["train_micro_batch_size_per_gpu"].is_null());
}
