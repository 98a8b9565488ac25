// Elasticity configurations for the host: reading DeepSpeed JSON configs as
// well as ductile TOML, loading the selected ElasticityPolicy, and the
// scheduler contract (the resource scheduler and the job must agree on every
// setting that changes the elastic plan).
//
// The algorithms live in the elasticity plugins, and so do the schemas: the
// DeepSpeed keys of a block are typed by the selected policy's schema, found
// through a PluginRegistry (the runtime's, or one on
// PluginRegistry::default_search_path() for the overloads without one). What
// is DeepSpeed's alone lives here once: `version` -> policy name, the
// `enabled` switch and its default, and the scheduler contract's fields.
//
// Untrusted input: JSON nested deeper than 64 levels is refused before it is
// parsed, and values are quoted in messages as excerpts of at most 60
// characters.
//
// Errors: ductile::Error with type() "ElasticityConfigError" (ErrorKind::config)
// for an invalid or mismatching elasticity configuration; ConfigError (file:line:col)
// for an invalid TOML file; ErrorKind::not_found / plugin when the selected
// policy cannot be found or loaded.
// Threading: free functions without shared state; call from any thread.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <spdlog/logger.h>
#include <nlohmann/json.hpp>

#include "ductile/core/runtime.hpp"
#include "ductile/elasticity_policy.hpp"
#include "ductile/params.hpp"

