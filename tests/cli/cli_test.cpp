// The `ductile` CLI as a user runs it: exit codes, output, and garbage input.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "ductile/version.hpp"
#include "process.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using ductile::test::run_process;
using ductile::test::TempDir;

namespace {

const std::string kGood = (fs::path(FIXTURE_ROOT) / "good").string();
const std::string kBad = (fs::path(FIXTURE_ROOT) / "bad").string();

ductile::test::ProcessResult cli(std::vector<std::string> args, std::vector<std::string> env = {}) {
  args.insert(args.begin(), DUCTILE_CLI);
  env.push_back("DUCTILE_PLUGIN_PATH=");
  return run_process(args, env);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("--help and --version exit 0, and every subcommand has --help") {
  auto help = cli({"--help"});
  CHECK(help.exit_code == 0);
  CHECK(contains(help.out, "plugins"));
  CHECK(contains(help.out, "config"));
  auto version = cli({"--version"});
  CHECK(version.exit_code == 0);
  CHECK(contains(version.out, "ductile 0.1.0"));
  CHECK(contains(version.out, "ABI " + std::to_string(DUCTILE_ABI_VERSION) + ","));
  for (auto sub : std::vector<std::vector<std::string>>{{"plugins", "--help"},
                                                        {"plugins", "list", "--help"},
                                                        {"plugins", "describe", "--help"},
                                                        {"config", "--help"},
                                                        {"config", "check", "--help"},
                                                        {"demo", "--help"},
                                                        {"elastic", "--help"},
                                                        {"pack", "--help"},
                                                        {"zero", "--help"},
                                                        {"agent", "--help"}}) {
    auto r = cli(sub);
    CHECK_MESSAGE(r.exit_code == 0, sub[0]);
    CHECK(contains(r.out, "Usage: ductile " + sub[0]));
  }
  // Only the command named is built before parsing; --help names none and
  // lists them all, the agent (which runs in a program of its own) too.
  for (const char* command : {"plugins", "config", "demo", "elastic", "pack", "zero", "agent"})
    CHECK_MESSAGE(contains(help.out, std::string("\n  ") + command + " "), command);
  CHECK(contains(help.out, "Run this node's workers as part of an elastic job"));
}

TEST_CASE("`ductile agent` runs the agent program in its place, with the whole command line") {
  // The agent program, lib/ductile/ductile-agent beside lib/ductile/plugins.
  CHECK(
      fs::weakly_canonical(fs::path(DUCTILE_CLI).parent_path() / "../lib/ductile/ductile-agent") ==
      fs::weakly_canonical(DUCTILE_AGENT_PROGRAM));
  // Global options before the command reach it: a bad --log-level is refused
  // there, after its own command line parsed.
  auto level = cli({"--log-level", "loud", "agent", "--rdzv", "etcd://127.0.0.1:1", "--job-id", "j",
                    "--nproc-per-node", "1", "--", "true"});
  CHECK(level.exit_code == 2);
  CHECK(contains(level.err, "--log-level: invalid log level 'loud'"));
  auto option = cli({"agent", "--max-restarts", "many"});
  CHECK(option.exit_code == 2);
  CHECK(contains(option.err, "--max-restarts"));
  // Run directly, the agent program takes the same command line.
  auto direct = run_process({DUCTILE_AGENT_PROGRAM, "agent", "--help"});
  CHECK(direct.exit_code == 0);
  CHECK(contains(direct.out, "Usage: ductile agent"));
}

TEST_CASE("plugins list shows kind, name, version, file and description") {
  auto r = cli({"--plugin-path", kGood, "plugins", "list"});
  CHECK(r.exit_code == 0);
  CHECK(contains(r.out, "fixture_good"));
  CHECK(contains(r.out, "1.2.3"));
  CHECK(contains(r.out, "A well-formed fixture plugin"));
  CHECK(contains(r.out, kGood + "/libductile_lr_fixture_good.so"));

  auto j = cli({"--plugin-path", kGood, "plugins", "list", "--json"});
  REQUIRE(j.exit_code == 0);
  auto doc = nlohmann::json::parse(j.out);
  bool found = false;
  for (const auto& p : doc["plugins"])
    if (p["name"] == "fixture_good") {
      found = true;
      CHECK(p["kind"] == "lr");
      CHECK(p["version"] == "1.2.3");
      CHECK(p["file"] == kGood + "/libductile_lr_fixture_good.so");
    }
  CHECK(found);
  CHECK(doc["search_path"][0] == kGood);
}

TEST_CASE("plugins list reports broken plugin files as problems, not crashes") {
  auto r = cli({"--plugin-path", kBad, "plugins", "list", "--json"});
  CHECK(r.exit_code == 0);
  auto doc = nlohmann::json::parse(r.out);
  CHECK(doc["problems"].size() == 6);
}

TEST_CASE("plugins describe prints the schema") {
  auto r = cli({"--plugin-path", kGood, "plugins", "describe", "fixture_good"});
  CHECK(r.exit_code == 0);
  CHECK(contains(r.out, "steps (integer, required, [1, 1000])"));
  CHECK(contains(r.out, "mode (string, default \"fast\", fast|exact)"));
  auto j = cli({"--plugin-path", kGood, "plugins", "describe", "lr/fixture_good", "--json"});
  REQUIRE(j.exit_code == 0);
  auto doc = nlohmann::json::parse(j.out);
  CHECK(doc["params"][0]["key"] == "steps");
  CHECK(doc["params"][0]["required"] == true);
  CHECK(doc["params"][0]["min"] == 1.0);
  CHECK(doc["params"][3]["allowed"] == nlohmann::json::array({"fast", "exact"}));
}

TEST_CASE("describing an unknown plugin is a user error with a suggestion") {
  auto r = cli({"--plugin-path", kGood, "plugins", "describe", "fixture_goodd"});
  CHECK(r.exit_code == 2);
  CHECK(contains(r.err, "no plugin named 'fixture_goodd' (did you mean 'fixture_good'?)"));
  auto j = cli({"--plugin-path", kGood, "plugins", "describe", "nope", "--json"});
  CHECK(j.exit_code == 2);
  auto doc = nlohmann::json::parse(j.out);
  CHECK(doc["error"]["type"] == "NotFound");
}

TEST_CASE("config check: 0 for a valid file, 2 with every error otherwise") {
  TempDir dir;
  auto ok = dir.write("ok.toml", "[lr]\nrule = \"fixture_good\"\nsteps = 4\n");
  auto r = cli({"--plugin-path", kGood, "config", "check", ok.string()});
  CHECK(r.exit_code == 0);
  CHECK(contains(r.out, "valid"));
  CHECK(contains(r.out, "steps = 4"));

  auto bad = dir.write("bad.toml", "[lr]\nrule = \"fixture_good\"\nsteps = 0\nmode = \"slow\"\n");
  auto b = cli({"--plugin-path", kGood, "config", "check", bad.string()});
  CHECK(b.exit_code == 2);
  CHECK(contains(b.err, bad.string() + ":3:9: [lr] steps = 0 is out of range"));
  CHECK(contains(b.err, bad.string() + ":4:8: [lr] mode = \"slow\" is not allowed"));
}

TEST_CASE("a plugin whose schema sets a bound without its flag is a user error, with the fix") {
  TempDir dir;
  const std::string unchecked = (fs::path(FIXTURE_ROOT) / "unchecked").string();
  auto config = dir.write("lr.toml", "[lr]\nrule = \"fixture_unchecked\"\nsteps = 0\n");
  const std::string refusal =
      "plugin lr/fixture_unchecked declares parameter 'steps' with min_value 1 but without the "
      "param_has_min flag, so the bound is never checked; add ductile::param_has_min to its "
      ".flags to check it, or remove .min_value";
  auto r = cli({"--plugin-path", unchecked, "config", "check", config.string()});
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(contains(r.err, refusal), r.err);
  auto j = cli({"--plugin-path", unchecked, "plugins", "describe", "fixture_unchecked", "--json"});
  CHECK(j.exit_code == 2);
  auto doc = nlohmann::json::parse(j.out);
  CHECK(doc["error"]["type"] == "PluginError");
  CHECK(contains(doc["error"]["message"].get<std::string>(), refusal));
}

TEST_CASE("config check runs no plugin of the file's own [plugins] path unless allowed") {
  // A bundle from elsewhere: a file whose [plugins] path is its own
  // directory, and a plugin there whose constructor leaves a marker.
  TempDir bundle, markers;
  fs::copy_file(fs::path(FIXTURE_ROOT) / "trust" / "libductile_lr_fixture_marked.so",
                bundle / "libductile_lr_fixture_marked.so");
  auto job =
      bundle.write("job.toml", "[plugins]\npath = [\".\"]\n[lr]\nrule = \"fixture_marked\"\n");
  const std::vector<std::string> env = {"DUCTILE_FIXTURE_MARKER_DIR=" + markers.path().string()};
  const fs::path marker = markers / "fixture_marked.ran";
  const std::string own_dir = (bundle.path() / ".").string();

  auto refused = cli({"config", "check", job.string()}, env);
  CHECK(refused.exit_code == 2);
  CHECK(contains(refused.err, job.string() + ":4:8: [lr] rule = \"fixture_marked\": no lr plugin "
                                             "named 'fixture_marked'"));
  CHECK_MESSAGE(contains(refused.err, "not searched: '" + own_dir +
                                          "' (named by the file's [plugins] path; `ductile config "
                                          "check` loads no plugin from there unless given "
                                          "--allow-config-plugins)"),
                refused.err);
  CHECK_FALSE(fs::exists(marker));

  // A file of the same bundle that selects a built-in plugin is checked, and
  // says what it did not search.
  auto builtin =
      bundle.write("builtin.toml", "[plugins]\npath = [\".\"]\n[lr]\nrule = \"linear\"\n");
  auto checked = cli({"config", "check", builtin.string()}, env);
  CHECK(checked.exit_code == 0);
  CHECK(contains(checked.out, "  not searched: '" + own_dir +
                                  "' (named by the file's [plugins] "
                                  "path; `ductile config check`"));
  CHECK_FALSE(fs::exists(marker));

  auto allowed = cli({"config", "check", "--allow-config-plugins", job.string()}, env);
  CHECK_MESSAGE(allowed.exit_code == 0, allowed.err);
  CHECK(contains(allowed.out, "[lr] lr plugin 'fixture_marked'"));
  CHECK_FALSE(contains(allowed.out, "not searched"));
  CHECK(fs::exists(marker));
}

TEST_CASE("config check runs the plugins' own checks, at the key they name or the section") {
  TempDir dir;
  // v0.2: a model replica may not span nodes (known from the parameters alone).
  auto v02 = dir.write("v02.toml",
                       "# job\n[elasticity]\nversion = 0.2\nmax_train_batch_size = 1000\n"
                       "micro_batch_sizes = [2, 4]\nnum_gpus_per_node = 6\n"
                       "model_parallel_size = 4\n");
  auto r = cli({"config", "check", v02.string()});
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(
      contains(r.err, v02.string() + ":2:1: elasticity (v0.2): num_gpus_per_node = 6 must be "
                                     "divisible by model_parallel_size = 4"),
      r.err);
  auto ok = dir.write("ok.toml",
                      "[elasticity]\nversion = 0.2\nmax_train_batch_size = 1000\n"
                      "micro_batch_sizes = [2, 4]\nnum_gpus_per_node = 8\n"
                      "model_parallel_size = 4\n");
  CHECK(cli({"config", "check", ok.string()}).exit_code == 0);

  // A DeepSpeed check the plugin ties to a key: reported at that key's value.
  auto v01 = dir.write("v01.toml",
                       "[elasticity]\nversion = 0.1\nmax_train_batch_size = 100\n"
                       "micro_batch_sizes = [4]\nmin_gpus = 0\n");
  auto e = cli({"config", "check", v01.string()});
  CHECK(e.exit_code == 2);
  CHECK_MESSAGE(contains(e.err, v01.string() +
                                    ":5:12: elasticity (v0.1): min_gpus and max_gpus must be >= 1"),
                e.err);

  const std::string checks = (fs::path(FIXTURE_ROOT) / "checks").string();
  auto odd = dir.write("odd.toml", "[lr]\nrule = \"fixture_checked\"\nsteps = 3\n");
  auto o = cli({"--plugin-path", checks, "config", "check", odd.string()});
  CHECK(o.exit_code == 2);
  CHECK_MESSAGE(contains(o.err, odd.string() + ":3:9: fixture_checked: steps = 3 must be even"),
                o.err);
}

TEST_CASE("config check reads a DeepSpeed JSON config through the one mapping, naming its keys") {
  TempDir dir;
  // Every value a run would refuse, each named by the user's file and key.
  auto bad = dir.write("ds_config.json", R"({
    "train_batch_size": 8,
    "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1.5,
                          "stage3_max_live_parameters": -1,
                          "offload_optimizer": {"device": "cpu", "ratio": 2}},
    "elasticity": {"enabled": true, "max_train_batch_size": 0, "micro_batch_sizes": [2, 4]}
  })");
  auto r = cli({"config", "check", bad.string()});
  CHECK(r.exit_code == 2);
  for (const char* expected :
       {": zero_optimization.stage3_max_live_parameters = -1.0 is out of range: must be >= 0",
        ": zero_optimization.offload_optimizer.ratio = 2.0 is out of range: must be between 0 "
        "and 1",
        ": elasticity.max_train_batch_size: elasticity (v0.2): max_train_batch_size = 0 is "
        "invalid"})
    CHECK_MESSAGE(contains(r.err, bad.string() + expected), r.err);
  // The coordinator's own check (a whole number of elements), at the user's key.
  auto half = dir.write("half.json", R"({"zero_optimization": {"stage": 3,
      "stage3_prefetch_bucket_size": 1.5}})");
  auto h = cli({"config", "check", half.string()});
  CHECK(h.exit_code == 2);
  CHECK_MESSAGE(contains(h.err, half.string() + ": zero_optimization.stage3_prefetch_bucket_size "
                                                "= 1.5: expected a whole number of elements"),
                h.err);
  CHECK_MESSAGE(!contains(h.err, "[zero]"), h.err);
  // A valid one: its sections as ductile reads them, and what is not acted on.
  auto ok = dir.write("ok.json", R"({"zero_optimization": {"stage": 3,
      "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": "auto",
      "offload_param": {"device": "cpu", "pin_memory": true},
      "offload_optimizer": {"device": "cpu"}},
      "elasticity": {"enabled": true, "max_train_batch_size": 100, "micro_batch_sizes": [2]}})");
  auto o = cli({"config", "check", ok.string()});
  CHECK_MESSAGE(o.exit_code == 0, o.err);
  CHECK(contains(o.out, "valid (DeepSpeed JSON)"));
  CHECK(contains(o.out, "[zero] zero plugin 'partitioned'"));
  CHECK(contains(o.out, "prefetch_bucket_size = 50000000"));
  CHECK(contains(o.out, "offload_optimizer = \"cpu\""));
  CHECK(contains(o.out, "[elasticity] elasticity plugin 'v0.2'"));
  CHECK(contains(o.out, "offload_param = \"cpu\""));
  CHECK(contains(o.out, "zero_optimization.offload_param.pin_memory is accepted but ignored"));

  // Its dynamic batching block, when it has one, as `ductile pack` reads it.
  auto batching = dir.write("batching.json", R"({"train_batch_size": 4,
      "optimizer": {"type": "Lamb", "params": {"lr": 0.5}},
      "data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": 0,
          "sequence_picking_order": "shortest", "lr_scaling_method": "SQRT"}}}})");
  auto b = cli({"config", "check", batching.string()});
  CHECK(b.exit_code == 2);
  for (const char* expected :
       {": data_efficiency.data_sampling.dynamic_batching.max_tokens = 0 is out of range: must "
        "be between 1 and",
        ": data_efficiency.data_sampling.dynamic_batching.sequence_picking_order = \"shortest\" "
        "is not allowed; valid values: dataloader, seqlen, random"})
    CHECK_MESSAGE(contains(b.err, batching.string() + expected), b.err);
  auto packs = dir.write("packs.json", R"({"train_batch_size": 4,
      "optimizer": {"type": "Lamb", "params": {"lr": 0.5}},
      "data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": 64,
          "lr_scaling_method": "SQRT"}}}})");
  auto p = cli({"config", "check", packs.string()});
  CHECK_MESSAGE(p.exit_code == 0, p.err);
  CHECK(contains(p.out, "[batching] batching plugin 'greedy'"));
  CHECK(contains(p.out, "max_tokens = 64"));
  CHECK(contains(p.out, "effective_batch_size = 4"));
  CHECK(contains(p.out, "[lr] lr plugin 'sqrt'"));
  CHECK(contains(p.out, "base_lr = 0.5"));
}

