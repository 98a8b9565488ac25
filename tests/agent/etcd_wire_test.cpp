// etcd's gRPC messages as EtcdStore writes and reads them (etcd_wire):
// requests byte for byte against protobuf's encoding of etcd's messages,
// answers as etcd sends them, and answers no etcd sends (cut, lengths past
// the end, wire types a field cannot have), which are errors and never
// crashes. The semantics against a real etcd: etcd_store_test.cpp.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../../agent/src/etcd_wire.hpp"
#include "ductile/agent/kv_store.hpp"

using namespace ductile::agent;
namespace wire = ductile::agent::etcd_wire;

// Not an anonymous namespace: a unity build puts this file beside other
// tests, whose helpers' names would clash.
namespace etcd_wire_test {

// Protobuf's encoding, written out here independently of etcd_wire's, to
// build the answers etcd sends.
std::string varint(std::uint64_t v) {
  std::string out;
  do {
    out += static_cast<char>((v & 0x7f) | (v >= 0x80 ? 0x80 : 0));
    v >>= 7;
  } while (v != 0);
  return out;
}
std::string number(int field, std::int64_t v) {
  return varint(static_cast<std::uint64_t>(field) << 3) + varint(static_cast<std::uint64_t>(v));
}
std::string bytes(int field, const std::string& v) {
  return varint((static_cast<std::uint64_t>(field) << 3) | 2) + varint(v.size()) + v;
}
std::string header(std::int64_t revision) {
  return bytes(1, number(1, 77) + number(3, revision) + number(4, 2));
}
std::string key_value(const std::string& key, const std::string& value, std::int64_t created,
                      std::int64_t modified, std::int64_t lease) {
  return bytes(1, key) + number(2, created) + number(3, modified) + number(4, 1) + bytes(5, value) +
         number(6, lease);
}

std::string hex(const std::string& s) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

}  // namespace etcd_wire_test

using namespace etcd_wire_test;

TEST_CASE("etcd wire: requests are protobuf's encoding of etcd's messages") {
  // RangeRequest{key "a", range_end "b", limit 16, sort ASCEND by CREATE,
  // keys_only}.
  CHECK(hex(wire::range_request({"a", "b", 16, true, true})) ==
        "0a016112016218102801300240"
        "01");
  CHECK(hex(wire::range_request({"k", ""})) == "0a016b");
  // PutRequest{key, value, lease}; a lease of 0 is left out.
  CHECK(hex(wire::put_request("k", "v", 300)) ==
        "0a016b120176"
        "18ac02");
  CHECK(hex(wire::put_request("k", "", 0)) == "0a016b");
  // Compare{target MOD, key, mod_revision 0}: the revision is written even
  // at 0 (one of a oneof).
  CHECK(hex(wire::compare_mod_revision("k", 0)) == "10021a016b3000");
  // TxnRequest{compare, success [RequestOp{request_put}, RequestOp{request_range}]}.
  const std::string txn = wire::txn_request({wire::compare_mod_revision("k", 5)},
                                            {wire::put_op("k", "v", 0), wire::range_op({"r", ""})});
  CHECK(hex(txn) ==
        "0a0710021a016b3005"
        "1208120"
        "60a016b120176"
        "1205"
        "0a030a0172");
  // A negative number takes ten bytes; a lease's ID alone is field 1.
  CHECK(hex(wire::lease_grant_request(-1)) == "08ffffffffffffffffff01");
  CHECK(hex(wire::lease_id_request(7)) == "0807");
  // WatchRequest{create_request{key, range_end, start_revision}}.
  CHECK(hex(wire::watch_create_request(KeyRange{"a", "b"}, 9)) ==
        "0a080a016112016218"
        "09");
}

