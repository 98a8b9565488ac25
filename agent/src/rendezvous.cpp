// The leader's decisions; see rendezvous.hpp (the records: records.cpp).
#include "ductile/agent/rendezvous.hpp"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace ductile::agent {

std::int64_t admitted_nodes(const std::vector<std::int64_t>& valid_gpus,
                            std::int64_t nproc_per_node, std::int64_t min_nodes,
                            std::int64_t max_nodes, std::int64_t available) {
  for (std::int64_t k = std::min(max_nodes, available); k >= std::max<std::int64_t>(min_nodes, 1);
       --k)
    if (std::binary_search(valid_gpus.begin(), valid_gpus.end(), k * nproc_per_node)) return k;
  return 0;
}

Decision decide(const Observation& seen, const RendezvousSettings& s) {
  auto draining = [&](const std::string& id) {
    return std::find(seen.draining.begin(), seen.draining.end(), id) != seen.draining.end();
  };
  // Draining nodes are alive (their workers may still save) but not admitted.
  std::vector<NodeInfo> admissible;
  for (const auto& n : seen.alive)
    if (!draining(n.id)) admissible.push_back(n);
  auto alive_count = static_cast<std::int64_t>(admissible.size());
  std::int64_t k =
      admitted_nodes(s.valid_gpus, s.nproc_per_node, s.min_nodes, s.max_nodes, alive_count);
  auto form = [&](std::string reason, bool counted) {
    return Decision{Action::new_round,
                    {admissible.begin(), admissible.begin() + k},
                    counted,
                    std::move(reason)};
  };
  bool settled = seen.now - seen.last_membership_change >= s.settle || alive_count >= s.max_nodes;

  if (!seen.round || seen.round->members.empty()) {
    if (seen.round && seen.round->state != RoundState::running) return {};
    if (k > 0 && settled)
      return form(fmt::format("{} node(s) present, {} admitted", alive_count, k), false);
    return {};
  }
  const RoundRecord& round = *seen.round;
  if (round.state != RoundState::running) return {};

  // A member is alive while its key is the one it had when the round
  // formed (a node that registered again has lost its workers).
  auto is_alive = [&](std::size_t i) {
    return std::any_of(seen.alive.begin(), seen.alive.end(), [&](const NodeInfo& n) {
      return n.id == round.members[i] &&
             (round.member_revisions.empty() || n.create_revision == round.member_revisions[i]);
    });
  };
  std::vector<std::string> lost;
  for (std::size_t i = 0; i < round.members.size(); ++i)
    if (!is_alive(i)) lost.push_back(round.members[i]);
  if (!lost.empty()) {
    std::string reason = fmt::format("node(s) {} left", fmt::join(lost, ", "));
    if (k == 0) return Decision{Action::new_round, {}, false, reason + "; too few nodes, waiting"};
    return form(reason, false);
  }
  if (seen.failure) {
    if (seen.now - seen.failure_seen < s.failure_grace) return {};
    std::string reason = fmt::format(
        "worker rank {} on node {} exited with status {}{}", seen.failure->rank, seen.failure->node,
        seen.failure->exit_status,
        seen.failure->error_message.empty() ? ""
                                            : ": " + excerpt(seen.failure->error_message, 300));
    if (round.restarts >= s.max_restarts)
      return Decision{
          Action::fail,
          {},
          false,
          fmt::format("{}; no restarts left (max-restarts {})", reason, s.max_restarts)};
    return form(reason, true);
  }
  if (seen.checkpoint) {
    // Asked: the next round once every member saved, or at the timeout.
    std::vector<std::string> missing;
    for (const auto& m : round.members)
      if (std::find(seen.saved.begin(), seen.saved.end(), m) == seen.saved.end())
        missing.push_back(m);
    if (missing.empty())
      return form(fmt::format("{}; every member's workers saved", seen.checkpoint->reason), false);
    if (seen.now.count() - seen.checkpoint->requested_ms >= s.checkpoint_timeout.count())
      return form(fmt::format("{}; checkpoint timeout ({} ms): node(s) {} did not save",
                              seen.checkpoint->reason, s.checkpoint_timeout.count(),
                              fmt::join(missing, ", ")),
                  false);
    return {};
  }
  if (seen.all_done) return Decision{Action::succeed, {}, false, "every node's workers finished"};
  std::string planned;
  std::vector<std::string> leaving;
  for (const auto& m : round.members)
    if (draining(m)) leaving.push_back(m);
  if (!leaving.empty()) {
    planned = fmt::format("node(s) {} drain", fmt::join(leaving, ", "));
  } else if (k * s.nproc_per_node > round.world_size && settled &&
             seen.now.count() - round.started_ms >= s.min_time.count()) {
    planned = fmt::format("scale-up: {} node(s) admitted of {} present", k, alive_count);
  }
  if (planned.empty()) return {};
  if (s.checkpoint_timeout.count() > 0)
    return Decision{Action::request_checkpoint, {}, false, planned};
  if (k == 0) return Decision{Action::new_round, {}, false, planned + "; too few nodes, waiting"};
  return form(planned, false);
}

}  // namespace ductile::agent
