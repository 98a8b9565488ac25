// pack_plan(): the packing pipeline as an API. It must give what
// `ductile pack --json` prints (the same ids, steps, ranks and learning rates)
// on DeepSpeed's reference vectors and on a real trace, agree with DeepSpeed
// where DeepSpeed answers, assign ranks as documented, and name the option,
// the value and what is valid in every error.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "ductile/core/runtime.hpp"
#include "ductile/pipeline/pack_plan.hpp"
#include "process.hpp"
#include "temp_dir.hpp"

using nlohmann::json;
using namespace ductile;

namespace {

core::Runtime& runtime() {
  static core::Runtime rt = core::Runtime::from_string("", "pack_plan test");
  return rt;
}

json cli_pack(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {DUCTILE_CLI, "--log-level", "error", "pack", "--json"};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto run = test::run_process(argv);
  INFO(run.err.substr(0, 500));
  const json out = json::parse(run.out);
  CHECK(run.exit_code == (out.contains("error") ? 2 : 0));
  return out;
}

// Every field of the CLI's output that pack_plan computes.
void check_same_as_cli(const pipeline::PackPlan& plan, const json& cli, std::int64_t ranks) {
  REQUIRE_FALSE(cli.contains("error"));
  const json& mbs = cli.at("microbatch_ids");
  REQUIRE(mbs.size() == plan.microbatch_count());
  for (std::size_t i = 0; i < mbs.size(); ++i) {
    CHECK(mbs[i][0].get<std::int64_t>() == plan.microbatch_steps[i]);
    const auto ids = plan.microbatch(i);
    CHECK(mbs[i][1].get<std::vector<std::int64_t>>() ==
          std::vector<std::int64_t>(ids.begin(), ids.end()));
  }
  CHECK(cli.at("batch_sizes").get<std::vector<std::int64_t>>() == plan.batch_sizes);
  CHECK(cli.at("batch_max_seqlens").get<std::vector<std::int64_t>>() == plan.batch_max_seqlens);
  CHECK(cli.at("dropped_ids").get<std::vector<std::int64_t>>() == plan.dropped_ids);
  CHECK(cli.at("leftover_ids").get<std::vector<std::int64_t>>() == plan.leftover_ids);
  if (plan.lr_rule) {
    // Exact: JSON numbers round-trip doubles.
    CHECK(cli.at("lrs").get<std::vector<double>>() == plan.lrs);
  } else {
    CHECK_FALSE(cli.contains("lrs"));
  }
  if (ranks > 0) {
    const json& per_rank = cli.at("ranks");
    REQUIRE(per_rank.size() == static_cast<std::size_t>(ranks));
    for (std::int64_t r = 0; r < ranks; ++r) {
      const auto mine = plan.microbatches_of_rank(static_cast<std::size_t>(r));
      CHECK(per_rank[static_cast<std::size_t>(r)].get<std::vector<std::int64_t>>() ==
            std::vector<std::int64_t>(mine.begin(), mine.end()));
    }
  } else {
    CHECK_FALSE(cli.contains("ranks"));
  }
  const json& stats = cli.at("stats");
  CHECK(stats.at("sequences").get<std::int64_t>() == plan.stats.sequences);
  CHECK(stats.at("tokens").get<std::int64_t>() == plan.stats.tokens);
  CHECK(stats.at("steps").get<std::size_t>() == plan.step_count());
  CHECK(stats.at("token_efficiency").get<double>() == plan.stats.token_efficiency);
  CHECK(stats.at("padded_efficiency").get<double>() == plan.stats.padded_efficiency);
}

const char* const kRules[] = {"linear", "sqrt", "none"};

}  // namespace