TEST_CASE("config check refuses the training values the engine refuses, naming file and key") {
  TempDir dir;
  // Each value `ductile.deepspeed.initialize` refuses, with the message both give.
  const std::string batch = "; valid: an integer from 1 to 2147483647";
  for (const auto& [entry, expected] : std::vector<std::pair<std::string, std::string>>{
           {R"("train_batch_size": -8)", "train_batch_size = -8" + batch},
           {R"("train_batch_size": 1e30)", "train_batch_size = 1e+30" + batch},
           {R"("train_batch_size": 2147483648)", "train_batch_size = 2147483648" + batch},
           {R"("gradient_accumulation_steps": 18446744073709551616)",
            "gradient_accumulation_steps = 1.8446744073709552e+19" + batch},
           {R"("train_micro_batch_size_per_gpu": true)",
            "train_micro_batch_size_per_gpu = true" + batch},
           {R"("train_micro_batch_size_per_gpu": 2.5)",
            "train_micro_batch_size_per_gpu = 2.5" + batch},
           {R"("train_micro_batch_size_per_gpu": "2")",
            "train_micro_batch_size_per_gpu = \"2\"" + batch},
           {R"("steps_per_print": -1)",
            "steps_per_print = -1; valid: an integer from 1 to 1000000000"},
           {R"("steps_per_print": 9223372036854775808)",
            "steps_per_print = 9223372036854775808; valid: an integer from 1 to 1000000000"},
           {R"("gradient_clipping": -1)",
            "gradient_clipping = -1; valid: a number >= 0 (0: no clipping)"}}) {
    auto file = dir.write("bad.json", "{\"zero_optimization\": {\"stage\": 3}, " + entry + "}");
    auto r = cli({"config", "check", file.string()});
    CHECK_MESSAGE(r.exit_code == 2, entry << ": " << r.out);
    CHECK_MESSAGE(contains(r.err, file.string() + ": " + expected), entry << ": " << r.err);
    CHECK_MESSAGE(!contains(r.out, "valid (DeepSpeed JSON)"), r.out);
  }
  // A key inside the training sections that ductile does not act on is named.
  auto typos = dir.write("typos.json", R"({"train_batch_size": 8,
      "fp16": {"enabled": true, "loss_scale_windo": 100},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betaz": [0.9, 0.99]}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_stepz": 10}}})");
  auto t = cli({"config", "check", typos.string()});
  CHECK_MESSAGE(t.exit_code == 0, t.err);
  for (const char* key :
       {"fp16.loss_scale_windo", "optimizer.params.betaz", "scheduler.params.warmup_num_stepz"})
    CHECK_MESSAGE(contains(t.out, "warning: " + typos.string() + ": " + key), t.out);
  // What only ductile's engine cannot train is said, not refused: DeepSpeed
  // itself may train the config.
  auto lamb = dir.write("lamb.json", R"({"train_batch_size": 8, "optimizer": {"type": "Lamb"}})");
  auto l = cli({"config", "check", lamb.string()});
  CHECK_MESSAGE(l.exit_code == 0, l.err);
  CHECK_MESSAGE(contains(l.out, lamb.string() + ": optimizer.type = \"Lamb\": ductile's ZeRO-3 "
                                                "engine refuses it"),
                l.out);
}