TEST_CASE("etcd wire: answers as etcd sends them") {
  SUBCASE("a transaction's ranges after its put") {
    const std::string range = header(12) + bytes(2, key_value("/j/a", "x", 3, 4, 0)) +
                              bytes(2, key_value("/j/b", "", 5, 12, 99)) + number(4, 2);
    const std::string answer = header(12) + number(2, 1) + bytes(3, bytes(2, header(12))) +
                               bytes(3, bytes(1, range)) + bytes(3, bytes(1, header(12)));
    const auto txn = wire::decode_txn_response(answer);
    CHECK(txn.revision == 12);
    CHECK(txn.succeeded);
    REQUIRE(txn.responses.size() == 3);
    CHECK_FALSE(txn.responses[0].is_range);
    REQUIRE(txn.responses[1].is_range);
    CHECK(txn.responses[2].is_range);
    CHECK(txn.responses[2].kvs.empty());
    const auto& kvs = txn.responses[1].kvs;
    REQUIRE(kvs.size() == 2);
    CHECK(kvs[0].key == "/j/a");
    CHECK(kvs[0].value == "x");
    CHECK(kvs[0].create_revision == 3);
    CHECK(kvs[0].mod_revision == 4);
    CHECK(kvs[0].lease == 0);
    CHECK(kvs[1].value.empty());
    CHECK(kvs[1].lease == 99);
  }
  SUBCASE("a comparison that failed") {
    const auto txn = wire::decode_txn_response(header(8));
    CHECK_FALSE(txn.succeeded);
    CHECK(txn.revision == 8);
  }
  SUBCASE("leases: an expired one's time to live is -1, a grant's error is read") {
    auto ttl = wire::decode_lease_response(header(1) + number(2, 42) + number(3, -1) +
                                           number(4, 10) + bytes(5, "/k"));
    CHECK(ttl.id == 42);
    CHECK(ttl.ttl == -1);
    CHECK(ttl.error.empty());
    CHECK(wire::decode_lease_response(header(1) + number(2, 42)).ttl == 0);
    CHECK(wire::decode_lease_response(bytes(4, "too many leases")).error == "too many leases");
  }
  SUBCASE("writes and deletes") {
    CHECK(wire::decode_change_response(header(30)).revision == 30);
    const auto erased = wire::decode_change_response(header(31) + number(2, 3));
    CHECK(erased.revision == 31);
    CHECK(erased.deleted == 3);
  }
  SUBCASE("watch messages, with fields this reader does not know skipped") {
    auto created = wire::decode_watch_response(header(5) + number(2, 1) + number(3, 1));
    CHECK(created.created);
    CHECK(created.events.empty());
    const std::string unknown = number(99, 5) + varint((100 << 3) | 1) + std::string(8, 'x') +
                                varint((101 << 3) | 5) + std::string(4, 'y');
    auto events = wire::decode_watch_response(
        header(7) + unknown + bytes(11, bytes(2, key_value("/j/r", "{}", 6, 7, 0))) +
        bytes(11, number(1, 1) + bytes(2, bytes(1, "/j/n") + number(3, 7))));
    REQUIRE(events.events.size() == 2);
    CHECK_FALSE(events.events[0].deleted);
    CHECK(events.events[0].kv.value == "{}");
    CHECK(events.events[1].deleted);
    CHECK(events.events[1].kv.key == "/j/n");
    CHECK(events.events[1].kv.mod_revision == 7);
    auto compacted = wire::decode_watch_response(number(4, 1) + number(5, 40));
    CHECK(compacted.canceled);
    CHECK(compacted.compact_revision == 40);
  }
}

TEST_CASE("etcd wire: an answer no etcd sends is an error that names what is wrong") {
  auto problem = [](const std::string& message) -> std::string {
    try {
      wire::decode_watch_response(message);
    } catch (const StoreError& e) {
      return e.what();
    }
    return "";
  };
  CHECK(problem(bytes(11, "")).find("an event without its key") != std::string::npos);
  CHECK(problem(varint((11 << 3) | 2) + varint(50) + "short")
            .find("a length past the end of the message") != std::string::npos);
  CHECK(problem(number(5, 1).substr(0, 1)).find("cut off") != std::string::npos);
  CHECK(problem(varint(5 << 3) + std::string(11, '\xff')).find("over 10 bytes") !=
        std::string::npos);
  CHECK(problem(varint((7 << 3) | 3)).find("unknown wire type") != std::string::npos);
  CHECK(problem(varint(0)).find("field number out of range") != std::string::npos);
  CHECK(problem(bytes(3, "x")).find("another wire type") != std::string::npos);
  CHECK(problem(varint((1 << 3) | 1) + "1234").find("past the end") != std::string::npos);

  // Every cut of a valid answer decodes, or is an error: never a read past
  // its end (the sanitizers' builds see one).
  const std::string range = header(12) + bytes(2, key_value("/j/a", "x", 3, 4, 8));
  const std::string txn = header(12) + number(2, 1) + bytes(3, bytes(1, range));
  for (std::size_t cut = 0; cut <= txn.size(); ++cut) {
    try {
      wire::decode_txn_response(txn.substr(0, cut));
    } catch (const StoreError&) {
    }
  }
}

TEST_CASE("etcd wire: gRPC's framing, fed in any pieces") {
  const std::string one = wire::frame("abc"), two = wire::frame(""),
                    three = wire::frame(std::string(70000, 'z'));
  CHECK(hex(one) == "0000000003616263");
  const std::string stream = one + two + three;
  wire::Deframer deframer;
  std::vector<std::string> got;
  std::string message;
  for (char c : stream) {
    deframer.feed(std::string(1, c));
    while (deframer.next(message)) got.push_back(message);
  }
  REQUIRE(got.size() == 3);
  CHECK(got[0] == "abc");
  CHECK(got[1].empty());
  CHECK(got[2] == std::string(70000, 'z'));
  CHECK(deframer.pending() == 0);

  wire::Deframer compressed;
  compressed.feed(std::string("\1\0\0\0\1x", 6));
  CHECK_THROWS_WITH_AS(compressed.next(message), doctest::Contains("compressed"), StoreError);
  // A length over the limit is refused from its prefix alone.
  wire::Deframer huge;
  huge.feed(std::string("\0\x7f\xff\xff\xff", 5));
  CHECK_THROWS_WITH_AS(huge.next(message), doctest::Contains("over the"), StoreError);
}
