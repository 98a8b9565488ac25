// `ductile pack --json`: a PackPlan written as JSON, once for every front end.
#include <nlohmann/json.hpp>

#include "ductile/pipeline/pack_plan.hpp"

namespace ductile::pipeline {

std::string to_json(const PackPlan& plan, bool with_stats) {
  nlohmann::json out;
  nlohmann::json microbatches = nlohmann::json::array();
  for (std::size_t m = 0; m < plan.microbatch_count(); ++m) {
    auto ids = plan.microbatch(m);
    microbatches.push_back(
        {plan.microbatch_steps[m], std::vector<std::int64_t>(ids.begin(), ids.end())});
  }
  out["microbatch_ids"] = std::move(microbatches);
  out["batch_sizes"] = plan.batch_sizes;
  out["batch_max_seqlens"] = plan.batch_max_seqlens;
  out["dropped_ids"] = plan.dropped_ids;
  out["leftover_ids"] = plan.leftover_ids;
  if (plan.lr_rule) out["lrs"] = plan.lrs;
  if (plan.rank_count() > 0) {
    nlohmann::json per_rank = nlohmann::json::array();
    for (std::size_t rank = 0; rank < plan.rank_count(); ++rank) {
      auto mine = plan.microbatches_of_rank(rank);
      per_rank.push_back(std::vector<std::int64_t>(mine.begin(), mine.end()));
    }
    out["ranks"] = std::move(per_rank);
  }
  if (with_stats) {
    const auto& s = plan.stats;
    out["stats"] = {{"sequences", s.sequences},
                    {"tokens", s.tokens},
                    {"microbatches", plan.microbatch_count()},
                    {"steps", plan.step_count()},
                    {"dropped", plan.dropped_ids.size()},
                    {"leftover", plan.leftover_ids.size()},
                    {"token_efficiency", s.token_efficiency},
                    {"padded_efficiency", s.padded_efficiency},
                    {"seconds", s.seconds}};
  }
  return out.dump();
}

}  // namespace ductile::pipeline