TEST_CASE("config check reads JSON by its limits: depth, trailing text, a byte order mark") {
  TempDir dir;
  auto bom = dir.write("bom.conf", "\xEF\xBB\xBF{\"train_batch_size\": 8}");
  auto b = cli({"config", "check", bom.string()});
  CHECK_MESSAGE(b.exit_code == 0, b.err);
  CHECK(contains(b.out, "valid (DeepSpeed JSON)"));
  auto trailing = dir.write("trailing.json", "{\"train_batch_size\": 8} x");
  auto t = cli({"config", "check", trailing.string()});
  CHECK(t.exit_code == 2);
  CHECK_MESSAGE(contains(t.err, trailing.string() + ": invalid JSON: "), t.err);
  auto deep = dir.write("deep.json", "{\"a\": " + std::string(100000, '['));
  auto d = cli({"config", "check", deep.string()});
  CHECK(d.exit_code == 2);
  CHECK_MESSAGE(contains(d.err, deep.string() + ": JSON nested deeper than 64 levels"), d.err);
}

TEST_CASE("deep nesting and huge values in TOML are refused cleanly, quoted in excerpts") {
  TempDir dir;
  const int n = 100000;
  std::string arrays = "x = " + std::string(n, '[') + std::string(n, ']') + "\n";
  std::string tables;
  for (int i = 0; i < n; ++i) tables += "{a = ";
  tables = "x = " + tables + "1" + std::string(n, '}') + "\n";
  std::string path = "a";
  for (int i = 1; i < n; ++i) path += ".a";
  for (const auto& [name, text] : std::vector<std::pair<std::string, std::string>>{
           {"arrays.toml", arrays},
           {"tables.toml", tables},
           {"header.toml", "[" + path + "]\n"},
           {"dotted.toml", "[lr]\n" + path + " = 1\n"},
           {"inline.toml", "x = {" + path + " = 1}\n"}}) {
    auto file = dir.write(name, text);
    auto r = cli({"config", "check", file.string()});
    CHECK_MESSAGE(r.exit_code == 2, name << ": " << r.err);
    CHECK(contains(r.err, file.string() + ":"));
    CHECK_MESSAGE(contains(r.err, "deeper here than the limit of 128 levels"), r.err);
    CHECK(r.err.size() < 1000);
  }
  auto long_value = dir.write("long.toml", "[lr]\nrule = \"" + std::string(n, 'x') + "\"\n");
  auto l = cli({"config", "check", long_value.string()});
  CHECK(l.exit_code == 2);
  CHECK(contains(l.err, "... (100000 bytes)"));
  CHECK(l.err.size() < 2000);
  auto long_key =
      dir.write("key.toml", "[lr]\nrule = \"linear\"\n" + std::string(n, 'k') + " = 1\n");
  auto k = cli({"config", "check", long_key.string()});
  CHECK(k.exit_code == 2);
  CHECK(contains(k.err, "... (100000 bytes)"));
  CHECK(k.err.size() < 2000);
}

