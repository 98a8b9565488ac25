// `ductile pack` run as a subprocess: JSON output, exit codes, errors.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "temp_dir.hpp"

using nlohmann::json;

namespace {

const std::string kData = std::string(DUCTILE_TEST_DATA_DIR) + "/lengths";

struct Run {
  int code = -1;
  std::string out;
};

Run run_ductile(const std::string& args) {
  const std::string command = std::string(DUCTILE_CLI) + " " + args + " 2>/dev/null";
  Run r;
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::array<char, 65536> buffer{};
  std::size_t n = 0;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0)
    r.out.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

json pack_json(const std::string& args) {
  Run r = run_ductile("pack --json " + args);
  INFO(args, "\n", r.out.substr(0, 800));
  REQUIRE(r.code == 0);
  return json::parse(r.out);
}

void expect_user_error(const std::string& args, const char* needle) {
  Run r = run_ductile("pack --json " + args);
  INFO(args, "\n", r.out.substr(0, 800));
  CHECK(r.code == 2);
  const json j = json::parse(r.out);
  REQUIRE(j.contains("error"));
  CHECK(j["error"].contains("type"));
  CHECK(j["error"]["message"].get<std::string>().find(needle) != std::string::npos);
}

}  // namespace

TEST_CASE("packs a real trace and reports micro-batches, steps, efficiency and learning rates") {
  const json j = pack_json("--lengths " + kData +
                           "/AzureLLMInferenceTrace_code.csv --column ContextTokens "
                           "--max-tokens 8192 --effective-batch-size 2 --lr-rule linear "
                           "--base-lr 0.001 --base-batch-size 4");
  const auto& stats = j["stats"];
  const auto mbs = j["microbatch_ids"];
  CHECK(stats["microbatches"].get<std::size_t>() == mbs.size());
  CHECK(mbs.size() % 2 == 0);
  CHECK(j["batch_sizes"].size() == mbs.size() / 2);
  CHECK(j["lrs"].size() == j["batch_sizes"].size());
  // Every step's rate is lr x its batch size / 4 (linear rule).
  for (std::size_t s = 0; s < j["lrs"].size(); ++s)
    CHECK(j["lrs"][s].get<double>() ==
          doctest::Approx(0.001 * j["batch_sizes"][s].get<double>() / 4));
  const double e = stats["token_efficiency"].get<double>();
  CHECK(e > 0.5);
  CHECK(e <= 1.0);
  CHECK(stats["padded_efficiency"].get<double>() <= 1.0);
  CHECK(stats["sequences"].get<std::int64_t>() +
            static_cast<std::int64_t>(j["dropped_ids"].size()) +
            static_cast<std::int64_t>(j["leftover_ids"].size()) ==
        8819);
  CHECK(stats.contains("seconds"));
}

TEST_CASE("bfd packs tighter than greedy and ranks split the micro-batches round robin") {
  const std::string input =
      "--lengths " + kData + "/debian_fortunes_word_lengths.txt --max-tokens 512";
  const json greedy = pack_json(input + " --order seqlen");
  const json bfd = pack_json(input + " --sampler bfd --ranks 3");
  CHECK(bfd["stats"]["microbatches"].get<int>() < greedy["stats"]["microbatches"].get<int>());
  const auto& ranks = bfd["ranks"];
  REQUIRE(ranks.size() == 3);
  const std::size_t n = bfd["microbatch_ids"].size();
  CHECK(ranks[0].size() == (n + 2) / 3);
  CHECK(ranks[1][0].get<std::size_t>() == 1);
}

TEST_CASE("DeepSpeed metric files and a DeepSpeed JSON config are accepted") {
  ductile::test::TempDir dir;
  const auto seqlen = dir.path() / "metrics" / "seqlen";
  std::filesystem::create_directories(seqlen);
  for (const char* ext : {".bin", ".idx"})
    std::filesystem::copy_file(kData + "/deepspeed_metric/azure_conv_seqlen_u16" + std::string(ext),
                               seqlen / (std::string("seqlen_sample_to_metric") + ext));
  dir.write("ds.json", R"({"train_batch_size": 4, "data_efficiency": {"seed": 7, "data_sampling":
      {"dynamic_batching": {"enabled": true, "max_tokens": 16384, "metrics_path": "metrics",
       "sequence_picking_order": "random", "lr_scaling_method": "sqrt"}}}})");
  const json j = pack_json("--config " + (dir.path() / "ds.json").string());
  CHECK(j["stats"]["sequences"].get<int>() + j["leftover_ids"].size() == 19366);
  CHECK(j["lrs"].size() == j["batch_sizes"].size());
  // The same lengths straight from the CSV and the same options give the same packing.
  const json direct =
      pack_json("--lengths " + kData +
                "/AzureLLMInferenceTrace_conv.csv --column ContextTokens "
                "--max-tokens 16384 --order random --seed 7 --effective-batch-size 4");
  CHECK(direct["microbatch_ids"] == j["microbatch_ids"]);
}