namespace ductile::pipeline {

// What an elasticity configuration selects.
struct ElasticitySource {
  std::string policy;  // plugin name: "v0.1", "v0.2", "optimal", or a custom policy
  Params params;       // the policy's parameters as given (JSON) or validated (TOML)
  std::string origin;  // file name or environment variable it came from
  bool deepspeed_json = false;
  std::vector<std::string> warnings;  // e.g. keys DeepSpeed would ignore
};

// The policy a DeepSpeed elasticity `version` selects: 0.1 -> "v0.1", 0.2 ->
// "v0.2" (DeepSpeed's rules: newer than 0.2 is refused as too new, anything
// else as unknown). `written` is the version's text (a JSON or TOML number
// as written, or a string), parsed here and nowhere else: all of it must be
// a number. `shown` is the value as the user wrote it, for messages. Throws
// Error typed ElasticityConfigError.
std::string policy_for_elasticity_version(std::string_view written, std::string_view shown,
                                          std::string_view origin);

// Maps a DeepSpeed JSON config (a whole config holding an "elasticity" block,
// or the block itself) to a policy and parameters, with DeepSpeed's keys and
// defaults: `enabled` defaults to false, `version` to 0.2 (0.1 selects "v0.1",
// 0.2 "v0.2"). ductile also reads an optional "policy" key naming any policy.
// Every other key is typed by the policy's schema; a key the policy does not
// have is dropped with a warning (in `warnings`). Throws Error typed
// ElasticityConfigError for invalid or too deeply nested JSON, a missing
// block, a value of the wrong type (naming key and value), or an unknown or
// too new version; the registry's Error (not_found, plugin) when the policy
// is not installed. Range checks are left to the policy's schema and checks.
ElasticitySource elasticity_from_deepspeed_json(std::string_view json_text,
                                                std::string_view origin);
ElasticitySource elasticity_from_deepspeed_json(std::string_view json_text, std::string_view origin,
                                                const core::PluginRegistry& registry);

// Reads the elasticity settings of a TOML text (an [elasticity] table, or
// top-level keys): `policy` or `version` select the policy (neither: "v0.2",
// DeepSpeed's default), the other keys
// of its schema are typed by it, keys outside it are not part of the
// contract and are skipped. Used for the scheduler's copy of the
// configuration. Throws Error typed ElasticityConfigError.
ElasticitySource elasticity_from_toml_text(std::string_view toml_text, std::string_view origin);
ElasticitySource elasticity_from_toml_text(std::string_view toml_text, std::string_view origin,
                                           const core::PluginRegistry& registry);

// The result as one JSON object with every field of ElasticityResult under
// its own name (absent optionals as null): what `ductile elastic --json`
// prints and what ductile.elasticity's results are built from.
nlohmann::json to_json(const ElasticityResult& result);

// DeepSpeed's non-elastic batch keys of a whole config, typed: absent or
// null is nullopt; "auto" (Hugging Face's placeholder, filled in before
// DeepSpeed sees the config) is remembered in `automatic`.
struct DeepSpeedBatchKeys {
  std::optional<std::int64_t> train_batch_size;
  std::optional<std::int64_t> micro_batch_per_gpu;  // train_micro_batch_size_per_gpu
  std::optional<std::int64_t> gradient_accumulation_steps;
  std::vector<std::string> given;      // the keys present, null included (DeepSpeed's `in`)
  std::vector<std::string> automatic;  // the keys given as "auto"
};

// What DeepSpeed's DeepSpeedConfig makes of a config's "elasticity" block
// beside its batch keys.
struct DeepSpeedElasticityMode {
  bool has_block = false;  // the config has an "elasticity" object
  bool elastic = false;    // ... with enabled = true: the elastic plan sets the batch
  DeepSpeedBatchKeys batch;
  std::vector<std::string> warnings;  // batch keys the elastic plan overrides
};

// DeepSpeedConfig's elasticity rules that hold for every world size, on a
// whole DeepSpeed config (`root` a JSON object; a bare elasticity block, as
// the scheduler passes it, has no batch keys and is returned as elastic or
// not by its `enabled`):
// - an enabled block beside train_batch_size, train_micro_batch_size_per_gpu
//   or gradient_accumulation_steps (even null) is refused unless the block
//   sets ignore_non_elastic_batch_info = true (then they are overridden, a
//   warning each);
// - a disabled block (enabled false or absent) is a non-elastic job: its
//   batch comes from those keys, which must be integers >= 1 (or "auto"),
//   train_batch_size or train_micro_batch_size_per_gpu given, and together
//   valid for at least one world size (train_batch_size a multiple of the
//   others' product).
// Throws Error typed ElasticityConfigError naming `origin`, the keys, their
// values and what would be valid. The policy's own checks (model_parallel_size,
// num_gpus_per_node >= 1, ...) stay with the policy.
DeepSpeedElasticityMode deepspeed_elasticity_mode(const nlohmann::json& root,
                                                  std::string_view origin);
// The same for a config's text (parsed as every DeepSpeed JSON is).
DeepSpeedElasticityMode parse_deepspeed_elasticity_mode(std::string_view json_text,
                                                        std::string_view origin);

// The batch DeepSpeedConfig derives from non-elastic batch keys for
// `world_size` GPUs (data-parallel ranks): the missing keys computed as
// DeepSpeed does (floor divisions; gradient accumulation 1 when only a batch
// or a micro batch is given), then train_batch_size = micro x accumulation x
// world size required. world_size 0: no world size, the result carries
// train_batch_size alone (or nothing when it depends on the world size).
// The result has no valid_gpus (any world size satisfying that product is
// valid). Throws ElasticityConfigError for keys DeepSpeed refuses whatever
// the world size (none of train_batch_size, train_micro_batch_size_per_gpu;
// "auto"), ElasticityIncompatibleWorldSize when they do not fit this one,
// both naming `origin`, keys and values.
ElasticityResult non_elastic_plan(const DeepSpeedBatchKeys& keys, std::int64_t world_size,
                                  std::string_view origin);

// The non-elastic plan as JSON (what `ductile elastic --json` prints for a
// disabled block): "elastic": false, the result's fields that apply, and
// the batch keys as given.
nlohmann::json non_elastic_json(const DeepSpeedBatchKeys& keys, const ElasticityResult& result);

// A policy created from its settings: `effective_params` are its parameters
// with schema defaults filled in.
struct ElasticityPolicySetup {
  std::shared_ptr<ElasticityPolicy> policy;
  ElasticitySource source;
  Params effective_params;
};

// A DeepSpeed JSON text's policy, created by `runtime` (whose registry also
// types the keys): a policy named by "policy" keeps only its schema's keys,
// the others becoming warnings in `source.warnings` (not logged here), and
// `enabled` = false is refused unless the policy itself takes `enabled`.
// Throws as elasticity_from_deepspeed_json does, and the policy's errors.
// Threading: as runtime.create (callers sharing a runtime serialize).
ElasticityPolicySetup elasticity_policy_from_deepspeed_json(core::Runtime& runtime,
                                                            std::string_view json_text,
                                                            std::string_view origin);

// The policy of `runtime`'s [elasticity] section. Throws Error(config) typed
// ElasticityConfigError when the configuration has none.
ElasticityPolicySetup elasticity_policy_from_runtime(core::Runtime& runtime);

// A policy ready to use, with the runtime that keeps its plugin registry
// alive.
struct LoadedElasticity {
  core::Runtime runtime;
  std::shared_ptr<ElasticityPolicy> policy;
  ElasticitySource source;
  Params effective_params;
};

// Loads `file`, TOML or DeepSpeed JSON (see is_json_config), and creates its
// policy. Throws as described at the top, and Error(config) typed
// ElasticityConfigError when a TOML file has no [elasticity] section.
LoadedElasticity load_elasticity(const std::filesystem::path& file,
                                 core::RuntimeOptions options = {});
// The same for the text of `file` that the caller has read already (with
// core::read_user_file).
LoadedElasticity load_elasticity(const std::filesystem::path& file, std::string_view text,
                                 core::RuntimeOptions options = {});

// The same for a runtime already loaded from a TOML configuration.
LoadedElasticity elasticity_from_runtime(core::Runtime runtime);

// The settings that change an elastic plan: the policy and its effective
// parameters (schema defaults filled in). The scheduler contract compares
// every key of the policy's schema except those it marks param_local.
struct ElasticityFingerprint {
  std::string policy;
  Params params;
};
ElasticityFingerprint fingerprint_of(const std::string& policy, const Params& params);

// Names of the environment variables of the scheduler contract.
inline constexpr const char* kDeepSpeedElasticityConfigEnv = "DEEPSPEED_ELASTICITY_CONFIG";
inline constexpr const char* kDuctileElasticityConfigEnv = "DUCTILE_ELASTICITY_CONFIG";

// The scheduler contract. When DEEPSPEED_ELASTICITY_CONFIG (JSON: the
// elasticity block or a whole config) or DUCTILE_ELASTICITY_CONFIG (TOML or
// JSON) is set, compares every field of the fingerprint with the runtime's;
// any difference is an Error typed ElasticityConfigError naming each field
// with the scheduler's and the runtime's value. When neither is set (an empty
// value counts as unset), logs a
// warning on `logger` (may be null) and returns false; true when checked.
// The scheduler's configuration is typed by `registry`'s policies (the
// overload without one uses the default search path).
bool check_scheduler_elasticity(const ElasticityFingerprint& runtime,
                                const std::shared_ptr<spdlog::logger>& logger);
bool check_scheduler_elasticity(const ElasticityFingerprint& runtime,
                                const std::shared_ptr<spdlog::logger>& logger,
                                const core::PluginRegistry& registry);

}  // namespace ductile::pipeline