TEST_CASE("garbage input never crashes the CLI") {
  TempDir dir;
  std::string binary;
  for (int i = 0; i < 4096; ++i) binary.push_back(static_cast<char>((i * 7919) % 256));
  auto garbage = dir.write("garbage.toml", binary);
  auto deep = dir.write("deep.toml", "x = " + std::string(5000, '[') + "\n");
  auto huge =
      dir.write("huge.toml", "[lr]\nrule = \"fixture_good\"\nsteps = 99999999999999999999\n");
  for (const auto& file : {garbage, deep, huge, dir.path() / "missing.toml", dir.path()}) {
    auto r = cli({"--plugin-path", kGood, "config", "check", file.string()});
    CHECK_MESSAGE(r.exit_code == 2, file.string() << ": " << r.err);
    CHECK(contains(r.err, "ductile: error:"));
  }
  auto self = cli({"config", "check", DUCTILE_CLI});
  CHECK(self.exit_code == 2);
}

TEST_CASE("config and lengths files must be regular files within their cap") {
  // A FIFO is refused at once, not waited on; a device or an oversized file
  // is refused before anything is read.
  TempDir dir;
  const std::string fifo = (dir / "job.toml").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string json_fifo = (dir / "ds.json").string();
  REQUIRE(::mkfifo(json_fifo.c_str(), 0600) == 0);
  const std::string big = (dir / "big.toml").string();
  std::ofstream(big).put('#');
  fs::resize_file(big, (std::uintmax_t{16} << 20) + 1);  // sparse: no disk used
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::string not_regular = ", not a regular file; give a regular ";
  for (const auto& c : std::vector<Case>{
           {{"config", "check", fifo}, fifo + ": is a FIFO" + not_regular + "configuration file"},
           {{"config", "check", "/dev/zero"},
            "/dev/zero: is a character device" + not_regular + "configuration file"},
           {{"config", "check", big},
            big + ": is 16777217 bytes, over the 16 MiB cap of a configuration file"},
           {{"elastic", "--config", fifo},
            fifo + ": is a FIFO" + not_regular + "configuration file"},
           {{"elastic", "--config", "/dev/zero"},
            "/dev/zero: is a character device" + not_regular + "configuration file"},
           {{"pack", "--config", json_fifo},
            json_fifo + ": is a FIFO" + not_regular + "DeepSpeed config"},
           {{"pack", "--lengths", fifo, "--max-tokens", "8"},
            fifo + ": is a FIFO" + not_regular + "lengths file"},
           {{"pack", "--lengths", "/dev/zero", "--max-tokens", "8"},
            "/dev/zero: is a character device" + not_regular + "lengths file"},
       }) {
    CAPTURE(c.message);
    const auto r = cli(c.args);
    CHECK(r.exit_code == 2);
    CHECK(contains(r.err, c.message));
  }
}