TEST_CASE("a TOML config names sampler, lengths and LR, and flags override it") {
  ductile::test::TempDir dir;
  std::filesystem::copy_file(kData + "/squad11_bert384_hist.csv", dir.path() / "squad.csv");
  dir.write("run.toml", R"([batching]
sampler = "bfd"
max_tokens = 384
lengths = "squad.csv"
column = "length"
count_column = "count"

[lr]
rule = "none"
base_lr = 0.5
base_batch_size = 8
)");
  const json j = pack_json("--config " + (dir.path() / "run.toml").string());
  CHECK(j["stats"]["sequences"].get<int>() == 88641);
  for (const auto& lr : j["lrs"]) CHECK(lr.get<double>() == 0.5);
  const json k = pack_json("--config " + (dir.path() / "run.toml").string() + " --max-tokens 768");
  CHECK(k["stats"]["microbatches"].get<int>() < j["stats"]["microbatches"].get<int>());
}

TEST_CASE("user errors exit 2 with a JSON error naming the problem") {
  ductile::test::TempDir dir;
  const auto bad = dir.write("bad.txt", "5\n0\n");
  expect_user_error("--lengths " + bad.string() + " --max-tokens 10", "line 2");
  expect_user_error("--lengths " + (dir.path() / "nope.txt").string() + " --max-tokens 10",
                    "no such file");
  expect_user_error("--lengths " + kData + "/debian_fortunes_word_lengths.txt", "--max-tokens");
  expect_user_error("--lengths " + kData + "/debian_fortunes_word_lengths.txt --max-tokens ten",
                    "'ten' is not an integer");
  // The budget's range is the sampler's schema's, whether flag or config gives it.
  expect_user_error("--lengths " + kData + "/debian_fortunes_word_lengths.txt --max-tokens 0",
                    "batching plugin 'greedy': max_tokens = 0 is out of range: must be between 1 "
                    "and 2147483647");
  expect_user_error("--lengths " + kData +
                        "/debian_fortunes_word_lengths.txt --sampler bfd --max-tokens 2147483648",
                    "batching plugin 'bfd': max_tokens = 2147483648 is out of range: must be "
                    "between 1 and 2147483647");
  expect_user_error("--lengths " + kData +
                        "/debian_fortunes_word_lengths.txt --max-tokens 10 "
                        "--sampler ffd",
                    "'ffd' is not valid");
  expect_user_error("--lengths " + kData +
                        "/debian_fortunes_word_lengths.txt --max-tokens 10 "
                        "--sampler bfd --order random",
                    "unknown parameter 'order'");
  expect_user_error("--lengths " + kData +
                        "/debian_fortunes_word_lengths.txt --max-tokens 64 "
                        "--lr-rule linear",
                    "--base-batch-size");
  expect_user_error(
      "--lengths " + kData + "/debian_fortunes_word_lengths.txt --max-tokens 99999999999999999999",
      "--max-tokens 99999999999999999999 is past the largest integer (2^63-1)");
  const auto two = dir.write("two.txt", "3\n4\n");
  expect_user_error("--lengths " + two.string() + " --max-tokens 5 --effective-batch-size 4",
                    "not enough samples");
  const auto toml = dir.write("bad.toml", "[batching]\nsampler = \"greedy\"\nmax_tokens = -3\n");
  Run r = run_ductile("pack --json --config " + toml.string());
  CHECK(r.code == 2);
  CHECK(json::parse(r.out)["error"]["message"].get<std::string>().find("max_tokens") !=
        std::string::npos);
}

TEST_CASE("a histogram row of a few bytes cannot expand past the stated sample cap") {
  ductile::test::TempDir dir;
  // 22 bytes standing for 300 million samples (about 4.7 GB once packed) and
  // for 2^30 (which ran out of memory): refused before anything is
  // allocated, with the file, line, column, value and cap, as a user error.
  for (const char* count : {"300000000", "1073741824"}) {
    CAPTURE(count);
    const auto csv = dir.write("h.csv", std::string("len,count\n5,") + count + "\n");
    const auto start = std::chrono::steady_clock::now();
    Run r = run_ductile("pack --json --lengths " + csv.string() +
                        " --column len --count-column count --max-tokens 4096");
    const auto seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(r.code == 2);
    const json j = json::parse(r.out, nullptr, false);
    REQUIRE_MESSAGE(j.contains("error"), r.out);
    const auto message = j["error"]["message"].get<std::string>();
    CHECK_MESSAGE(
        message.find(csv.string() + ": line 2, column 'count': count " + count +
                     " expands the file to more than 268435456 samples") != std::string::npos,
        message);
    // Refused in milliseconds; expanding took seconds and gigabytes.
    CHECK(seconds < 10.0);
  }
}

TEST_CASE("the demo's batching part packs the sample data and shows steps with learning rates") {
  ductile::test::TempDir dir;
  const std::string source = std::string(DUCTILE_SOURCE_DIR);
  // The [batching] and [lr] sections of the shipped demo config, with the
  // sample data next to them.
  std::ifstream in(source + "/samples/configs/demo.toml");
  REQUIRE(in.good());
  std::string line, config;
  bool keep = false;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] == '[')
      keep = line.rfind("[batching]", 0) == 0 || line.rfind("[lr]", 0) == 0;
    if (keep) config += line + "\n";
  }
  std::filesystem::create_directories(dir.path() / "configs");
  std::filesystem::copy(source + "/samples/data", dir.path() / "data");
  dir.write("configs/demo.toml", config);
  Run r = run_ductile("demo --config " + (dir.path() / "configs" / "demo.toml").string());
  INFO(r.out.substr(0, 3000));
  CHECK(r.code == 0);
  CHECK(r.out.find("-- dynamic batching --") != std::string::npos);
  CHECK(r.out.find("token efficiency") != std::string::npos);
  CHECK(r.out.find("learning rate") != std::string::npos);
}
