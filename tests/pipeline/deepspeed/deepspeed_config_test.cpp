// pipeline::deepspeed_sections' reading of what configures the training
// framework (precision and fp16 loss scaling, gradient clipping, the
// optimizer), and pipeline::deepspeed_offload_optimizer: an offload object
// given apart from a config, checked as the one inside zero_optimization.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "ductile/core/config.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/pipeline/deepspeed_config.hpp"

using namespace ductile;

namespace {

const core::Runtime& plugins() {
  static const core::Runtime runtime = core::Runtime::from_string("", "deepspeed config test");
  return runtime;
}

pipeline::DeepSpeedSections mapped(const std::string& json,
                                   std::vector<std::string>* warnings = nullptr) {
  auto sections = pipeline::deepspeed_sections(json, "ds.json", {}, plugins().registry(),
                                               {.read_training = true});
  if (warnings) *warnings = sections.warnings;
  return sections;
}

std::string message_of(const std::string& json) {
  try {
    mapped(json);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool any_contains(const std::vector<std::string>& lines, const std::string& part) {
  for (const auto& line : lines)
    if (line.find(part) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("a config without precision, clipping or optimizer keeps the framework's defaults") {
  const auto t = mapped(R"({"train_batch_size": 8})").training;
  CHECK(t.precision == "fp32");
  CHECK_FALSE(t.gradient_clipping);
  CHECK_FALSE(t.optimizer);
}

TEST_CASE("bf16, fp16 and their loss scaling are read with their types checked") {
  CHECK(mapped(R"({"bf16": {"enabled": true}})").training.precision == "bf16");
  CHECK(mapped(R"({"bfloat16": {"enabled": true}})").training.precision == "bf16");
  CHECK(mapped(R"({"bf16": {"enabled": "auto"}})").training.precision == "fp32");
  const auto t = mapped(R"({"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12,
                                     "loss_scale_window": 50, "hysteresis": 3,
                                     "min_loss_scale": 0.5}})")
                     .training;
  CHECK(t.precision == "fp16");
  CHECK(t.loss_scale == 0.0);
  CHECK(t.initial_scale_power == 12);
  CHECK(t.loss_scale_window == 50);
  CHECK(t.hysteresis == 3);
  CHECK(t.min_loss_scale == 0.5);
  CHECK(mapped(R"({"fp16": {"enabled": true, "loss_scale": 128}})").training.loss_scale == 128.0);
  // Hugging Face's "auto" keeps the default.
  CHECK(mapped(R"({"fp16": {"enabled": true, "initial_scale_power": "auto"}})")
            .training.initial_scale_power == 16);

  CHECK(message_of(R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})") ==
        "ds.json: bf16.enabled and fp16.enabled are both true; enable one of them");
  CHECK(message_of(R"({"fp16": {"enabled": "yes"}})") ==
        "ds.json: fp16.enabled = \"yes\"; valid: true or false");
  CHECK(message_of(R"({"fp16": {"enabled": true, "loss_scale": -1}})") ==
        "ds.json: fp16.loss_scale = -1; valid: 0 (dynamic scaling) or a positive number");
  CHECK(message_of(R"({"fp16": {"enabled": true, "initial_scale_power": 16.5}})") ==
        "ds.json: fp16.initial_scale_power = 16.5; valid: an integer in [0, 64]");
  CHECK(message_of(R"({"fp16": {"enabled": true, "hysteresis": 0}})") ==
        "ds.json: fp16.hysteresis = 0; valid: an integer >= 1");
  CHECK(message_of(R"({"fp16": 3})") == "ds.json: fp16 must be an object, got 3");

  std::vector<std::string> warnings;
  mapped(R"({"fp16": {"enabled": true, "auto_cast": true}})", &warnings);
  CHECK(any_contains(warnings, "ds.json: fp16.auto_cast is accepted but ignored"));
}

TEST_CASE("gradient_clipping: a number >= 0, 0 meaning none") {
  CHECK(*mapped(R"({"gradient_clipping": 1.5})").training.gradient_clipping == 1.5);
  CHECK_FALSE(mapped(R"({"gradient_clipping": 0})").training.gradient_clipping);
  CHECK_FALSE(mapped(R"({"gradient_clipping": "auto"})").training.gradient_clipping);
  CHECK(message_of(R"({"gradient_clipping": -1})") ==
        "ds.json: gradient_clipping = -1; valid: a number >= 0 (0: no clipping)");
  CHECK(message_of(R"({"gradient_clipping": true})") ==
        "ds.json: gradient_clipping = true; valid: a number >= 0 (0: no clipping)");
}

TEST_CASE("optimizer: Adam or AdamW, its parameters typed, DeepSpeed's adam_w_mode honoured") {
  const auto adamw = mapped(R"({"optimizer": {"type": "AdamW", "params": {
      "lr": 0.002, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1, "torch_adam": true}}})")
                         .training.optimizer;
  REQUIRE(adamw);
  CHECK(adamw->type == "AdamW");
  CHECK(adamw->decoupled_weight_decay);
  CHECK(*adamw->lr == 0.002);
  CHECK((*adamw->betas)[0] == 0.8);
  CHECK((*adamw->betas)[1] == 0.99);
  CHECK(*adamw->eps == 1e-6);
  CHECK(*adamw->weight_decay == 0.1);
  // DeepSpeed's Adam decouples its weight decay unless adam_w_mode is false.
  CHECK(mapped(R"({"optimizer": {"type": "adam"}})").training.optimizer->decoupled_weight_decay);
  const auto adam =
      mapped(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false, "lr": "auto"}}})")
          .training.optimizer;
  CHECK_FALSE(adam->decoupled_weight_decay);
  CHECK_FALSE(adam->lr);
  // No weight decay unless given, as DeepSpeed's FusedAdam and CPU Adam;
  // with torch_adam torch's default (AdamW's 0.01) is kept.
  CHECK(*adam->weight_decay == 0.0);
  CHECK_FALSE(mapped(R"({"optimizer": {"type": "AdamW", "params": {"torch_adam": true}}})")
                  .training.optimizer->weight_decay);

  CHECK(message_of(R"({"optimizer": {"type": "SGD"}})") ==
        "ds.json: optimizer.type = \"SGD\"; valid: \"Adam\", \"AdamW\"");
  CHECK(message_of(R"({"optimizer": {"params": {}}})") ==
        "ds.json: optimizer.type = (missing); valid: \"Adam\", \"AdamW\"");
  CHECK(message_of(R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}})") ==
        "ds.json: optimizer.params.betas = [0.9]; valid: [beta1, beta2], each in [0, 1)");
  CHECK(message_of(R"({"optimizer": {"type": "Adam", "params": {"lr": -1}}})") ==
        "ds.json: optimizer.params.lr = -1; valid: a number >= 0");
  std::vector<std::string> warnings;
  mapped(R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})", &warnings);
  CHECK(any_contains(warnings, "ds.json: optimizer.params.amsgrad is accepted but ignored"));
}