TEST_CASE("bad command lines are user errors") {
  CHECK(cli({}).exit_code == 2);
  auto unknown = cli({"plugns"});
  CHECK(unknown.exit_code == 2);
  CHECK(contains(unknown.err, "unknown command 'plugns' (did you mean 'plugins'?)"));
  CHECK(cli({"plugins", "describe"}).exit_code == 2);
  CHECK(cli({"--log-level", "loud", "plugins", "list"}).exit_code == 2);
  auto env = cli({"plugins", "list"}, {"DUCTILE_LOG_LEVEL=chatty"});
  CHECK(env.exit_code == 2);
  CHECK(contains(env.err, "DUCTILE_LOG_LEVEL: invalid log level 'chatty'"));
}

TEST_CASE("the CLI finds its built-in plugin directory by itself") {
  auto r = cli({"plugins", "list", "--json"});
  REQUIRE(r.exit_code == 0);
  auto doc = nlohmann::json::parse(r.out);
  CHECK(fs::weakly_canonical(doc["search_path"].back().get<std::string>()) ==
        fs::weakly_canonical(DUCTILE_PLUGIN_DIR));
}

// The shared objects the dynamic loader opened for a command (LD_DEBUG=files
// on stderr: "file=NAME [0];  needed by ..." / "... dynamically loaded by").
std::vector<std::string> opened_objects(const std::string& ld_debug_output) {
  std::vector<std::string> out;
  std::istringstream lines(ld_debug_output);
  for (std::string line; std::getline(lines, line);) {
    auto at = line.find("file=");
    auto end = line.find(" [0]", at);
    if (at == std::string::npos || end == std::string::npos) continue;
    if (!contains(line, "needed by") && !contains(line, "dynamically loaded by")) continue;
    out.push_back(line.substr(at + 5, end - at - 5));
  }
  return out;
}

