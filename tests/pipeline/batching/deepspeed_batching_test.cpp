// DeepSpeed JSON configs: data_efficiency.data_sampling.dynamic_batching
// mapped to the greedy sampler, the LR rule and the base schedule.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <string>

#include "ductile/pipeline/deepspeed_batching.hpp"

using ductile::pipeline::parse_deepspeed_batching;

TEST_CASE("the PR's example config maps key by key, with DeepSpeed's defaults") {
  const char* config = R"({
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 0.0003}},
    "data_efficiency": {
      "enabled": true,
      "seed": 42,
      "data_sampling": {
        "num_workers": 0,
        "dynamic_batching": {
          "enabled": true,
          "max_tokens": 100,
          "metrics_path": "./curriculum_output/",
          "lr_scaling_method": "sqrt",
          "sequence_picking_order": "random",
          "min_batch_size": 1,
          "max_batch_size": 10,
          "verbose": true
        }
      }
    }
  })";
  auto ds = parse_deepspeed_batching(config, "ds.json", "/data/run");
  CHECK(ds.enabled);
  const auto& o = ds.setup.options;
  CHECK(o.sampler == "greedy");
  CHECK(o.sampler_params.get_int("max_tokens") == 100);
  CHECK(o.sampler_params.get_int("max_batch_size") == 10);
  CHECK(o.sampler_params.get_int("min_batch_size") == 1);
  CHECK(o.sampler_params.get_string("order") == "random");
  CHECK(o.sampler_params.get_int("seed") == 42);
  CHECK(o.sampler_params.get_int("effective_batch_size") == 16);
  CHECK(o.base_batch_size == 16);
  CHECK(o.lr_rule == "sqrt");
  CHECK(o.schedule.base_lr == 0.0003);
  CHECK(ds.setup.lengths ==
        std::filesystem::path("/data/run/./curriculum_output/seqlen/seqlen_sample_to_metric"));

  auto minimal = parse_deepspeed_batching(
      R"({"data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": 64,
          "lr_scaling_method": null, "sentence_picking_order": "seqlen"}}}})",
      "min.json");
  CHECK_FALSE(minimal.enabled);
  const auto& m = minimal.setup.options;
  CHECK(m.sampler_params.get_int("seed") == 1234);
  CHECK(m.sampler_params.get_int("max_batch_size") == 0);
  CHECK(m.sampler_params.get_string("order") == "seqlen");
  CHECK(m.sampler_params.get_int("effective_batch_size") == 1);
  CHECK(m.lr_rule == "none");
}

TEST_CASE("WarmupDecayLR with linear warm-up becomes warmup_linear, other schedulers are refused") {
  const std::string dyn =
      R"("data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": 64}}})";
  auto ds = parse_deepspeed_batching(
      "{" + dyn +
          R"(, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0001,
             "warmup_max_lr": 0.001, "warmup_num_steps": 10, "total_num_steps": 100,
             "warmup_type": "linear"}}})",
      "s.json");
  const auto& schedule = ds.setup.options.schedule;
  CHECK(schedule.kind == ductile::pipeline::LrScheduleKind::warmup_linear);
  CHECK(schedule.base_lr == 0.001);
  CHECK(schedule.min_lr == 0.0001);
  CHECK(schedule.warmup_steps == 10);
  CHECK(schedule.total_steps == 100);
  CHECK_THROWS_WITH_AS(
      parse_deepspeed_batching("{" + dyn + R"(, "scheduler": {"type": "OneCycle"}})", "s.json"),
      doctest::Contains("'OneCycle'"), ductile::Error);
  CHECK_THROWS_WITH_AS(
      parse_deepspeed_batching("{" + dyn +
                                   R"(, "scheduler": {"type": "WarmupDecayLR", "params":
                                   {"total_num_steps": 100}}})",
                               "s.json"),
      doctest::Contains("warmup_type: 'log'"), ductile::Error);
}

TEST_CASE("mistakes name the key path and the value") {
  auto fails_with = [](const std::string& json, const char* needle) {
    try {
      (void)parse_deepspeed_batching(json, "bad.json");
      FAIL("accepted: ", json);
    } catch (const ductile::Error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
      CHECK(std::string(e.what()).find("bad.json") != std::string::npos);
    }
  };
  fails_with("{", "invalid JSON");
  fails_with("{}", "data_efficiency.data_sampling.dynamic_batching is missing");
  fails_with(R"({"data_efficiency": {"data_sampling": {"dynamic_batching": {}}}})",
             "max_tokens is missing (the token budget is required)");
  fails_with(R"({"data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": "x"}}}})",
             "max_tokens must be an integer, got \"x\"");
  fails_with(R"({"data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": 0}}}})",
             "max_tokens = 0 is out of range: must be between 1 and");
  fails_with(R"({"data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": 9,
             "sequence_picking_order": "shortest"}}}})",
             "sequence_picking_order = \"shortest\" is not allowed; valid values: "
             "dataloader, seqlen, random");
  fails_with(R"({"data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": 9,
             "lr_scaling_method": "cubic"}}}})",
             "'cubic' is not valid");
  fails_with(R"({"data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": 9,
             "max_tokenz": 3}}}})",
             "max_tokenz is an unknown key");
}

TEST_CASE("micro batch and gradient accumulation are each bounded, so their product fits") {
  for (const char* key : {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}) {
    const std::string config = fmt::format(R"({{
      "{}": 2147483648,
      "data_efficiency": {{"data_sampling": {{"dynamic_batching": {{"max_tokens": 64}}}}}}
    }})",
                                           key);
    try {
      (void)parse_deepspeed_batching(config, "ds.json");
      FAIL("accepted");
    } catch (const ductile::Error& e) {
      CHECK(e.kind() == ductile::ErrorKind::config);
      const std::string message = e.what();
      CHECK(message.find(fmt::format("ds.json: {} = 2147483648; valid: an integer from 1 to "
                                     "2147483647",
                                     key)) != std::string::npos);
    }
  }
  // Both at the bound: the step's micro-batch count is their product.
  auto ds = parse_deepspeed_batching(R"({
    "train_micro_batch_size_per_gpu": 2147483647,
    "gradient_accumulation_steps": 2147483647,
    "data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": 64}}}
  })",
                                     "ds.json");
  CHECK(ds.setup.options.sampler_params.get_int("effective_batch_size") ==
        2147483647LL * 2147483647LL);
}