TEST_CASE("without read_training, the framework's keys are not looked at") {
  // An elastic job's DeepSpeed config may name any optimizer DeepSpeed has.
  auto sections = pipeline::deepspeed_sections(
      R"({"optimizer": {"type": "Lamb"}, "fp16": {"enabled": true, "hysteresis": 0}})", "ds.json",
      {}, plugins().registry());
  CHECK(sections.training.precision == "fp32");
  CHECK_FALSE(sections.training.optimizer);
  CHECK(sections.warnings.empty());
}

TEST_CASE("an offload_optimizer object given alone is checked as inside zero_optimization") {
  std::vector<std::string> warnings;
  const Params keys = pipeline::deepspeed_offload_optimizer(
      R"({"device": "cpu", "pin_memory": false, "ratio": 0.5, "buffer_count": 4})",
      "zero3.initialize", plugins().registry(), &warnings);
  CHECK(keys.get_string("offload_optimizer") == "cpu");
  CHECK(keys.get_double("offload_ratio") == 0.5);
  CHECK_FALSE(keys.get_bool("offload_pin_memory"));
  CHECK(any_contains(warnings, "zero3.initialize: offload_optimizer.buffer_count is accepted"));

  const Params off = pipeline::deepspeed_offload_optimizer(
      R"({"device": "none"})", "zero3.initialize", plugins().registry(), nullptr);
  CHECK(off.get_string("offload_optimizer") == "none");

  auto message = [](const std::string& json) -> std::string {
    try {
      pipeline::deepspeed_offload_optimizer(json, "zero3.initialize", plugins().registry(),
                                            nullptr);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  CHECK(message(R"({"device": "gpu"})") ==
        "zero3.initialize: offload_optimizer.device = \"gpu\"; valid: \"cpu\", \"nvme\", "
        "\"none\"");
  CHECK(message(R"({"ratio": 2})")
            .find("zero3.initialize: offload_optimizer.ratio = 2.0 is out "
                  "of range") != std::string::npos);
  CHECK(message("[1]") == "zero3.initialize: offload_optimizer must be an object, got [1]");
}

TEST_CASE("a translated key's plugin check names the file and the user's DeepSpeed key") {
  // The coordinator's own range check runs while the config is read, even
  // where the caller asked for no plugin checks, so that the problem is
  // named by the user's key rather than the ductile key it was mapped to.
  const std::string json = R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "stage3_prefetch_bucket_size": 3.7e19}})";
  std::string message;
  try {
    pipeline::runtime_from_deepspeed(plugins(), json, "ds.json", {}, /*plugin_checks=*/false);
  } catch (const std::exception& e) {
    message = e.what();
  }
  CHECK_MESSAGE(message.find("ds.json: zero_optimization.stage3_prefetch_bucket_size = 3.7e+19") !=
                    std::string::npos,
                message);
  CHECK_MESSAGE(message.find("from 0 to 9e18") != std::string::npos, message);
  CHECK_MESSAGE(message.find("[zero]") == std::string::npos, message);
}