TEST_CASE("pack_plan equals ductile pack --json and DeepSpeed on every reference vector") {
  std::ifstream in(std::string(DUCTILE_TEST_DATA_DIR) + "/reference/pack_vectors.jsonl");
  REQUIRE(in.good());
  test::TempDir dir;
  std::string line;
  int cases = 0, refused = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const json v = json::parse(line);
    const json& a = v.at("args");
    const auto lengths = v.at("seqlens").get<std::vector<std::int64_t>>();
    // Options varied over the cases: ranks 0..3, each rule, each schedule.
    pipeline::PackPlanOptions o;
    o.max_tokens = a.at("max_tokens").get<std::int64_t>();
    o.min_batch_size = a.value("min_batch_size", std::int64_t{1});
    o.max_batch_size =
        a.at("max_batch_size").is_null() ? 0 : a.at("max_batch_size").get<std::int64_t>();
    o.order = a.at("sequence_picking_order").get<std::string>();
    o.effective_batch_size = a.at("effective_batch_size").get<std::int64_t>();
    o.same_size_microbatches = a.at("required_microbatches_of_same_size").get<bool>();
    o.seed = a.at("seed").get<std::int64_t>();
    o.ranks = cases % 4;
    o.lr_rule = kRules[cases % 3];
    o.base_batch_size = 3;
    o.schedule.base_lr = 0.002;
    o.schedule.kind = static_cast<pipeline::LrScheduleKind>(cases % 3);
    o.schedule.min_lr = 1e-4;
    o.schedule.warmup_steps = 2;
    o.schedule.total_steps = 9;

    std::string text;
    for (auto len : lengths) text += std::to_string(len) + "\n";
    const auto file = dir.write("case" + std::to_string(cases) + ".txt", text);
    std::vector<std::string> args = {"--lengths",
                                     file.string(),
                                     "--max-tokens",
                                     std::to_string(*o.max_tokens),
                                     "--min-batch-size",
                                     std::to_string(*o.min_batch_size),
                                     "--max-batch-size",
                                     std::to_string(*o.max_batch_size),
                                     "--order",
                                     *o.order,
                                     "--effective-batch-size",
                                     std::to_string(*o.effective_batch_size),
                                     "--seed",
                                     std::to_string(*o.seed),
                                     "--lr-rule",
                                     *o.lr_rule,
                                     "--base-batch-size",
                                     "3",
                                     "--base-lr",
                                     "0.002",
                                     "--schedule",
                                     pipeline::to_string(o.schedule.kind),
                                     "--min-lr",
                                     "0.0001",
                                     "--warmup-steps",
                                     "2",
                                     "--total-steps",
                                     "9"};
    if (*o.same_size_microbatches) args.push_back("--same-size-microbatches");
    if (o.ranks > 0) args.insert(args.end(), {"--ranks", std::to_string(o.ranks)});
    INFO("case ", cases, ": ", a.dump());
    ++cases;

    const json cli = cli_pack(args);
    if (cli.contains("error")) {
      // The CLI reports what pack_plan throws, word for word.
      ++refused;
      CHECK(v.at("expect").contains("error"));
      try {
        (void)pipeline::pack_plan(runtime(), lengths, o);
        FAIL("pack_plan succeeded where the CLI failed");
      } catch (const Error& e) {
        CHECK(cli["error"]["message"].get<std::string>() == e.what());
      }
      continue;
    }
    const auto plan = pipeline::pack_plan(runtime(), lengths, o);
    check_same_as_cli(plan, cli, o.ranks);
    const json& expect = v.at("expect");
    if (expect.contains("error")) continue;  // DeepSpeed fails; we kept the final group
    const json& mbs = expect.at("microbatch_ids");
    REQUIRE(plan.microbatch_count() >= mbs.size());
    for (std::size_t i = 0; i < mbs.size(); ++i) {
      CHECK(plan.microbatch_steps[i] == mbs[i][0].get<std::int64_t>());
      const auto ids = plan.microbatch(i);
      CHECK(std::vector<std::int64_t>(ids.begin(), ids.end()) ==
            mbs[i][1].get<std::vector<std::int64_t>>());
    }
    const auto sizes = expect.at("batch_sizes").get<std::vector<std::int64_t>>();
    REQUIRE(plan.batch_sizes.size() >= sizes.size());
    CHECK(std::equal(sizes.begin(), sizes.end(), plan.batch_sizes.begin()));
    // Each step's rate is the rule applied to the base schedule at that step.
    for (std::size_t s = 0; s < plan.step_count(); ++s) {
      const double k = static_cast<double>(plan.batch_sizes[s]) / 3.0;
      const double base = pipeline::base_schedule_lr(o.schedule, static_cast<std::int64_t>(s));
      const double expected = *o.lr_rule == "linear" ? base * k
                              : *o.lr_rule == "sqrt" ? base * std::sqrt(k)
                                                     : base;
      CHECK(plan.lrs[s] == doctest::Approx(expected).epsilon(1e-12));
    }
  }
  CHECK(cases == 200);
  MESSAGE(cases, " reference vectors, ", refused, " refused by both");
}

