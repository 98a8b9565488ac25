// The elasticity policy of a job, as the agent uses it: the valid GPU counts,
// the batch plan for one world size, the scale-up delay (min_time), and the
// values handed to workers and compared between agents.
//
// Ownership: a JobPolicy shares the loaded policy (and the plugin registry
// that keeps its library loaded) between copies.
// Threading: const calls may be made from any thread.
// Errors: load() throws ductile::Error (exit code 2 in the CLI) for a
// missing, unreadable or invalid configuration, naming the file and key.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "ductile/core/runtime.hpp"

namespace ductile::agent {

// What the workers of one world size run with.
struct BatchPlan {
  std::int64_t world_size = 0;
  std::int64_t global_batch = 0;
  std::int64_t micro_batch = 0;
  std::int64_t gradient_accumulation_steps = 0;
};

class JobPolicy {
 public:
  // Loads a ductile TOML configuration with an [elasticity] section or a
  // DeepSpeed JSON config with an "elasticity" block. `world_size`: the
  // job's, for a policy that plans for one world size only (v0.2: the
  // agent's --nnodes x --nproc-per-node); 0: none.
  static JobPolicy load(const std::filesystem::path& config, core::RuntimeOptions options = {},
                        std::int64_t world_size = 0);
  // No configuration (torchrun's semantics): every node count from
  // `min_nodes` to `max_nodes` is valid; no batch plan, no min_time.
  static JobPolicy any_size(std::int64_t nproc_per_node, std::int64_t min_nodes,
                            std::int64_t max_nodes);

  // False for any_size(): workers get no DEEPSPEED_ELASTICITY_CONFIG and no
  // DUCTILE_* batch plan.
  bool has_config() const;

  const std::string& policy_name() const;
  const std::string& origin() const;  // the file it came from
  // Sorted ascending; may be empty.
  const std::vector<std::int64_t>& valid_gpus() const;
  // Throws ductile::Error when the policy rejects `world_size`. Without a
  // configuration only world_size is set.
  BatchPlan plan(std::int64_t world_size) const;
  // The configuration's min_time (minutes) as a duration; 0 when absent.
  std::chrono::milliseconds min_time() const;
  // The settings that must be the same on every agent of a job, as a JSON
  // object text: policy and its effective parameters.
  std::string settings_json() const;
  // The value of DEEPSPEED_ELASTICITY_CONFIG for workers: the elasticity
  // block itself (not wrapped), which pipeline::check_scheduler_elasticity and
  // DeepSpeed's ensure_immutable_elastic_config() accept as this job's.
  std::string scheduler_config_json() const;

 private:
  struct Impl;
  explicit JobPolicy(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace ductile::agent