TEST_CASE("a DeepSpeed integer past 64 bits is out of range, not of another type") {
  // A translated key (Mapping::set) ...
  const std::string buffers = message_of(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/tmp",
                        "buffer_count": 9223372036854775808}}})");
  CHECK_MESSAGE(buffers.find("ds.json: zero_optimization.offload_param.buffer_count = "
                             "9223372036854775808 is past the largest integer (2^63-1); valid: "
                             "an integer from") != std::string::npos,
                buffers);
  // ... and the elasticity block, an element of a list included.
  const std::string gpus = message_of(R"({"elasticity": {"enabled": true,
      "max_train_batch_size": 100, "micro_batch_sizes": [2], "max_gpus": 1e20}})");
  CHECK_MESSAGE(gpus.find("ds.json: elasticity.max_gpus = 1e+20 is past the largest integer") !=
                    std::string::npos,
                gpus);
  const std::string micro = message_of(R"({"elasticity": {"enabled": true,
      "max_train_batch_size": 100, "micro_batch_sizes": [2, -1e19]}})");
  CHECK_MESSAGE(micro.find("ds.json: elasticity.micro_batch_sizes contains -1e+19, "
                           "past the smallest integer (-2^63)") != std::string::npos,
                micro);
}

TEST_CASE("snapshot: interval and replicas set [zero] snapshot_interval and snapshot_replicas") {
  auto zero_keys = [](const std::string& json) {
    auto sections = pipeline::deepspeed_sections(json, "ds.json", {}, plugins().registry(),
                                                 {.read_training = true});
    const auto config = core::Config::validate(sections.document, plugins().registry());
    const core::PluginSection* zero = config.section(PluginKind::zero);
    REQUIRE(zero != nullptr);
    return zero->host_params;
  };
  const Params defaults = zero_keys(R"({"zero_optimization": {"stage": 3}})");
  CHECK(defaults.get_int("snapshot_interval") == 1);
  CHECK(defaults.get_int("snapshot_replicas") == 1);
  std::vector<std::string> warnings;
  const std::string config =
      R"({"zero_optimization": {"stage": 3}, "snapshot": {"interval": 5, "replicas": 2}})";
  mapped(config, &warnings);
  CHECK_FALSE(any_contains(warnings, "snapshot"));  // a key ductile acts on
  const Params keys = zero_keys(config);
  CHECK(keys.get_int("snapshot_interval") == 5);
  CHECK(keys.get_int("snapshot_replicas") == 2);
  CHECK(zero_keys(R"({"zero_optimization": {"stage": 3}, "snapshot": {"interval": 0}})")
            .get_int("snapshot_interval") == 0);

  CHECK(message_of(R"({"zero_optimization": {"stage": 3}, "snapshot": {"every": 5}})") ==
        "ds.json: snapshot.every is not a key of snapshot; valid: interval, replicas");
  // Checked without a stage-3 section too: a misspelt key is never dropped.
  CHECK(message_of(R"({"snapshot": {"replica": 1}})") ==
        "ds.json: snapshot.replica is not a key of snapshot; valid: interval, replicas");
  CHECK(message_of(R"({"snapshot": 3})") == "ds.json: snapshot must be an object, got 3");
  CHECK(message_of(R"({"zero_optimization": {"stage": 3}, "snapshot": {"interval": "x"}})")
            .find("snapshot.interval must be an integer") != std::string::npos);
}