TEST_CASE("pack_plan equals ductile pack --json on a real trace, stats included") {
  const std::string file =
      std::string(DUCTILE_TEST_DATA_DIR) + "/lengths/AzureLLMInferenceTrace_code.csv";
  pipeline::LengthReadOptions read;
  read.column = "ContextTokens";
  const auto lengths = pipeline::read_lengths(file, read);
  REQUIRE(lengths.size() == 8819);
  for (const char* sampler : {"greedy", "bfd"}) {
    INFO(sampler);
    pipeline::PackPlanOptions o;
    o.sampler = sampler;
    o.max_tokens = 8192;
    o.effective_batch_size = 3;
    o.budget = "padded";
    o.ranks = 5;
    o.lr_rule = "sqrt";
    o.base_batch_size = 6;
    o.schedule.kind = pipeline::LrScheduleKind::warmup_linear;
    o.schedule.warmup_steps = 20;
    o.schedule.total_steps = 400;
    o.schedule.base_lr = 3e-4;
    std::vector<std::string> args = {"--lengths",
                                     file,
                                     "--column",
                                     "ContextTokens",
                                     "--sampler",
                                     sampler,
                                     "--max-tokens",
                                     "8192",
                                     "--effective-batch-size",
                                     "3",
                                     "--budget",
                                     "padded",
                                     "--ranks",
                                     "5",
                                     "--lr-rule",
                                     "sqrt",
                                     "--base-batch-size",
                                     "6",
                                     "--schedule",
                                     "warmup_linear",
                                     "--warmup-steps",
                                     "20",
                                     "--total-steps",
                                     "400",
                                     "--base-lr",
                                     "0.0003"};
    if (std::string(sampler) == "greedy") {
      o.order = "random";
      o.seed = 11;
      args.insert(args.end(), {"--order", "random", "--seed", "11"});
    }
    const auto plan = pipeline::pack_plan(runtime(), lengths, o);
    CHECK(plan.sampler == sampler);
    CHECK(plan.options.max_tokens == 8192);
    CHECK(plan.options.budget == TokenBudget::padded);
    CHECK(plan.step_count() > 100);
    check_same_as_cli(plan, cli_pack(args), 5);
    // Every sample is packed once, dropped or left over.
    std::vector<int> seen(lengths.size(), 0);
    for (auto id : plan.sample_ids) ++seen[static_cast<std::size_t>(id)];
    for (auto id : plan.dropped_ids) ++seen[static_cast<std::size_t>(id)];
    for (auto id : plan.leftover_ids) ++seen[static_cast<std::size_t>(id)];
    CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  }
}

TEST_CASE("ranks: owners round robin, lists padded by repeating from the start") {
  const std::vector<std::int64_t> lengths(23, 10);
  pipeline::PackPlanOptions o;
  o.max_tokens = 20;  // two samples a micro-batch: 12 micro-batches (the last holds one)
  for (std::int64_t ranks : {1, 5, 12, 13, 30}) {
    INFO("ranks ", ranks);
    o.ranks = ranks;
    const auto plan = pipeline::pack_plan(runtime(), lengths, o);
    const std::size_t count = plan.microbatch_count();
    REQUIRE(count == 12);
    const auto r = static_cast<std::size_t>(ranks);
    const std::size_t per_rank = (count + r - 1) / r;
    REQUIRE(plan.rank_offsets.size() == r + 1);
    REQUIRE(plan.microbatch_ranks.size() == count);
    for (std::size_t i = 0; i < count; ++i)
      CHECK(plan.microbatch_ranks[i] == static_cast<std::int64_t>(i % r));
    for (std::size_t rank = 0; rank < r; ++rank) {
      const auto mine = plan.microbatches_of_rank(rank);
      REQUIRE(mine.size() == per_rank);
      for (std::size_t j = 0; j < per_rank; ++j) {
        const std::size_t slot = rank + j * r;  // slot in the padded list
        CHECK(mine[j] == static_cast<std::int64_t>(slot % count));
        if (slot < count) CHECK(plan.microbatch_ranks[slot] == static_cast<std::int64_t>(rank));
      }
    }
  }
  o.ranks = 0;
  const auto none = pipeline::pack_plan(runtime(), lengths, o);
  CHECK(none.microbatch_ranks.empty());
  CHECK(none.rank_offsets.empty());
  CHECK_THROWS_AS((void)none.microbatches_of_rank(0), Error);
}

