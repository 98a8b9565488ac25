// etcd's v3 gRPC messages by hand. The field numbers are those of etcd's
// etcdserverpb/rpc.proto and mvccpb/kv.proto (stable across etcd 3.x).
#include "etcd_wire.hpp"

#include <fmt/format.h>

namespace ductile::agent::etcd_wire {
namespace {

enum Wire : int { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

// --- writing ---

void put_varint(std::string& out, std::uint64_t value) {
  while (value >= 0x80) {
    out += static_cast<char>((value & 0x7f) | 0x80);
    value >>= 7;
  }
  out += static_cast<char>(value);
}

void put_tag(std::string& out, int field, Wire wire) {
  put_varint(out, (static_cast<std::uint64_t>(field) << 3) | static_cast<std::uint64_t>(wire));
}

// An int64 or enum field (negative values take ten bytes, as protobuf's).
void put_int(std::string& out, int field, std::int64_t value) {
  if (value == 0) return;
  put_tag(out, field, kVarint);
  put_varint(out, static_cast<std::uint64_t>(value));
}

void put_bool(std::string& out, int field, bool value) {
  if (value) put_int(out, field, 1);
}

void put_bytes(std::string& out, int field, std::string_view value) {
  if (value.empty()) return;
  put_tag(out, field, kBytes);
  put_varint(out, value.size());
  out.append(value);
}

// A nested message: written even when empty.
void put_message(std::string& out, int field, std::string_view message) {
  put_tag(out, field, kBytes);
  put_varint(out, message.size());
  out.append(message);
}

// --- reading ---

[[noreturn]] void malformed(const char* message, const char* what) {
  throw StoreError(fmt::format("etcd sent a malformed {}: {}", message, what));
}

class Reader {
 public:
  Reader(std::string_view in, const char* message) : in_(in), message_(message) {}

  // The next field's tag: false at the end of the message.
  bool next() {
    if (at_ == in_.size()) return false;
    const std::uint64_t tag = varint();
    field_ = tag >> 3;
    wire_ = static_cast<int>(tag & 7);
    if (field_ == 0 || field_ > 536870911) malformed(message_, "a field number out of range");
    return true;
  }
  std::uint64_t field() const { return field_; }
  int wire() const { return wire_; }

  std::int64_t integer() {
    expect(kVarint);
    return static_cast<std::int64_t>(varint());
  }
  bool boolean() { return integer() != 0; }
  std::string_view bytes() {
    expect(kBytes);
    const std::uint64_t size = varint();
    if (size > in_.size() - at_) malformed(message_, "a length past the end of the message");
    const std::string_view out = in_.substr(at_, size);
    at_ += size;
    return out;
  }
  void skip() {
    switch (wire_) {
      case kVarint:
        varint();
        return;
      case kBytes:
        bytes();
        return;
      case kFixed64:
        advance(8);
        return;
      case kFixed32:
        advance(4);
        return;
      default:
        malformed(message_, "a field of an unknown wire type");
    }
  }

 private:
  std::uint64_t varint() {
    std::uint64_t value = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      if (at_ == in_.size()) malformed(message_, "a number cut off at the end of the message");
      const auto byte = static_cast<std::uint8_t>(in_[at_++]);
      value |= static_cast<std::uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return value;
    }
    malformed(message_, "a number of over 10 bytes");
  }
  void expect(int wire) {
    if (wire_ != wire) malformed(message_, "a field of another wire type than its own");
  }
  void advance(std::size_t n) {
    if (n > in_.size() - at_) malformed(message_, "a field past the end of the message");
    at_ += n;
  }

