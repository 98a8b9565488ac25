// The rendezvous records as they are stored in etcd (JSON), and their
// readers. Everything read from the store is untrusted: another job, an
// operator's etcdctl or a bug may have written anything under the job's
// prefix. A reader accepts only a record an agent could have written (types,
// ranges, lengths, node ids) and throws MalformedRecord otherwise; the agent
// logs the key and ignores the record (see agent.cpp), so a bad record never
// stops a job.
//
// Threading: plain values and pure functions.
// Errors: the readers throw MalformedRecord (nothing else) naming the field
// and the bad value; writers never throw for any value a reader returned
// (strings that are not UTF-8 are written with U+FFFD in their place).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ductile::agent {

// A stored record that no agent could have written.
class MalformedRecord : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bounds of the records (an agent never writes more).
inline constexpr std::size_t kMaxRecordBytes = 256 * 1024;          // etcd's own limit is 1.5 MiB
inline constexpr std::size_t kMaxErrorFileBytes = 4 * 1024 * 1024;  // a worker's error file
inline constexpr std::size_t kMaxNodeIdChars = 128;
inline constexpr std::size_t kMaxAddrChars = 255;
inline constexpr std::size_t kMaxTextChars = 4096;  // reasons, URIs, messages, one line
inline constexpr std::size_t kMaxReportLines = 20;  // last lines of a failed worker
inline constexpr std::size_t kMaxTracebackChars = 16384;
inline constexpr std::int64_t kMaxRound = std::int64_t{1} << 53;
inline constexpr std::int64_t kMaxCount = std::int64_t{1} << 31;  // ranks, sizes, restarts

// True for a node id (or job id) an agent accepts: 1 to kMaxNodeIdChars
// letters, digits, '.', '_' and '-'.
bool valid_node_id(const std::string& id);

struct NodeInfo {
  std::string id;
  std::string addr;  // address the other nodes reach this one at
  std::int64_t create_revision = 0;
  // A static job's node rank (its group rank in every round); -1: none,
  // nodes are ranked by age.
  std::int64_t rank = -1;
  std::int64_t lease = 0;  // the lease of its key (not in the record)
  // Where its snapshot server listens (on `addr`); 0: it serves none. The
  // other nodes copy its snapshots from there only.
  int snapshot_port = 0;
  // Where its link listener is (on `addr`): the agents of a job keep one
  // link to the leader's (node_links.hpp); 0: none.
  int link_port = 0;
};

enum class RoundState { running, succeeded, failed };
const char* to_string(RoundState state);

struct FailureReport {
  std::string node;
  std::int64_t rank = -1;
  std::int64_t local_rank = -1;
  int exit_status = 0;  // exit code, or 128 + signal number (1..255)
  std::vector<std::string> last_lines;
  // From the worker's TORCHELASTIC_ERROR_FILE, when it wrote one: its
  // "message" ("ValueError: ...") and Python call stack; empty otherwise.
  std::string error_message;
  std::string error_traceback;
};

struct RoundRecord {
  std::int64_t round = 0;
  std::vector<std::string> members;  // node ids in group-rank order; empty: waiting
  // The create revision of each member's key when the round formed: a node
  // that registered again since (a restart, a fenced node) is a new node.
  // Empty in records of older agents: members are then matched by id.
  std::vector<std::int64_t> member_revisions;
  std::string master_addr;
  int master_port = 0;
  // With --mpi-world: the ompi-server the round's workers reach and the
  // port at master_addr where rank 0 lets them join one MPI world.
  std::string mpi_server_uri;
  int mpi_join_port = 0;
  std::int64_t world_size = 0;
  std::int64_t restarts = 0;    // restarts caused by worker failures so far
  std::int64_t started_ms = 0;  // leader's clock (ms since the epoch) when written
  std::string reason;           // why this round was formed
  // Some node held a snapshot in memory when it was formed: its members
  // may start their workers before the restore is prepared.
  bool snapshots_held = false;
  RoundState state = RoundState::running;
  std::optional<FailureReport> failure;  // set when state is failed
};

// checkpoint/<round>: the round's workers are asked to save before a
// planned re-form.
struct CheckpointRequest {
  std::int64_t round = 0;  // the round asked (the round of its key)
  std::string by;          // the node that asked (the leader, or a draining node)
  std::string reason;
  std::int64_t requested_ms = 0;  // the asker's clock, ms since the epoch
};

std::string to_json(const CheckpointRequest& request);
// `round`: the round of its key, which the record's must be.
CheckpointRequest checkpoint_from_json(const std::string& text, std::int64_t round);

// A node's mark: done/<round>/<node> (its workers all exited 0),
// saved/<round>/<node> (they saved the checkpoint asked), draining/<node>
// (round 0: it leaves after a checkpoint). Each is written on the node's
// lease, as {"node": ..., "round": ...} ({"node": ...} for draining).
std::string mark_json(const std::string& node, std::int64_t round);
// Throws MalformedRecord unless `text` is the mark an agent writes for
// `node` and `round`; `what` names the record ("done").
void check_mark(const char* what, const std::string& text, const std::string& node,
                std::int64_t round);

std::string to_json(const RoundRecord& record);
RoundRecord round_from_json(const std::string& text);
std::string to_json(const FailureReport& report);
FailureReport failure_from_json(const std::string& text);
std::string to_json(const NodeInfo& node);
// `key_id`: the node id of the key the record was read from; the record's
// own "id" must be the same.
NodeInfo node_from_json(const std::string& text, const std::string& key_id,
                        std::int64_t create_revision);

// What a worker wrote to its TORCHELASTIC_ERROR_FILE, as torch's
// ErrorHandler writes it ({"message": {"message": "ValueError: ...",
// "extraInfo": {"py_callstack": ..., "timestamp": ...}}}, or a "message"
// string): the message and the call stack, cut to kMaxTextChars and
// kMaxTracebackChars (the end of a call stack is kept: it holds the error).
struct WorkerError {
  std::string message;
  std::string traceback;
};
WorkerError worker_error_from_json(const std::string& text);

// A round record that fits this job: its world size is members x
// nproc_per_node and one of `valid_gpus` (sorted); a waiting round has world
// size 0. Throws MalformedRecord otherwise.
void check_round_fits(const RoundRecord& record, std::int64_t nproc_per_node,
                      const std::vector<std::int64_t>& valid_gpus);

// The job's settings record (policy, parameters, nproc-per-node,
// --mpi-world) against this agent's (`mine`, a JSON object text): one
// line per difference, "prefer_larger_batch is true there, false here";
// empty when they agree. Throws MalformedRecord when `theirs` is not a
// settings record.
std::vector<std::string> settings_differences(const std::string& theirs, const std::string& mine);

// `text` cut to at most `limit` bytes at a UTF-8 character boundary, with
// "..." appended when cut; for quoting store values in messages.
std::string excerpt(const std::string& text, std::size_t limit = 120);

}  // namespace ductile::agent