TEST_CASE("options are checked, naming the option, the value and what is valid") {
  const std::vector<std::int64_t> lengths = {3, 4, 5};
  auto fails = [&](const pipeline::PackPlanOptions& o, const std::string& message) {
    try {
      (void)pipeline::pack_plan(runtime(), lengths, o);
      FAIL("expected an error: " << message);
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::invalid_argument);
      CHECK(std::string(e.what()) == message);
    }
  };
  pipeline::PackPlanOptions o;
  o.max_tokens = 8;
  fails(
      [&] {
        auto x = o;
        x.sampler = "ffd";
        return x;
      }(),
      "sampler 'ffd' is not valid; valid: bfd, greedy");
  fails(pipeline::PackPlanOptions{},
        "no token budget: give max_tokens (the token budget of a micro-batch, >= 1)");
  fails(
      [&] {
        auto x = o;
        x.order = "longest";
        return x;
      }(),
      "order 'longest' is not valid; valid: dataloader, seqlen, random");
  fails(
      [&] {
        auto x = o;
        x.min_batch_size = -1;
        return x;
      }(),
      "min_batch_size -1 is out of range; must be >= 0");
  fails(
      [&] {
        auto x = o;
        x.effective_batch_size = 0;
        return x;
      }(),
      "effective_batch_size 0 is out of range; must be >= 1");
  fails(
      [&] {
        auto x = o;
        x.budget = "tokens";
        return x;
      }(),
      "budget 'tokens' is not valid; valid: sum, padded");
  fails(
      [&] {
        auto x = o;
        x.ranks = -2;
        return x;
      }(),
      "ranks -2 is out of range; must be between 0 and 1048576 (0: no rank assignment)");
  fails(
      [&] {
        auto x = o;
        x.ranks = std::int64_t{1} << 62;
        return x;
      }(),
      "ranks 4611686018427387904 is out of range; must be between 0 and 1048576 (0: no rank "
      "assignment)");
  fails(
      [&] {
        auto x = o;
        x.lr_rule = "cubic";
        x.base_batch_size = 2;
        return x;
      }(),
      "lr_rule 'cubic' is not valid; valid: linear, none, sqrt");
  fails(
      [&] {
        auto x = o;
        x.lr_rule = "sqrt";
        return x;
      }(),
      "learning-rate rule 'sqrt' needs the base batch size: give base_batch_size (the batch "
      "size base_lr is tuned for, > 0)");
  fails(
      [&] {
        auto x = o;
        x.lr_rule = "sqrt";
        x.base_batch_size = 0;
        return x;
      }(),
      "base_batch_size 0 is out of range; must be a finite number > 0");
  // The CLI's spelling: the same checks, named as its flags.
  fails(
      [&] {
        auto x = o;
        x.spelling = pipeline::OptionSpelling::cli;
        x.lr_rule = "x";
        return x;
      }(),
      "--lr-rule 'x' is not valid; valid: linear, none, sqrt");
  // The sampler's own schema still has the last word.
  try {
    auto x = o;
    x.sampler = "bfd";
    x.order = "random";
    (void)pipeline::pack_plan(runtime(), lengths, x);
    FAIL("bfd has no order");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("unknown parameter 'order'") != std::string::npos);
  }
  // A bad length names its sample.
  const std::vector<std::int64_t> bad = {3, 0, 5};
  CHECK_THROWS_WITH_AS((void)pipeline::pack_plan(runtime(), bad, o), doctest::Contains("sample 1"),
                       Error);
}

