// The only file of the agent that uses the host's elasticity configuration
// API (load_elasticity, fingerprint_of): an adapter from it to JobPolicy.
#include "ductile/agent/job_policy.hpp"

#include <algorithm>
#include <optional>
#include <variant>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ductile/pipeline/elasticity.hpp"

namespace ductile::agent {

using json = nlohmann::json;

struct JobPolicy::Impl {
  std::optional<pipeline::LoadedElasticity> loaded;  // empty: any_size()
  std::vector<std::int64_t> valid_gpus;
  std::int64_t final_batch = 0;
  std::string name, origin;
};

JobPolicy JobPolicy::load(const std::filesystem::path& config, core::RuntimeOptions options,
                          std::int64_t world_size) {
  auto impl = std::make_shared<Impl>();
  impl->loaded = pipeline::load_elasticity(config, std::move(options));
  // The other policies plan for every valid size: a world size given to
  // them would be checked against it instead.
  ElasticityRequest request{};
  if (impl->loaded->source.policy == "v0.2") request.world_size = world_size;
  auto result = impl->loaded->policy->compute(request);
  impl->valid_gpus = result.valid_gpus;
  impl->final_batch = result.final_batch_size;
  impl->name = impl->loaded->source.policy;
  impl->origin = impl->loaded->source.origin;
  return JobPolicy(std::move(impl));
}

JobPolicy JobPolicy::any_size(std::int64_t nproc_per_node, std::int64_t min_nodes,
                              std::int64_t max_nodes) {
  auto impl = std::make_shared<Impl>();
  for (std::int64_t n = std::max<std::int64_t>(min_nodes, 1); n <= max_nodes; ++n)
    impl->valid_gpus.push_back(n * nproc_per_node);
  impl->name = "none";
  impl->origin = "no --config: any node count from --nnodes";
  return JobPolicy(std::move(impl));
}

bool JobPolicy::has_config() const {
  return impl_->loaded.has_value();
}

const std::string& JobPolicy::policy_name() const {
  return impl_->name;
}
const std::string& JobPolicy::origin() const {
  return impl_->origin;
}
const std::vector<std::int64_t>& JobPolicy::valid_gpus() const {
  return impl_->valid_gpus;
}

BatchPlan JobPolicy::plan(std::int64_t world_size) const {
  if (!impl_->loaded) return BatchPlan{world_size, 0, 0, 0};
  auto r = impl_->loaded->policy->compute(ElasticityRequest{world_size, true});
  return BatchPlan{world_size, r.final_batch_size, r.micro_batch_size.value_or(0),
                   r.gradient_accumulation_steps.value_or(0)};
}

std::chrono::milliseconds JobPolicy::min_time() const {
  if (!impl_->loaded) return std::chrono::milliseconds(0);
  return std::chrono::minutes(impl_->loaded->effective_params.get_int_or("min_time", 0));
}

namespace {

// A policy's parameters as one JSON object, each under its schema's name.
json params_json(const Params& params) {
  json out = json::object();
  for (const auto& [key, value] : params.values())
    std::visit([&, &key = key](const auto& v) { out[key] = v; }, value);
  return out;
}

}  // namespace

std::string JobPolicy::settings_json() const {
  const json params = impl_->loaded ? params_json(impl_->loaded->effective_params) : json::object();
  return json{{"policy", policy_name()}, {"params", params}}.dump();
}

std::string JobPolicy::scheduler_config_json() const {
  if (!impl_->loaded) return "";
  const auto& loaded = *impl_->loaded;
  const std::string& policy = loaded.source.policy;
  // Every parameter of the policy, as its schema names it: DeepSpeed reads
  // its own keys and ignores the others.
  json block = params_json(loaded.effective_params);
  block["enabled"] = true;
  // DeepSpeed knows its policies by version; other policies by name.
  if (policy == "v0.1")
    block["version"] = 0.1;
  else if (policy == "v0.2")
    block["version"] = 0.2;
  else
    block["policy"] = policy;
  // The bare block: DeepSpeed's ensure_immutable_elastic_config() reads the
  // variable with ElasticityConfig(json.loads(...)), which takes the block
  // itself (a wrapping {"elasticity": ...} would read as all defaults).
  return block.dump();
}

}  // namespace ductile::agent
