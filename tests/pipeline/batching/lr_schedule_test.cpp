// The variable-batch LR schedule: base schedules, scaling by each step's
// batch size with DeepSpeed's stepping convention, and exact resume.
#include <doctest/doctest.h>

#include <cmath>

#include "ductile/core/runtime.hpp"
#include "ductile/pipeline/lr_schedule.hpp"

using ductile::pipeline::LrScheduleKind;
using ductile::pipeline::LrScheduleSpec;
using ductile::pipeline::VariableBatchLrSchedule;

namespace {
std::shared_ptr<ductile::LrScalingRule> rule(const std::string& name) {
  static ductile::core::Runtime rt = [] {
    ductile::core::RuntimeOptions options;
    options.extra_plugin_dirs.emplace_back(DUCTILE_PLUGIN_DIR);
    return ductile::core::Runtime::from_string("", "lr schedule test", options);
  }();
  return rt.create<ductile::LrScalingRule>(name);
}
}  // namespace

TEST_CASE("base schedules: constant, linear warm-up then linear or cosine decay") {
  LrScheduleSpec s;
  s.base_lr = 1.0;
  s.min_lr = 0.1;
  CHECK(ductile::pipeline::base_schedule_lr(s, 0) == 1.0);
  CHECK(ductile::pipeline::base_schedule_lr(s, 1000) == 1.0);
  s.kind = LrScheduleKind::warmup_linear;
  s.warmup_steps = 10;
  s.total_steps = 110;
  CHECK(ductile::pipeline::base_schedule_lr(s, 0) == doctest::Approx(0.1));
  CHECK(ductile::pipeline::base_schedule_lr(s, 5) == doctest::Approx(0.55));
  CHECK(ductile::pipeline::base_schedule_lr(s, 10) == doctest::Approx(1.0));
  CHECK(ductile::pipeline::base_schedule_lr(s, 60) == doctest::Approx(0.55));
  CHECK(ductile::pipeline::base_schedule_lr(s, 110) == doctest::Approx(0.1));
  CHECK(ductile::pipeline::base_schedule_lr(s, 500) == doctest::Approx(0.1));
  s.kind = LrScheduleKind::warmup_cosine;
  CHECK(ductile::pipeline::base_schedule_lr(s, 10) == doctest::Approx(1.0));
  CHECK(ductile::pipeline::base_schedule_lr(s, 60) == doctest::Approx(0.55));
  CHECK(ductile::pipeline::base_schedule_lr(s, 35) ==
        doctest::Approx(0.1 + 0.45 * (1 + std::cos(M_PI / 4))));
  s.total_steps = 10;
  CHECK_THROWS_WITH_AS(ductile::pipeline::check_lr_schedule(s),
                       doctest::Contains("total_steps = 10"), ductile::Error);
}

TEST_CASE("step 0 is set at construction and each step scales by its own batch size") {
  LrScheduleSpec s;
  s.base_lr = 1e-3;
  VariableBatchLrSchedule schedule(s, rule("linear"), 2, {10, 4, 6});
  // DeepSpeed's illustration: lr 1e-3 for 2 samples -> 5e-3 for 10, 2e-3 for 4.
  CHECK(schedule.step_index() == 0);
  CHECK(schedule.lr() == doctest::Approx(5e-3));
  CHECK(schedule.step() == doctest::Approx(2e-3));
  CHECK(schedule.step() == doctest::Approx(3e-3));
  // Past the last batch size the sizes repeat from the first, as DeepSpeed's do.
  CHECK(schedule.step() == doctest::Approx(5e-3));
  CHECK(schedule.step_index() == 3);
  VariableBatchLrSchedule rooted(s, rule("sqrt"), 4, {16});
  CHECK(rooted.lr() == doctest::Approx(2e-3));
}

TEST_CASE("a resumed schedule continues with exactly the same learning rates") {
  LrScheduleSpec s;
  s.kind = LrScheduleKind::warmup_cosine;
  s.base_lr = 3e-4;
  s.min_lr = 1e-5;
  s.warmup_steps = 7;
  s.total_steps = 90;
  std::vector<std::int64_t> sizes;
  for (int i = 0; i < 37; ++i) sizes.push_back(5 + (i * 7919) % 23);
  VariableBatchLrSchedule uninterrupted(s, rule("sqrt"), 12, sizes);
  std::vector<double> want{uninterrupted.lr()};
  for (int i = 0; i < 120; ++i) want.push_back(uninterrupted.step());

  VariableBatchLrSchedule first(s, rule("sqrt"), 12, sizes);
  for (int i = 0; i < 53; ++i) first.step();
  const std::string checkpoint = first.save_state();
  // A new job builds its schedule from different settings, then restores.
  LrScheduleSpec other;
  VariableBatchLrSchedule resumed(other, rule("sqrt"), 1, {1});
  resumed.load_state(checkpoint);
  CHECK(resumed.step_index() == 53);
  std::vector<double> got(want.begin(), want.begin() + 53);
  got.push_back(resumed.lr());
  for (int i = 53; i < 120; ++i) got.push_back(resumed.step());
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("step ", i);
    CHECK(got[i] == want[i]);  // bit-identical, not approximately equal
  }
}

TEST_CASE("bad settings and states are refused, naming what is wrong") {
  LrScheduleSpec s;
  CHECK_THROWS_WITH_AS(VariableBatchLrSchedule(s, rule("linear"), 0, {1}),
                       doctest::Contains("base_batch_size"), ductile::Error);
  CHECK_THROWS_WITH_AS(VariableBatchLrSchedule(s, rule("linear"), 4, {}),
                       doctest::Contains("no batch sizes"), ductile::Error);
  CHECK_THROWS_WITH_AS(VariableBatchLrSchedule(s, rule("linear"), 4, {3, -1}),
                       doctest::Contains("step 1 is -1"), ductile::Error);
  VariableBatchLrSchedule schedule(s, rule("linear"), 4, {4});
  schedule.step();
  CHECK_THROWS_WITH_AS(schedule.load_state("{not json"), doctest::Contains("not valid JSON"),
                       ductile::Error);
  CHECK_THROWS_WITH_AS(schedule.load_state(R"({"format": "other"})"),
                       doctest::Contains("lr schedule state"), ductile::Error);
  // A failed restore leaves the schedule as it was.
  CHECK(schedule.step_index() == 1);
  CHECK_THROWS_AS(ductile::pipeline::parse_lr_schedule_kind("cosine"), ductile::Error);
}

TEST_CASE("a state restored at the last int64 step refuses the next step, no overflow") {
  LrScheduleSpec s;
  s.kind = LrScheduleKind::warmup_linear;
  s.warmup_steps = 10;
  s.total_steps = 100;
  VariableBatchLrSchedule schedule(s, rule("linear"), 4, {4, 8});
  VariableBatchLrSchedule last(s, rule("linear"), 4, {4, 8});
  std::string state = schedule.save_state();
  const std::string step0 = "\"step\":0";
  REQUIRE(state.find(step0) != std::string::npos);
  state.replace(state.find(step0), step0.size(), "\"step\":9223372036854775807");
  last.load_state(state);
  CHECK(last.step_index() == INT64_MAX);
  CHECK(last.lr() == doctest::Approx(s.min_lr * 2));  // past total_steps, batch 8 of base 4
  CHECK_THROWS_WITH_AS(last.step(), doctest::Contains("step 9223372036854775807 is the last one"),
                       ductile::Error);
  CHECK(last.step_index() == INT64_MAX);
}