TEST_CASE("max_tokens' range is the sampler's schema's, checked once when the sampler is made") {
  const std::vector<std::int64_t> lengths = {3, 4, 5};
  for (const char* sampler : {"greedy", "bfd"}) {
    for (const std::int64_t bad :
         {std::int64_t{0}, std::int64_t{-4}, kMaxTokenBudget + 1, std::int64_t{1} << 62}) {
      for (const auto spelling : {pipeline::OptionSpelling::api, pipeline::OptionSpelling::cli}) {
        CAPTURE(sampler);
        CAPTURE(bad);
        pipeline::PackPlanOptions o;
        o.sampler = sampler;
        o.max_tokens = bad;
        o.spelling = spelling;
        try {
          (void)pipeline::pack_plan(runtime(), lengths, o);
          FAIL("accepted max_tokens = " << bad);
        } catch (const Error& e) {
          CHECK(e.kind() == ErrorKind::config);
          CHECK(std::string(e.what()) == std::string("batching plugin '") + sampler +
                                             "': max_tokens = " + std::to_string(bad) +
                                             " is out of range: must be between 1 and 2147483647");
        }
      }
    }
    // The same bound for a budget given among the sampler's parameters.
    pipeline::PackPlanOptions o;
    o.sampler = sampler;
    o.sampler_params.set("max_tokens", std::int64_t{0});
    CHECK_THROWS_WITH_AS((void)pipeline::pack_plan(runtime(), lengths, o),
                         doctest::Contains("max_tokens = 0 is out of range: must be between 1 and "
                                           "2147483647"),
                         Error);
    // Both ends of the range pack.
    const std::vector<std::int64_t> with_one = {3, 1, 4};
    for (const std::int64_t good : {std::int64_t{1}, kMaxTokenBudget}) {
      o.sampler_params = {};
      o.max_tokens = good;
      CHECK(pipeline::pack_plan(runtime(), with_one, o).options.max_tokens == good);
    }
  }
}

TEST_CASE("lengths near 2^62 are dropped, and sums at the largest budget do not overflow") {
  // Under the sanitizer build a signed overflow anywhere aborts the test.
  constexpr std::int64_t big = std::int64_t{1} << 62;
  constexpr std::int64_t cap = kMaxTokenBudget;
  const std::vector<std::int64_t> lengths = {big, cap, 5, big - 7, cap - 1, 1, big};
  for (const char* sampler : {"greedy", "bfd"}) {
    for (const char* budget : {"sum", "padded"}) {
      CAPTURE(sampler);
      CAPTURE(budget);
      pipeline::PackPlanOptions o;
      o.sampler = sampler;
      o.budget = budget;
      o.max_tokens = cap;
      const auto plan = pipeline::pack_plan(runtime(), lengths, o);
      CHECK(plan.dropped_ids == std::vector<std::int64_t>{0, 3, 6});
      std::int64_t tokens = 0;
      for (std::size_t m = 0; m < plan.microbatch_count(); ++m) {
        std::int64_t sum = 0, longest = 0;
        const auto ids = plan.microbatch(m);
        for (const auto id : ids) {
          sum += lengths[static_cast<std::size_t>(id)];
          longest = std::max(longest, lengths[static_cast<std::size_t>(id)]);
        }
        CHECK(sum > 0);
        CHECK((std::string(budget) == "sum"
                   ? sum
                   : longest * static_cast<std::int64_t>(ids.size())) <= cap);
        tokens += sum;
      }
      CHECK(tokens == cap + 5 + (cap - 1) + 1);
      CHECK(plan.stats.tokens == tokens);
    }
  }
}

TEST_CASE("pack_plan_configured uses the runtime's [batching] and [lr] instances") {
  test::TempDir dir;
  dir.write("lengths.txt", "5\n9\n3\n7\n2\n8\n8\n1\n6\n4\n");
  const auto config = dir.write("job.toml", R"([batching]
sampler = "bfd"
max_tokens = 16
effective_batch_size = 2
lengths = "lengths.txt"

[lr]
rule = "linear"
base_lr = 0.5
base_batch_size = 2
schedule = "warmup_linear"
warmup_steps = 1
total_steps = 4
)");
  auto rt = core::Runtime::from_file(config);
  const auto setup = pipeline::pack_setup_from_config(rt.config());
  CHECK(setup.lengths == dir.path() / "lengths.txt");
  CHECK(setup.options.sampler == "bfd");
  CHECK(*setup.options.lr_rule == "linear");
  const auto lengths = pipeline::read_lengths(setup.lengths, setup.read);
  const auto configured = pipeline::pack_plan_configured(rt, lengths);
  const auto fresh = pipeline::pack_plan(rt, lengths, setup.options);
  CHECK(configured.sample_ids == fresh.sample_ids);
  CHECK(configured.batch_sizes == fresh.batch_sizes);
  CHECK(configured.lrs == fresh.lrs);
  REQUIRE(configured.lrs.size() == configured.step_count());
  CHECK(configured.lrs[0] == doctest::Approx(0.0));  // warm-up starts at min_lr
  auto none = core::Runtime::from_string("[log]\nlevel = \"warn\"\n", "none.toml");
  CHECK_THROWS_WITH_AS((void)pipeline::pack_plan_configured(none, lengths),
                       doctest::Contains("no [batching] section"), Error);
}
