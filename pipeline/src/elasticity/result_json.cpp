// ElasticityResult as JSON; see ductile/pipeline/elasticity.hpp.
#include <nlohmann/json.hpp>

#include "ductile/pipeline/elasticity.hpp"

namespace ductile::pipeline {
namespace {

template <class T>
nlohmann::json optional_json(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

}  // namespace

nlohmann::json to_json(const ElasticityResult& r) {
  nlohmann::json j;
  j["final_batch_size"] = r.final_batch_size;
  j["valid_gpus"] = r.valid_gpus;
  j["valid_dp_sizes"] = r.valid_dp_sizes;
  j["micro_batch_size"] = optional_json(r.micro_batch_size);
  j["gradient_accumulation_steps"] = optional_json(r.gradient_accumulation_steps);
  j["world_size"] = optional_json(r.world_size);
  j["data_parallel_size"] = optional_json(r.data_parallel_size);
  j["model_parallel_size"] = r.model_parallel_size;
  j["num_gpus_per_node"] = r.num_gpus_per_node;
  j["fallback"] = r.fallback;
  j["warnings"] = r.warnings;
  return j;
}

}  // namespace ductile::pipeline
