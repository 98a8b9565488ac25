// What the parts of the agent share: who this agent is (NodeIdentity), the
// clocks and host names it uses, its directory of error and log files, and
// the environment of a round's workers (worker_env.cpp). Internal to
// libductile_agent; see agent_impl.hpp for the parts and agent.hpp for the
// contract.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ductile/agent/agent_options.hpp"
#include "ductile/agent/job_policy.hpp"
#include "ductile/agent/records.hpp"
#include "ductile/agent/workers.hpp"

namespace ductile::agent {

// This agent in the job: its node id and address and the job's key prefix
// (set once at start-up, read by every part), and its log.
struct NodeIdentity {
  std::string prefix;  // /ductile/agent/<job id>/
  std::string id;
  std::string addr;       // published as MASTER_ADDR when this node leads
  int snapshot_port = 0;  // its snapshot server's, registered with the node (0: none)
  int link_port = 0;      // its link listener's (node_links.hpp), registered too (0: none)
  std::string key(const std::string& name) const { return prefix + name; }
  void log(const std::string& message) const {
    write_line(true, fmt::format("ductile agent {}: {}", id, message));
  }
};

// What a round's workers are started with (worker_env.cpp).
struct WorkerSetup {
  const AgentOptions& options;
  const JobPolicy& policy;
  const RoundRecord& round;
  std::size_t group_rank;
  const std::string& node_id;
  const std::filesystem::path& run_dir;  // the agent's directory of error files
  // DUCTILE_SNAPSHOT_DIR (empty: not set) and DUCTILE_SNAPSHOT_RESTORE
  // (empty: not set; the snapshot this round's workers resume from).
  const std::filesystem::path& snapshot_dir;
  const std::filesystem::path& snapshot_restore;
  // > 0: snapshot_restore does not exist yet (the agent still gathers it);
  // the workers wait that long for it (DUCTILE_SNAPSHOT_RESTORE_WAIT).
  std::chrono::milliseconds restore_wait{0};
};
std::vector<WorkerSpec> worker_specs(const WorkerSetup& setup);
// True for the variables worker_specs() sets differently from round to
// round (RANK, WORLD_SIZE, MASTER_PORT, TORCHELASTIC_RESTART_COUNT,
// DUCTILE_ROUND, ...): a spare worker starts without them.
bool is_round_variable(const std::string& name);
// --warm-workers: how many words of the worker command are its Python and
// the Python's options, before the script or -m MODULE. `chosen`: the agent
// chose the interpreter (torchrun's form, a script without '--'). Throws
// ductile::Error (invalid_argument) saying why a spare cannot run it.
std::size_t interpreter_words(const std::vector<std::string>& command, bool chosen);
// torchrun's directory of an attempt's files: <run_dir>/attempt_<restarts>,
// made afresh for each round (a re-form without a failure reuses it).
std::filesystem::path attempt_dir_of(const std::filesystem::path& run_dir, std::int64_t restarts);
// TORCHELASTIC_ERROR_FILE of a worker: <attempt dir>/<local rank>/error.json.
std::filesystem::path error_file_of(const std::filesystem::path& run_dir, std::int64_t restarts,
                                    std::int64_t local_rank);
// DUCTILE_CHECKPOINT_REQUEST of a round's workers (the agent creates it when
// it asks them to save) and DUCTILE_CHECKPOINT_SAVED of one (the worker
// creates it when it saved).
std::filesystem::path checkpoint_request_of(const std::filesystem::path& run_dir,
                                            std::int64_t round);
std::filesystem::path checkpoint_saved_of(const std::filesystem::path& run_dir, std::int64_t round,
                                          std::int64_t local_rank);
// DUCTILE_ROUND_END of every worker: before the agent stops a round's
// workers it writes there the round and why it ends (ductile's workers say
// it in one line when a collective failed because a peer was gone).
std::filesystem::path round_end_of(const std::filesystem::path& run_dir);
// DUCTILE_ROUND_NOTICE of a worker (with the agent's store): where the agent
// writes the next round's notice for a worker that goes on in place, and
// beside it (round_notice_ready_of) the worker's word that its engine
// rejoins a round in place (ductile/torch/zero3/_round_notice.py).
std::filesystem::path round_notice_of(const std::filesystem::path& run_dir,
                                      std::int64_t local_rank);
std::filesystem::path round_notice_ready_of(const std::filesystem::path& run_dir,
                                            std::int64_t local_rank);
// The notice of `round` for the worker of `local_rank` whose rank in it is
// `rank`: one JSON object (the contract of _round_notice.py); `restore` is
// the snapshot folder every rank of the round loads.
std::string round_notice_json(const RoundRecord& round, std::int64_t rank, std::int64_t local_rank,
                              std::int64_t local_world_size, const std::filesystem::path& restore,
                              const JobPolicy& policy);

// How many of the oldest registrations an agent reads each pass to find the
// leader (the oldest live one); the leader reads them all.
inline constexpr std::int64_t kLeaderWindow = 16;
// How often an agent that follows only its own part of the job's keys, and
// has no link to its leader, reads the oldest registrations (it may lead
// once all of them are gone; a new round makes it look at once).
inline constexpr std::chrono::milliseconds kWindowRecheck{2000};

// `text`'s pieces between `separator`s, empty ones included ("a,,b": "a",
// "", "b"; "": one empty piece).
inline std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> pieces;
  for (std::size_t from = 0;;) {
    const std::size_t end = std::min(text.find(separator, from), text.size());
    pieces.push_back(text.substr(from, end - from));
    if (end == text.size()) return pieces;
    from = end + 1;
  }
}

// agent_options.cpp
// An executable regular file.
bool runnable_file(const std::string& file);
// As execvp searches: the first runnable `name` in `dirs` (PATH's form, an
// empty directory is '.'); "" when there is none.
std::string found_on_path(const std::string& name, const std::string& dirs);

// hosts.cpp
std::chrono::milliseconds now_ms();
std::string host_name();
// This host's fully qualified name, as Python's socket.getfqdn() finds it
// (torchrun's default node address); the host name when it finds none.
std::string fully_qualified_host_name();
// True when `host` names this machine: localhost, a loopback address, its
// host name or an address of one of its interfaces (torchrun's test for
// the host of a c10d rendezvous).
bool names_this_machine(const std::string& host);

// A directory of the agent's own for its workers' error files and log
// files: $TMPDIR/ductile-agent-<job>-XXXXXX, removed with its contents when
// destroyed; or, when the workers' output goes to files,
// <log dir or $TMPDIR>/<job>_XXXXXX, kept (torchrun's layout).
class RunDir {
 public:
  RunDir(const std::string& job_id, const WorkerOutput& output);
  ~RunDir();
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  bool kept() const { return kept_; }

 private:
  std::filesystem::path path_;
  bool kept_ = false;
};

}  // namespace ductile::agent
