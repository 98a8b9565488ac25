// The ElasticityPolicy interface (plugin kind PluginKind::elasticity): given
// an elastic training configuration (the plugin's parameters), decide the
// global train batch size and the GPU counts the job may run on without that
// batch size changing, and, for one world size, the micro batch and gradient
// accumulation steps.
//
// Built-in policies: "v0.1" and "v0.2" (DeepSpeed's elasticity, integer for
// integer) and "optimal" (searches every batch size up to the cap). To write
// your own, derive from ElasticityPolicy, implement compute() and export the
// class with DUCTILE_PLUGIN (see samples/custom_policy/).
//
// Ownership: the host owns each policy through a shared_ptr (see plugin.hpp).
// Requests and results are plain values; nothing refers back into the plugin.
// Threading: compute() is const and must be safe to call concurrently from
// several threads (the built-in policies keep no mutable state).
// Errors: compute() throws ductile::Error with type() set to one of the names
// below, which machine-readable outputs (`ductile elastic --json`) report:
//   kElasticityConfigError            ErrorKind::config: the parameters are
//       invalid (message names the key, the bad value and what is valid);
//   kElasticityIncompatibleWorldSize  ErrorKind::incompatible: the requested
//       world size is not one the configuration supports;
//   kElasticityError                  ErrorKind::incompatible when no usable
//       answer exists (for example no GPU count in [min_gpus, max_gpus] can be
//       valid), invalid_argument for a malformed request (negative world
//       size, a micro batch asked for without a world size), config for
//       settings DeepSpeed reports this way (v0.2: num_gpus_per_node not a
//       multiple of model_parallel_size).
// A policy never returns silently wrong numbers: a result that differs from
// what the configuration promises (the v0.2 fallback) sets `fallback` and
// says why in `warnings`.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ductile/plugin.hpp"

namespace ductile {

inline constexpr const char* kElasticityConfigError = "ElasticityConfigError";
inline constexpr const char* kElasticityIncompatibleWorldSize = "ElasticityIncompatibleWorldSize";
inline constexpr const char* kElasticityError = "ElasticityError";

// What the caller asks for.
struct ElasticityRequest {
  // The total number of GPUs of the job (model-parallel ranks included);
  // 0 = not given. With a world size the result also carries the micro batch
  // and gradient accumulation steps for it, and a world size that the
  // configuration does not support is an error (except where a policy
  // documents a fallback, as v0.2 does).
  std::int64_t world_size = 0;
  // DeepSpeed's `return_microbatch`: the caller needs a micro batch size.
  // Asking for one without a world size is an ElasticityError.
  bool require_micro_batch = false;
};

// The answer. Lists are sorted ascending, without duplicates.
struct ElasticityResult {
  // The global train batch size (micro batch x gradient accumulation steps x
  // data-parallel size), identical for every GPU count in valid_gpus.
  std::int64_t final_batch_size = 0;
  // The valid GPU counts (world sizes). For the DeepSpeed policies this is
  // exactly DeepSpeed's list; it may be empty when nothing in
  // [min_gpus, max_gpus] is valid (a warning says so).
  std::vector<std::int64_t> valid_gpus;
  // The same counts as data-parallel sizes (GPU count / model_parallel_size).
  std::vector<std::int64_t> valid_dp_sizes;
  std::int64_t model_parallel_size = 1;
  std::int64_t num_gpus_per_node = 1;

  // Set only when the request gave a world size.
  std::optional<std::int64_t> world_size;
  std::optional<std::int64_t> data_parallel_size;  // world_size / model_parallel_size
  std::optional<std::int64_t> micro_batch_size;
  std::optional<std::int64_t> gradient_accumulation_steps;

  // True when the batch size was changed to suit this world size only (the
  // v0.2 fallback for a world size outside valid_gpus): the global batch is
  // then not the one of the other GPU counts.
  bool fallback = false;
  // Human-readable remarks (fallbacks, empty lists). Also logged.
  std::vector<std::string> warnings;
};

class DUCTILE_SDK_API ElasticityPolicy : public Plugin {
 public:
  static constexpr PluginKind kind = PluginKind::elasticity;

  // Computes the elastic plan for the policy's parameters and `request`.
  // Deterministic: the same parameters and request give the same result.
  // Throws ductile::Error as described at the top of this file; never
  // returns a partially filled result.
  virtual ElasticityResult compute(const ElasticityRequest& request) const = 0;
};

}  // namespace ductile
