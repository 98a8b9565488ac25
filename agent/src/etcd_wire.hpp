// etcd's v3 gRPC messages on the wire (protocol buffers, encoded and
// decoded here by hand: the few messages EtcdStore sends and reads, with
// the fields it uses), and gRPC's framing of them. Internal to
// libductile_agent; used by EtcdStore (etcd_store.cpp).
//
// Encoding follows proto3: a field at its default value is left out, but a
// nested message is always written (an empty one says "this op").
// Decoding skips the fields it does not know (etcd's newer ones), and
// throws StoreError naming what was malformed for an answer no etcd gives
// (a length past the end, a varint of over 10 bytes, a wire type the field
// cannot have): never reads past its input, never crashes.
//
// Threading: plain functions on values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ductile/agent/etcd_store.hpp"

namespace ductile::agent::etcd_wire {

// --- requests -----------------------------------------------------------

// A RangeRequest: `end` empty for the key alone; `limit` 0 for no limit;
// `oldest_first`: sorted by create revision, ascending.
struct Range {
  std::string key;
  std::string end;
  std::int64_t limit = 0;
  bool keys_only = false;
  bool oldest_first = false;
};
std::string range_request(const Range& range);
std::string put_request(const std::string& key, const std::string& value, std::int64_t lease);
std::string delete_range_request(const std::string& key, const std::string& end);
// A TxnRequest: `compares` (Compare messages) and the ops of its success
// branch (RequestOp messages); no failure branch.
std::string txn_request(const std::vector<std::string>& compares,
                        const std::vector<std::string>& success);
// A Compare: the key's mod revision equals `mod_revision` (0: the key is
// absent).
std::string compare_mod_revision(const std::string& key, std::int64_t mod_revision);
// RequestOp messages.
std::string range_op(const Range& range);
std::string put_op(const std::string& key, const std::string& value, std::int64_t lease);
// LeaseGrantRequest.
std::string lease_grant_request(std::int64_t ttl_seconds);
// LeaseRevokeRequest, LeaseKeepAliveRequest and LeaseTimeToLiveRequest:
// each the lease's ID alone (field 1).
std::string lease_id_request(std::int64_t lease);
// A WatchRequest that creates a watch of [key, end) from `start_revision`
// (0: from now).
std::string watch_create_request(const KeyRange& range, std::int64_t start_revision);

// --- answers ------------------------------------------------------------

// The kvs of a RangeResponse.
struct RangeAnswer {
  std::int64_t revision = 0;  // its header's
  std::vector<KeyValue> kvs;
};
RangeAnswer decode_range_response(std::string_view message);

// A TxnResponse: whether its comparisons held, and each op's answer (a
// range's kvs; nothing for a put or a delete).
struct TxnAnswer {
  std::int64_t revision = 0;
  bool succeeded = false;
  struct Op {
    bool is_range = false;
    std::vector<KeyValue> kvs;
  };
  std::vector<Op> responses;
};
TxnAnswer decode_txn_response(std::string_view message);

// PutResponse, DeleteRangeResponse.
struct ChangeAnswer {
  std::int64_t revision = 0;
  std::int64_t deleted = 0;  // a DeleteRangeResponse's count
};
ChangeAnswer decode_change_response(std::string_view message);

// LeaseGrantResponse, LeaseKeepAliveResponse, LeaseTimeToLiveResponse,
// LeaseRevokeResponse: the lease's ID and TTL (an expired lease's
// keep-alive answers TTL 0, its time-to-live -1); `error`, a grant's.
struct LeaseAnswer {
  std::int64_t id = 0;
  std::int64_t ttl = 0;
  std::string error;
};
LeaseAnswer decode_lease_response(std::string_view message);

// A WatchResponse.
WatchMessage decode_watch_response(std::string_view message);

// --- gRPC framing --------------------------------------------------------

// The largest message read from etcd (its own limit on requests is 1.5 MiB
// by default; a watch's batch of events may be larger).
inline constexpr std::size_t kMaxMessageBytes = std::size_t{64} << 20;

// `message` as one gRPC length-prefixed message (uncompressed).
std::string frame(std::string_view message);

// Reads a body's length-prefixed messages as they stream in.
class Deframer {
 public:
  void feed(std::string_view bytes) { pending_.append(bytes); }
  // The next whole message into `out`: false when it has not all come
  // yet. StoreError for a compressed message (none was asked for) or one
  // of over kMaxMessageBytes.
  bool next(std::string& out);
  // Bytes of a message not yet whole.
  std::size_t pending() const { return pending_.size() - read_; }

 private:
  std::string pending_;
  std::size_t read_ = 0;
};

}  // namespace ductile::agent::etcd_wire