TEST_CASE("a command opens only the plugin it needs, and only `ductile agent` loads libcurl") {
  TempDir dir;
  auto config = dir.write("job.toml",
                          "[elasticity]\npolicy = \"v0.1\"\nmax_train_batch_size = 2000\n"
                          "micro_batch_sizes = [2, 4, 6]\nmin_gpus = 1\nmax_gpus = 64\n");
  auto r = cli({"elastic", "--config", config.string(), "--world-size", "8"}, {"LD_DEBUG=files"});
  REQUIRE(r.exit_code == 0);
  std::vector<std::string> plugins;
  for (const auto& file : opened_objects(r.err)) {
    CHECK_MESSAGE(!contains(file, "libcurl"), file);
    CHECK_MESSAGE(!contains(file, "libductile_agent"), file);
    if (contains(file, "libductile_") && contains(file, "/plugins/"))
      plugins.push_back(fs::path(file).filename().string());
  }
  CHECK(plugins == std::vector<std::string>{"libductile_elasticity_v0.1.so"});

  // `plugins list` opens every plugin; `agent` opens its library (and a bad
  // option is still a user error after loading it).
  auto list = cli({"plugins", "list"}, {"LD_DEBUG=files"});
  REQUIRE(list.exit_code == 0);
  std::size_t listed = 0;
  for (const auto& file : opened_objects(list.err)) listed += contains(file, "/plugins/");
  CHECK(listed >= 9);
  auto agent = cli({"agent", "--config", config.string(), "--rdzv", "nonsense", "--job-id", "j",
                    "--nproc-per-node", "1", "--", "true"},
                   {"LD_DEBUG=files"});
  CHECK(agent.exit_code == 2);
  CHECK(contains(agent.err, "--rdzv"));
  bool agent_loaded = false;
  for (const auto& file : opened_objects(agent.err))
    agent_loaded |= contains(file, "libductile_agent");
  CHECK(agent_loaded);
}

