// DeepSpeed's learning-rate schedulers (pipeline/deepspeed_schedules.hpp):
// a params object read into a typed spec with DeepSpeed's defaults, every
// refusal naming the key, the rates at the schedule's landmarks (end of
// warm-up, end of decay, the cycle's peak, the stairs), and the mapping of a
// config's scheduler block. Equality with DeepSpeed's own classes at every
// step is tests/python/test_deepspeed_lr_schedules.py's.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "ductile/core/runtime.hpp"
#include "ductile/error.hpp"
#include "ductile/pipeline/deepspeed_config.hpp"
#include "ductile/pipeline/deepspeed_schedules.hpp"

using namespace ductile;
using nlohmann::json;
using pipeline::deepspeed_schedule_spec;
using pipeline::DeepSpeedSchedule;

namespace {

std::string message_of(const std::string& type, const json& params) {
  try {
    deepspeed_schedule_spec(type, params, "scheduler.params.");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

DeepSpeedSchedule schedule(const std::string& type, const json& params,
                           std::vector<double> group_lrs = {0.5}) {
  return DeepSpeedSchedule(deepspeed_schedule_spec(type, params), std::move(group_lrs));
}

const core::Runtime& plugins() {
  static const core::Runtime runtime = core::Runtime::from_string("", "deepspeed schedules test");
  return runtime;
}

}  // namespace

TEST_CASE("an empty params object gives DeepSpeed's defaults") {
  const auto warmup =
      std::get<pipeline::WarmupLrSpec>(deepspeed_schedule_spec("WarmupLR", {}).params);
  CHECK(warmup.warmup_min_lr == pipeline::PerGroup(0.0));
  CHECK_FALSE(warmup.warmup_max_lr);
  CHECK(warmup.warmup_num_steps == 1000);
  CHECK(warmup.warmup_type == pipeline::WarmupType::log);
  const auto decay = std::get<pipeline::WarmupDecayLrSpec>(
      deepspeed_schedule_spec("WarmupDecayLR", json{{"total_num_steps", 10}}).params);
  CHECK(decay.warmup_max_lr == pipeline::PerGroup(0.001));
  // "auto" keeps the default; null is DeepSpeed's None: each group's lr.
  const auto auto_max = std::get<pipeline::WarmupDecayLrSpec>(
      deepspeed_schedule_spec("WarmupDecayLR",
                              json{{"total_num_steps", 10}, {"warmup_max_lr", "auto"}})
          .params);
  CHECK(auto_max.warmup_max_lr == pipeline::PerGroup(0.001));
  const auto none_max = std::get<pipeline::WarmupDecayLrSpec>(
      deepspeed_schedule_spec("WarmupDecayLR",
                              json{{"total_num_steps", 10}, {"warmup_max_lr", nullptr}})
          .params);
  CHECK_FALSE(none_max.warmup_max_lr);
  const auto read = deepspeed_schedule_spec(
      "OneCycle", json{{"cycle_min_lr", json::array({0.1, 0.2})}, {"cycle_max_lr", 1}});
  CHECK(read.type() == pipeline::DeepSpeedScheduleType::one_cycle);
  const json params = pipeline::deepspeed_schedule_params(read);
  CHECK(params["cycle_min_lr"] == json::array({0.1, 0.2}));
  CHECK(params["cycle_second_step_size"].is_null());
  CHECK(params["cycle_first_step_size"] == 2000.0);
  CHECK(params["last_batch_iteration"] == -1);
  // What deepspeed_schedule_params writes reads back to the same spec.
  CHECK(pipeline::deepspeed_schedule_params(deepspeed_schedule_spec("OneCycle", params)) == params);
}

TEST_CASE("every refused value names its key, the value and what is valid") {
  CHECK(message_of("WarmupLR", json{{"warmup_num_steps", -1}}) ==
        "scheduler.params.warmup_num_steps = -1; valid: an integer >= 1");
  CHECK(message_of("WarmupLR", json{{"warmup_type", "cosine"}}) ==
        "scheduler.params.warmup_type = \"cosine\"; valid: \"log\" or \"linear\"");
  CHECK(message_of("WarmupDecayLR", json::object()) ==
        "scheduler.params.total_num_steps is missing; WarmupDecayLR needs it: an integer >= 0");
  CHECK(message_of("OneCycle", json{{"cycle_min_lr", json::array()}, {"cycle_max_lr", 1}})
            .find("scheduler.params.cycle_min_lr = []; valid: a number >= 0, or a list") == 0);
  CHECK(message_of("LRRangeTest", json{{"lr_range_test_staircase", 1}}) ==
        "scheduler.params.lr_range_test_staircase = 1; valid: true or false");
  CHECK(message_of("LRRangeTest", json{{"step_size", 5}})
            .find("scheduler.params.step_size: LRRangeTest has no such parameter (its "
                  "parameters: lr_range_test_min_lr,") == 0);
  CHECK(message_of("Cosine", json::object()) ==
        "scheduler.params.type = \"Cosine\"; valid: \"WarmupLR\", \"WarmupDecayLR\", "
        "\"WarmupCosineLR\", \"OneCycle\", \"LRRangeTest\"");
  pipeline::DeepSpeedScheduleSpec made{pipeline::LrRangeTestSpec{}};
  std::get<pipeline::LrRangeTestSpec>(made.params).lr_range_test_step_rate = -1;
  CHECK_THROWS_WITH_AS(DeepSpeedSchedule(made, {0.1}),
                       "lr_range_test_step_rate = -1.0; valid: a number >= 0", Error);
  CHECK_THROWS_WITH_AS(
      schedule("WarmupLR", json{{"warmup_min_lr", json::array({0.1, 0.2})}}, {0.1, 0.2, 0.3}),
      "warmup_min_lr = [0.1,0.2] has 2 values, but the optimizer has 3 param groups; valid: "
      "one number for every group, or a list of 3",
      Error);
}

TEST_CASE("the warm-ups reach their peak at warmup_num_steps and the decays their floor") {
  const auto linear = schedule("WarmupLR", json{{"warmup_min_lr", 0.1},
                                                {"warmup_max_lr", 0.3},
                                                {"warmup_num_steps", 10},
                                                {"warmup_type", "linear"}});
  CHECK(linear.initial_lrs() == std::vector<double>{0.1});
  CHECK(linear.lrs(5)[0] == doctest::Approx(0.2));
  CHECK(linear.lrs(10)[0] == 0.3);
  CHECK(linear.lrs(1000)[0] == 0.3);
  const auto log = schedule("WarmupLR", json{{"warmup_num_steps", 8}});
  CHECK(log.lrs(0)[0] == 0.0);
  CHECK(log.lrs(7)[0] == doctest::Approx(0.5));  // log(8) / log(8) of the group's lr
  CHECK(log.lrs(3)[0] == doctest::Approx(0.5 * std::log(4.0) / std::log(8.0)));

  const auto decay = schedule("WarmupDecayLR", json{{"total_num_steps", 30},
                                                    {"warmup_min_lr", 0.01},
                                                    {"warmup_max_lr", 0.11},
                                                    {"warmup_num_steps", 10},
                                                    {"warmup_type", "linear"}});
  CHECK(decay.lrs(20)[0] == doctest::Approx(0.06));  // half way down
  CHECK(decay.lrs(30)[0] == doctest::Approx(0.01));
  CHECK(decay.lrs(45)[0] == doctest::Approx(0.01));

  const auto cosine = schedule("WarmupCosineLR",
                               json{{"total_num_steps", 21},
                                    {"warmup_num_steps", 10},
                                    {"warmup_min_ratio", 0.2},
                                    {"cos_min_ratio", 0.1},
                                    {"warmup_type", "linear"}},
                               {1.0, 2.0});
  CHECK(cosine.initial_lrs() == std::vector<double>{0.0, 0.0});
  CHECK(cosine.lrs(0) == std::vector<double>{0.2, 0.4});
  CHECK(cosine.lrs(9)[1] == doctest::Approx(2.0 * (0.2 + 0.9 * 0.8)));
  // The first decay step: 1 of 11, cos_min_ratio + (1 - cos_min_ratio) x the cosine.
  CHECK(cosine.lrs(10)[1] ==
        doctest::Approx(2.0 * (0.1 + 0.9 * (1 + std::cos(3.141592653589793 / 11)) / 2)));
  CHECK(cosine.lrs(20)[0] == doctest::Approx(0.1));
  CHECK(cosine.lrs(500)[0] == doctest::Approx(0.1));
}

TEST_CASE("OneCycle peaks after its first half, decays after the cycle, cycles the first beta") {
  const auto cycle = schedule("OneCycle", json{{"cycle_min_lr", 0.1},
                                               {"cycle_max_lr", 0.5},
                                               {"cycle_first_step_size", 10},
                                               {"cycle_second_step_size", 20},
                                               {"decay_step_size", 5},
                                               {"decay_lr_rate", 1.0}});
  CHECK(cycle.cycles_momentum());
  CHECK(cycle.initial_lrs() == std::vector<double>{0.1});
  CHECK(cycle.initial_betas() == std::vector<double>{0.8});
  CHECK(cycle.lrs(9)[0] == doctest::Approx(0.5));
  CHECK(cycle.betas(9)[0] == doctest::Approx(0.8));
  CHECK(cycle.lrs(19)[0] == doctest::Approx(0.3));      // half of the way down
  CHECK(cycle.betas(29)[0] == doctest::Approx(0.9));    // the cycle's end
  CHECK(cycle.lrs(34)[0] == doctest::Approx(0.1 / 2));  // 5 decay steps at rate 1
  CHECK(cycle.betas(34)[0] == 0.9);                     // no momentum decay rate

  const auto stairs = schedule("OneCycle", json{{"cycle_min_lr", 0.0},
                                                {"cycle_max_lr", 1.0},
                                                {"cycle_first_step_size", 10},
                                                {"cycle_first_stair_count", 2}});
  CHECK(stairs.lrs(0)[0] == 0.0);
  CHECK(stairs.lrs(3)[0] == 0.0);
  CHECK(stairs.lrs(4)[0] == 0.5);
  CHECK(stairs.lrs(9)[0] == 1.0);

  const auto no_betas = DeepSpeedSchedule(
      deepspeed_schedule_spec("OneCycle", json{{"cycle_min_lr", 0.1}, {"cycle_max_lr", 0.5}}),
      {0.1}, /*optimizer_has_betas=*/false);
  CHECK_FALSE(no_betas.cycles_momentum());
  CHECK(no_betas.betas(3).empty());
}

TEST_CASE("LRRangeTest grows continuously or in stairs") {
  const auto range = schedule("LRRangeTest", json{{"lr_range_test_min_lr", 0.1},
                                                  {"lr_range_test_step_size", 10},
                                                  {"lr_range_test_step_rate", 2.0}});
  CHECK(range.lrs(4)[0] == doctest::Approx(0.2));  // (4 + 1) / 10 intervals
  const auto stairs = schedule("LRRangeTest", json{{"lr_range_test_min_lr", 0.1},
                                                   {"lr_range_test_step_size", 10},
                                                   {"lr_range_test_staircase", true}});
  CHECK(stairs.lrs(8)[0] == 0.1);
  CHECK(stairs.lrs(9)[0] == doctest::Approx(0.2));
}

TEST_CASE("the mapping reads the scheduler block when it reads the training keys") {
  const auto read = [](const std::string& text) {
    return pipeline::deepspeed_sections(text, "ds.json", {}, plugins().registry(),
                                        {.read_training = true});
  };
  const auto sections =
      read(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "gamma": 1}}})");
  REQUIRE(sections.training.scheduler);
  CHECK(sections.training.scheduler->type() == pipeline::DeepSpeedScheduleType::warmup_lr);
  bool warned = false;
  for (const auto& w : sections.warnings)
    warned = warned || w.find(
                           "ds.json: scheduler.params.gamma is accepted but ignored: WarmupLR "
                           "has no such parameter") == 0;
  CHECK(warned);
  CHECK_FALSE(read(R"({"train_batch_size": 2})").training.scheduler);
  std::string message;
  try {
    read(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": -1}}})");
  } catch (const std::exception& e) {
    message = e.what();
  }
  CHECK(message.find("scheduler.params.cycle_min_lr is missing") != std::string::npos);
  CHECK(message.find("scheduler.params.cycle_max_lr = -1; valid: a number >= 0") !=
        std::string::npos);
}
