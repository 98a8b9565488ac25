// Checkpoints before a planned re-form, on this node's side. See
// checkpoints.hpp.
#include "checkpoints.hpp"

#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace ductile::agent {

void Checkpoints::follow() {
  if (settings_.checkpoint_timeout.count() == 0 || !workers_.member() || workers_.empty()) return;
  const std::string r = std::to_string(workers_.current_round());
  if (!asked_) {
    auto kv = conn_.store().get(self_.key("checkpoint/" + r));
    if (!kv) return;
    CheckpointRequest request;
    try {
      request = checkpoint_from_json(kv->value, workers_.current_round());
    } catch (const MalformedRecord& e) {
      conn_.ignore_record(*kv, e.what(), "no checkpoint asked");
      return;
    }
    // The workers' signal: the file appears, whole (written aside, renamed).
    auto file = checkpoint_request_of(workers_.run_dir(), workers_.current_round());
    auto part = file;
    part += ".part";
    std::ofstream(part)
        << nlohmann::json{{"round", workers_.current_round()}, {"reason", request.reason}}.dump(
               -1, ' ', false, nlohmann::json::error_handler_t::replace)
        << "\n";
    std::error_code ec;
    std::filesystem::rename(part, file, ec);
    asked_ = true;
    self_.log(fmt::format("round {}: the workers are asked to checkpoint ({}; asked by {})",
                          workers_.current_round(), request.reason, request.by));
  }
  if (!saved_reported_ && workers_.all_saved()) {
    conn_.store().put(self_.key("saved/" + r + "/" + self_.id),
                      mark_json(self_.id, workers_.current_round()), conn_.lease());
    saved_reported_ = true;
    self_.log(fmt::format("round {}: this node's workers saved their checkpoint",
                          workers_.current_round()));
  }
}

}  // namespace ductile::agent