// The libraries an ELF file names as needed (readelf -d).
std::vector<std::string> needed_libraries(const fs::path& file) {
  auto r = run_process({"readelf", "-d", file.string()});
  REQUIRE(r.exit_code == 0);
  std::vector<std::string> names;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    auto open = line.find("(NEEDED)");
    auto start = line.find('[', open), end = line.find(']', start);
    if (open != std::string::npos && start != std::string::npos && end != std::string::npos)
      names.push_back(line.substr(start + 1, end - start - 1));
  }
  return names;
}

TEST_CASE("the loader never takes the CLI's libraries from the current directory") {
  // A copy of the planted library under the name of every library the CLI and
  // the plugin it loads need. CMake pads a build tree's run paths with empty
  // entries unless told otherwise, and the loader reads one as the current
  // directory, before the system's: it would take these.
  TempDir dir;
  auto needed = needed_libraries(DUCTILE_CLI);
  auto plugin = needed_libraries(fs::path(DUCTILE_PLUGIN_DIR) / "libductile_elasticity_v0.1.so");
  needed.insert(needed.end(), plugin.begin(), plugin.end());
  std::size_t planted = 0;
  for (const auto& name : needed) {
    if (name.starts_with("ld-linux") || fs::exists(dir / name)) continue;
    fs::copy_file(PLANTED_LIBRARY, dir / name);
    ++planted;
  }
  REQUIRE(planted >= 3);  // at least libc, libm and libgcc_s or libstdc++
  dir.write("job.toml",
            "[elasticity]\npolicy = \"v0.1\"\nmax_train_batch_size = 2000\n"
            "micro_batch_sizes = [2, 4, 6]\nmin_gpus = 1\nmax_gpus = 64\n");
  auto r = run_process({"/bin/sh", "-c",
                        "cd '" + dir.path().string() + "' && exec '" + DUCTILE_CLI +
                            "' elastic --config job.toml --world-size 8 --json"},
                       {"DUCTILE_PLUGIN_PATH="});
  CHECK_MESSAGE(r.exit_code == 0, r.err);
  CHECK(contains(r.out, "\"final_batch_size\":1680"));
  CHECK_FALSE(fs::exists(dir / "planted-library-was-loaded"));
}
