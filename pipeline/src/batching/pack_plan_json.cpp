// `ductile pack --json`: a PackPlan written as JSON, once for every front end.
#include <nlohmann/json.hpp>

#include "ductile/pipeline/pack_plan.hpp"

namespace ductile::pipeline {

std::string to_json(const PackPlan& plan, bool with_stats, ProgressSink* progress) {
  nlohmann::json out;
  nlohmann::json microbatches = nlohmann::json::array();
  report_stage(progress, "writing JSON", plan.microbatch_count() + plan.rank_count());
  for_each_reporting(plan.microbatch_count(), progress, [&](std::size_t m) {
    auto ids = plan.microbatch(m);
    microbatches.push_back(
        {plan.microbatch_steps[m], std::vector<std::int64_t>(ids.begin(), ids.end())});
  });
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
      report_progress(progress, plan.microbatch_count() + rank + 1);
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
  // nlohmann's dump reports nothing while it formats.
  report_stage(progress, "formatting JSON", 0);
  return out.dump();
}

}  // namespace ductile::pipeline