TEST_CASE("[zero] snapshot_interval and snapshot_replicas: integers >= 0") {
  auto message = [](const std::string& toml) -> std::string {
    try {
      core::Runtime::from_string(toml, "job.toml");
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  const std::string zero = "[zero]\ncoordinator = \"partitioned\"\n";
  CHECK(message(zero + "snapshot_interval = 0\nsnapshot_replicas = 3\n").empty());
  const std::string negative = message(zero + "snapshot_interval = -1\n");
  CHECK(negative.find("snapshot_interval") != std::string::npos);
  CHECK(negative.find("-1") != std::string::npos);
  CHECK(message(zero + "snapshot_replicas = 1.5\n").find("snapshot_replicas") != std::string::npos);
}

TEST_CASE("check_training reads the training keys by read_training's rules") {
  auto message = [](const std::string& json, pipeline::DeepSpeedOptions options) {
    try {
      pipeline::deepspeed_sections(json, "ds.json", {}, plugins().registry(), options);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  for (const char* json :
       {R"({"train_batch_size": -8})", R"({"train_batch_size": 2147483648})",
        R"({"gradient_accumulation_steps": 18446744073709551616})",
        R"({"train_micro_batch_size_per_gpu": true})", R"({"train_micro_batch_size_per_gpu": 2.5})",
        R"({"train_micro_batch_size_per_gpu": "2"})", R"({"steps_per_print": 1000000001})",
        R"({"gradient_clipping": -1})", R"({"fp16": {"enabled": true, "hysteresis": 0}})",
        R"({"optimizer": {"type": "Adam", "params": {"betas": [2, 0]}}})"}) {
    const std::string trained = message(json, {.read_training = true});
    CHECK_MESSAGE(!trained.empty(), json);
    CHECK(message(json, {.check_training = true}) == trained);
  }
  // The batch keys are read once when the dynamic batching block reads them
  // too: one message, not two.
  const std::string twice = message(R"({"train_batch_size": 0, "data_efficiency": {"data_sampling":
                 {"dynamic_batching": {"enabled": true, "max_tokens": 64}}}})",
                                    {.check_training = true, .read_batching = true});
  CHECK(twice == "ds.json: train_batch_size = 0; valid: an integer from 1 to 2147483647");
  // The largest values are taken.
  const auto t = pipeline::deepspeed_sections(
                     R"({"train_batch_size": 2147483647, "steps_per_print": 1000000000})",
                     "ds.json", {}, plugins().registry(), {.check_training = true})
                     .training;
  CHECK(t.train_batch_size == 2147483647);
  CHECK(t.steps_per_print == 1000000000);
  // What only ductile's engine refuses is a warning there, naming it.
  std::vector<std::string> warnings =
      pipeline::deepspeed_sections(R"({"optimizer": {"type": "Lamb"}, "amp": {"enabled": true}})",
                                   "ds.json", {}, plugins().registry(), {.check_training = true})
          .warnings;
  CHECK(any_contains(warnings,
                     "ds.json: optimizer.type = \"Lamb\": ductile's ZeRO-3 engine "
                     "refuses it"));
  CHECK(any_contains(warnings,
                     "ds.json: amp = {\"enabled\":true}: ductile's ZeRO-3 engine "
                     "refuses it"));
  CHECK(message(R"({"optimizer": {"type": "Lamb"}})", {.read_training = true}) ==
        "ds.json: optimizer.type = \"Lamb\"; valid: \"Adam\", \"AdamW\"");
}

TEST_CASE("[zero] log_interval and steps_per_print share one bound") {
  auto message = [](const std::string& toml) -> std::string {
    try {
      core::Runtime::from_string(toml, "job.toml");
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  const std::string zero = "[zero]\ncoordinator = \"partitioned\"\n";
  CHECK(
      message(zero + "log_interval = " + std::to_string(pipeline::kMaxLogInterval) + "\n").empty());
  CHECK(message(zero + "log_interval = " + std::to_string(pipeline::kMaxLogInterval + 1) + "\n")
            .find("[zero] log_interval = 1000000001 is out of range: must be between 0 and "
                  "1000000000") != std::string::npos);
  CHECK(message_of(R"({"steps_per_print": 1000000001})") ==
        "ds.json: steps_per_print = 1000000001; valid: an integer from 1 to 1000000000");
}
