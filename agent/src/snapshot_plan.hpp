// In-memory snapshots, the agents' shared view: what each agent holds
// (its workers' own committed snapshots and the replicas it keeps of other
// nodes'), as written to the rendezvous, and the one restore plan every
// member of a round computes from the same records. Internal to
// libductile_agent.
//
// Threading: plain values and pure functions.
// Errors: holdings_from_json throws MalformedRecord (records.hpp) for a
// record no agent could have written; the rest does not throw.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "ductile/agent/records.hpp"

namespace ductile::agent {

// Bounds of a holdings record (an agent never writes more).
inline constexpr std::size_t kMaxSnapshotCopies = 4;      // per node, own or replica
inline constexpr std::size_t kMaxReplicatedNodes = 64;    // nodes a record holds replicas of
inline constexpr std::size_t kMaxSnapshotFiles = 4096;    // files of one copy
inline constexpr std::size_t kMaxSnapshotFileChars = 64;  // a file's name

// One committed snapshot folder an agent holds.
struct SnapshotCopy {
  std::string tag;         // the folder's name, "step<N>" (or "step<N>.<k>": the name
                           // a save gives a tag that exists already)
  std::int64_t step = 0;   // the engine's optimizer steps it holds
  std::int64_t world = 0;  // the world size that wrote it (W of rank<r>-of-<W>.bin)
  std::string sha256;      // its manifest's SHA-256 (64 lowercase hex digits): the
                           // snapshot's identity, the same on every node
  // The checkpoint's files in the folder, sorted: manifest.json,
  // manifest.json.sha256, manifest.json.hmac, rank<r>-of-<world>.bin (r and
  // world in decimal with no leading zero, as the workers write them).
  std::vector<std::string> files;
};

// snapshots/<node> (live, on the node's lease) and holdings/<round>/<node>
// (frozen when the node entered the round).
struct Holdings {
  std::string node;  // the agent's node id
  std::string addr;  // where its snapshot server listens
  int port = 0;
  // Each list newest first (steps never rising), each folder once; at most
  // kMaxSnapshotCopies.
  std::vector<SnapshotCopy> own;
  std::map<std::string, std::vector<SnapshotCopy>> replicas;  // by the node they are of
};

// The record as an agent writes it. Its size is not bounded here (the
// header's bounds allow more than kMaxRecordBytes): the writer checks it.
std::string to_json(const Holdings& holdings);
// `key_node`: the node id of the key it was read from, which the record's
// "node" must be.
Holdings holdings_from_json(const std::string& text, const std::string& key_node);

// restore/<round>: every member's holdings of a round and the last ones of
// the nodes it lost, gathered by the round's oldest member, so that each
// member reads one record instead of every member's.
struct RoundHoldings {
  std::int64_t round = 0;
  std::vector<Holdings> members;  // in the round's group order
  std::vector<Holdings> lost;
};
// Lost nodes a record lists at most (the newest losses are kept).
inline constexpr std::size_t kMaxLostNodesListed = 1024;
// At most kMaxRoundHoldingsBytes (etcd's limit on a value is 1.5 MiB).
inline constexpr std::size_t kMaxRoundHoldingsBytes = 1400 * 1024;
std::string to_json(const RoundHoldings& holdings);
// Throws MalformedRecord unless it is a record of `round` whose members are
// `members` in that order (or none: the round starts without a restore),
// each a valid holdings record.
RoundHoldings round_holdings_from_json(const std::string& text, std::int64_t round,
                                       const std::vector<std::string>& members);

// Where one file of the restored snapshot comes from.
struct FileSource {
  std::string file;    // its name in the snapshot folder
  std::string holder;  // the node that holds it (maybe this one)
  std::string path;    // relative to the holder's area: "own/<tag>/<file>" or
                       // "replicas/<node>/<tag>/<file>"
};

struct RestorePlan {
  std::string tag;  // "step<N>", the folder to assemble it in (restore/<tag>/); the
                    // holders' folders may be named otherwise (see `sources`)
  std::int64_t step = 0;
  std::string sha256;
  std::int64_t world = 0;
  std::vector<FileSource> sources;  // every file, one holder each, sorted by file
  // Of the nodes whose ranks wrote it (the origin of a member's own copy is
  // that member, of a replica of node X, X): the members whose own copies
  // hold their rank files (at least one), and the other nodes, whose rank
  // files come from replicas (lost nodes, mostly). The same on every
  // member: counted from the holders `sources` would name with no
  // preference for this node.
  int own_nodes = 0;
  int replica_nodes = 0;
  // The newest step any record (members' and lost nodes' last ones) shows.
  std::int64_t newest_step_seen = 0;
};

// The newest snapshot that is complete in the members' records: someone
// holds (own copy or replica) manifest.json, manifest.json.sha256,
// manifest.json.hmac when any member's copy of it lists one, and every
// rank<r>-of-<W>.bin. A snapshot is its (step, sha256, world): copies of one
// tag that differ in those are different snapshots, never mixed. Of one
// step's complete snapshots, the one with the smallest sha256. One source
// per file: this node (`self`) when it holds it (own copy before replica),
// else the first member (in `members` order) holding an own copy, else the
// first holding a replica. `members`: every member's holdings for the round
// (this node's too); the step and snapshot chosen depend on them only, so
// every member computes the same. `lost`: the last record of each node
// that held snapshots and is not a member (only read for newest_step_seen
// and the message). A string when no snapshot is complete: why, naming the
// newest snapshot's first missing file ("rank 2's shards of step 41 were
// held only by lost node c", "... are held by no member"; "no snapshot in
// memory" when no record holds one).
std::variant<RestorePlan, std::string> plan_restore(const std::vector<Holdings>& members,
                                                    const std::vector<Holdings>& lost,
                                                    const std::string& self);

// The agent's line for a round: "round 3: restored step 41 from memory: 2
// of 3 nodes' own copies, 1 replica; 0 steps lost" or "round 3: no complete
// snapshot in memory (<why>); the workers resume from their disk
// checkpoint".
std::string restore_message(std::int64_t round, const std::variant<RestorePlan, std::string>& plan);

}  // namespace ductile::agent
