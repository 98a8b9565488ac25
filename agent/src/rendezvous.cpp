// Rendezvous records and the leader's decisions; see rendezvous.hpp.
#include "ductile/agent/rendezvous.hpp"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

namespace ductile::agent {
namespace {

using json = nlohmann::json;

json failure_json(const FailureReport& f) {
  return {{"node", f.node},
          {"rank", f.rank},
          {"local_rank", f.local_rank},
          {"exit_status", f.exit_status},
          {"last_lines", f.last_lines}};
}

FailureReport failure_of(const json& j) {
  FailureReport f;
  f.node = j.at("node").get<std::string>();
  f.rank = j.at("rank").get<std::int64_t>();
  f.local_rank = j.at("local_rank").get<std::int64_t>();
  f.exit_status = j.at("exit_status").get<int>();
  f.last_lines = j.at("last_lines").get<std::vector<std::string>>();
  return f;
}

json parse(const std::string& text, const char* what) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    throw std::runtime_error(fmt::format("malformed {} record: {}", what, text.substr(0, 200)));
  return j;
}

}  // namespace

const char* to_string(RoundState state) {
  switch (state) {
    case RoundState::running:
      return "running";
    case RoundState::succeeded:
      return "succeeded";
    case RoundState::failed:
      return "failed";
  }
  return "running";
}

std::string to_json(const RoundRecord& r) {
  json j = {{"round", r.round},
            {"members", r.members},
            {"master_addr", r.master_addr},
            {"master_port", r.master_port},
            {"mpi_server_uri", r.mpi_server_uri},
            {"mpi_join_port", r.mpi_join_port},
            {"world_size", r.world_size},
            {"restarts", r.restarts},
            {"started_ms", r.started_ms},
            {"reason", r.reason},
            {"state", to_string(r.state)}};
  if (r.failure) j["failure"] = failure_json(*r.failure);
  return j.dump();
}

RoundRecord round_from_json(const std::string& text) {
  json j = parse(text, "round");
  try {
    RoundRecord r;
    r.round = j.at("round").get<std::int64_t>();
    r.members = j.at("members").get<std::vector<std::string>>();
    r.master_addr = j.at("master_addr").get<std::string>();
    r.master_port = j.at("master_port").get<int>();
    r.mpi_server_uri = j.value("mpi_server_uri", "");
    r.mpi_join_port = j.value("mpi_join_port", 0);
    r.world_size = j.at("world_size").get<std::int64_t>();
    r.restarts = j.at("restarts").get<std::int64_t>();
    r.started_ms = j.at("started_ms").get<std::int64_t>();
    r.reason = j.value("reason", "");
    auto state = j.at("state").get<std::string>();
    if (state == "succeeded")
      r.state = RoundState::succeeded;
    else if (state == "failed")
      r.state = RoundState::failed;
    else if (state == "running")
      r.state = RoundState::running;
    else
      throw std::runtime_error("unknown state '" + state + "'");
    if (j.contains("failure")) r.failure = failure_of(j["failure"]);
    return r;
  } catch (const json::exception& e) {
    throw std::runtime_error(
        fmt::format("malformed round record ({}): {}", e.what(), text.substr(0, 200)));
  }
}

std::string to_json(const FailureReport& report) {
  return failure_json(report).dump();
}

FailureReport failure_from_json(const std::string& text) {
  try {
    return failure_of(parse(text, "failure"));
  } catch (const json::exception& e) {
    throw std::runtime_error(
        fmt::format("malformed failure record ({}): {}", e.what(), text.substr(0, 200)));
  }
}

std::string to_json(const NodeInfo& node) {
  return json{{"id", node.id}, {"addr", node.addr}}.dump();
}

NodeInfo node_from_json(const std::string& text, std::int64_t create_revision) {
  json j = parse(text, "node");
  return NodeInfo{j.value("id", ""), j.value("addr", ""), create_revision};
}

std::int64_t admitted_nodes(const std::vector<std::int64_t>& valid_gpus,
                            std::int64_t nproc_per_node, std::int64_t min_nodes,
                            std::int64_t max_nodes, std::int64_t available) {
  for (std::int64_t k = std::min(max_nodes, available); k >= std::max<std::int64_t>(min_nodes, 1);
       --k)
    if (std::binary_search(valid_gpus.begin(), valid_gpus.end(), k * nproc_per_node)) return k;
  return 0;
}

Decision decide(const Observation& seen, const RendezvousSettings& s) {
  auto alive_count = static_cast<std::int64_t>(seen.alive.size());
  std::int64_t k =
      admitted_nodes(s.valid_gpus, s.nproc_per_node, s.min_nodes, s.max_nodes, alive_count);
  auto first = [&](std::int64_t n) {
    return std::vector<NodeInfo>(seen.alive.begin(), seen.alive.begin() + n);
  };
  auto form = [&](std::string reason, bool counted) {
    Decision d{Action::new_round, first(k), counted, std::move(reason)};
    return d;
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

  auto is_alive = [&](const std::string& id) {
    return std::any_of(seen.alive.begin(), seen.alive.end(),
                       [&](const NodeInfo& n) { return n.id == id; });
  };
  std::vector<std::string> lost;
  for (const auto& m : round.members)
    if (!is_alive(m)) lost.push_back(m);
  if (!lost.empty()) {
    std::string reason = fmt::format("node(s) {} left", fmt::join(lost, ", "));
    if (k == 0) return Decision{Action::new_round, {}, false, reason + "; too few nodes, waiting"};
    return form(reason, false);
  }
  if (seen.failure) {
    if (seen.now - seen.failure_seen < s.failure_grace) return {};
    std::string reason =
        fmt::format("worker rank {} on node {} exited with status {}", seen.failure->rank,
                    seen.failure->node, seen.failure->exit_status);
    if (round.restarts >= s.max_restarts)
      return Decision{
          Action::fail,
          {},
          false,
          fmt::format("{}; no restarts left (max-restarts {})", reason, s.max_restarts)};
    return form(reason, true);
  }
  if (seen.all_done) return Decision{Action::succeed, {}, false, "every node's workers finished"};
  if (k * s.nproc_per_node > round.world_size && settled &&
      seen.now.count() - round.started_ms >= s.min_time.count())
    return form(fmt::format("scale-up: {} node(s) admitted of {} present", k, alive_count), false);
  return {};
}

}  // namespace ductile::agent