  std::string_view in_;
  const char* message_;
  std::size_t at_ = 0;
  std::uint64_t field_ = 0;
  int wire_ = 0;
};

std::int64_t header_revision(std::string_view header) {
  Reader r(header, "response header");
  std::int64_t revision = 0;
  while (r.next())
    if (r.field() == 3)
      revision = r.integer();
    else
      r.skip();
  return revision;
}

KeyValue decode_key_value(std::string_view message) {
  Reader r(message, "key-value");
  KeyValue kv;
  while (r.next()) {
    switch (r.field()) {
      case 1:
        kv.key = r.bytes();
        break;
      case 2:
        kv.create_revision = r.integer();
        break;
      case 3:
        kv.mod_revision = r.integer();
        break;
      case 5:
        kv.value = r.bytes();
        break;
      case 6:
        kv.lease = r.integer();
        break;
      default:
        r.skip();
    }
  }
  return kv;
}

std::string range_fields(const Range& range) {
  std::string out;
  put_bytes(out, 1, range.key);
  put_bytes(out, 2, range.end);
  put_int(out, 3, range.limit);
  if (range.oldest_first) {
    put_int(out, 5, 1);  // sort_order ASCEND
    put_int(out, 6, 2);  // sort_target CREATE
  }
  put_bool(out, 8, range.keys_only);
  return out;
}

}  // namespace

std::string range_request(const Range& range) {
  return range_fields(range);
}

std::string put_request(const std::string& key, const std::string& value, std::int64_t lease) {
  std::string out;
  put_bytes(out, 1, key);
  put_bytes(out, 2, value);
  put_int(out, 3, lease);
  return out;
}

std::string delete_range_request(const std::string& key, const std::string& end) {
  std::string out;
  put_bytes(out, 1, key);
  put_bytes(out, 2, end);
  return out;
}

std::string txn_request(const std::vector<std::string>& compares,
                        const std::vector<std::string>& success) {
  std::string out;
  for (const auto& c : compares) put_message(out, 1, c);
  for (const auto& op : success) put_message(out, 2, op);
  return out;
}

std::string compare_mod_revision(const std::string& key, std::int64_t mod_revision) {
  std::string out;
  // result EQUAL (0, left out); target MOD.
  put_int(out, 2, 2);
  put_bytes(out, 3, key);
  // One of the target_union: written even when 0, so that it is set.
  put_tag(out, 6, kVarint);
  put_varint(out, static_cast<std::uint64_t>(mod_revision));
  return out;
}

std::string range_op(const Range& range) {
  std::string out;
  put_message(out, 1, range_fields(range));
  return out;
}

std::string put_op(const std::string& key, const std::string& value, std::int64_t lease) {
  std::string out;
  put_message(out, 2, put_request(key, value, lease));
  return out;
}

std::string lease_grant_request(std::int64_t ttl_seconds) {
  std::string out;
  put_int(out, 1, ttl_seconds);
  return out;
}

std::string lease_id_request(std::int64_t lease) {
  std::string out;
  put_int(out, 1, lease);
  return out;
}

std::string watch_create_request(const KeyRange& range, std::int64_t start_revision) {
  std::string create;
  put_bytes(create, 1, range.key);
  put_bytes(create, 2, range.end);
  put_int(create, 3, start_revision);
  std::string out;
  put_message(out, 1, create);
  return out;
}

RangeAnswer decode_range_response(std::string_view message) {
  Reader r(message, "range answer");
  RangeAnswer out;
  while (r.next()) {
    if (r.field() == 1)
      out.revision = header_revision(r.bytes());
    else if (r.field() == 2)
      out.kvs.push_back(decode_key_value(r.bytes()));
    else
      r.skip();
  }
  return out;
}

TxnAnswer decode_txn_response(std::string_view message) {
  Reader r(message, "transaction answer");
  TxnAnswer out;
  while (r.next()) {
    if (r.field() == 1) {
      out.revision = header_revision(r.bytes());
    } else if (r.field() == 2) {
      out.succeeded = r.boolean();
    } else if (r.field() == 3) {
      Reader op(r.bytes(), "transaction op's answer");
      TxnAnswer::Op answer;
      while (op.next()) {
        if (op.field() == 1) {
          answer.is_range = true;
          answer.kvs = decode_range_response(op.bytes()).kvs;
        } else {
          op.skip();
        }
      }
      out.responses.push_back(std::move(answer));
    } else {
      r.skip();
    }
  }
  return out;
}

ChangeAnswer decode_change_response(std::string_view message) {
  Reader r(message, "write answer");
  ChangeAnswer out;
  while (r.next()) {
    if (r.field() == 1)
      out.revision = header_revision(r.bytes());
    else if (r.field() == 2)
      out.deleted = r.integer();
    else
      r.skip();
  }
  return out;
}

LeaseAnswer decode_lease_response(std::string_view message) {
  Reader r(message, "lease answer");
  LeaseAnswer out;
  while (r.next()) {
    if (r.field() == 2)
      out.id = r.integer();
    else if (r.field() == 3)
      out.ttl = r.integer();
    else if (r.field() == 4 && r.wire() == kBytes)  // a grant's error (a time-to-live's
      out.error = r.bytes();                        // field 4 is its granted TTL)
    else
      r.skip();
  }
  return out;
}

WatchMessage decode_watch_response(std::string_view message) {
  Reader r(message, "watch message");
  WatchMessage out;
  while (r.next()) {
    switch (r.field()) {
      case 3:
        out.created = r.boolean();
        break;
      case 4:
        out.canceled = r.boolean();
        break;
      case 5:
        out.compact_revision = r.integer();
        break;
      case 11: {
        Reader e(r.bytes(), "watch event");
        WatchEvent event;
        bool has_kv = false;
        while (e.next()) {
          if (e.field() == 1) {
            event.deleted = e.integer() == 1;
          } else if (e.field() == 2) {
            event.kv = decode_key_value(e.bytes());
            has_kv = true;
          } else {
            e.skip();
          }
        }
        if (!has_kv) malformed("watch event", "an event without its key");
        out.events.push_back(std::move(event));
        break;
      }
      default:
        r.skip();
    }
  }
  return out;
}

std::string frame(std::string_view message) {
  std::string out(5, '\0');
  const auto size = static_cast<std::uint32_t>(message.size());
  out[1] = static_cast<char>(size >> 24);
  out[2] = static_cast<char>(size >> 16);
  out[3] = static_cast<char>(size >> 8);
  out[4] = static_cast<char>(size);
  out.append(message);
  return out;
}

bool Deframer::next(std::string& out) {
  if (pending() < 5) return false;
  const auto* head = reinterpret_cast<const std::uint8_t*>(pending_.data() + read_);
  if (head[0] != 0)
    throw StoreError("etcd sent a compressed gRPC message, though none was asked for");
  const std::size_t size = (std::size_t{head[1]} << 24) | (std::size_t{head[2]} << 16) |
                           (std::size_t{head[3]} << 8) | std::size_t{head[4]};
  if (size > kMaxMessageBytes)
    throw StoreError(
        fmt::format("etcd sent a message of {} bytes, over the {} read", size, kMaxMessageBytes));
  if (pending() < 5 + size) return false;
  out.assign(pending_, read_ + 5, size);
  read_ += 5 + size;
  // What was read goes once it is most of the buffer (a stream's messages
  // are not copied again and again).
  if (read_ > pending_.size() / 2) {
    pending_.erase(0, read_);
    read_ = 0;
  }
  return true;
}

}  // namespace ductile::agent::etcd_wire
