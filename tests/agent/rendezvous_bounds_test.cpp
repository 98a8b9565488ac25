// The bounds of a hosted rendezvous and its secret, on a StoreServer in this
// process (no agents): a MemoryStore refuses keys, values and lease TTLs
// past its limits and stays as it was; everything it may hold fits in one
// read answer; with a secret, only a client that proves it is served,
// a stranger's request has no effect and its connection is closed, and a
// silent one is closed after a few seconds.
#include <doctest/doctest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <string>

#include "ductile/agent/memory_store.hpp"
#include "ductile/agent/store_server.hpp"
#include "ports.hpp"

using namespace ductile::agent;
using namespace std::chrono_literals;

namespace {

bool holds_text(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The message of the StoreError `call` throws ("" when it throws none).
template <class F>
std::string store_error_from(F&& call) {
  try {
    call();
  } catch (const StoreError& e) {
    return e.what();
  }
  return "";
}

int connect_raw(int port) {
  const int fd = ductile::test::connect_loopback(port);
  REQUIRE(fd >= 0);
  return fd;
}

// A put of the agents' protocol, framed, after the protocol's magic.
std::string raw_put(const std::string& key, const std::string& value) {
  std::string body(1, '\x05');  // Op::put
  auto append = [&](auto v) { body.append(reinterpret_cast<const char*>(&v), sizeof v); };
  append(static_cast<std::uint64_t>(key.size()));
  body += key;
  append(static_cast<std::uint64_t>(value.size()));
  body += value;
  append(std::int64_t{0});
  std::string out = "DKV1";
  const auto size = static_cast<std::uint32_t>(body.size());
  out.append(reinterpret_cast<const char*>(&size), sizeof size);
  return out + body;
}

}  // namespace

TEST_CASE("memory store: a lease TTL over etcd's maximum is refused - one at it lives") {
  MemoryStore store("the c10d rendezvous at h:1");
  const std::string refused =
      store_error_from([&] { store.grant_lease(std::numeric_limits<std::int64_t>::max()); });
  CHECK(refused ==
        "the c10d rendezvous at h:1: refused a lease of TTL 9223372036854775807 s: the maximum "
        "is 9000000000 s");
  // At the maximum: alive, with (about) its TTL left, not born expired.
  const auto lease = store.grant_lease(9'000'000'000);
  CHECK(store.lease_remaining(lease) > 8'999'000'000);
  store.put("/k", "v", lease);
  CHECK(store.get("/k").has_value());
  CHECK(store.keep_alive(lease));
}

TEST_CASE("memory store: keys, values and bytes past the limits are refused - nothing changes") {
  MemoryStore::Limits limits;
  limits.max_keys = 3;
  limits.max_value_bytes = 100;
  // "/a"="1" (67 bytes with its 64 of revisions and lease), "/b" of 100
  // bytes (166) and room for 100 more.
  limits.max_bytes = 67 + 166 + 100;
  MemoryStore store("store", limits);
  store.put("/a", "1");
  CHECK(holds_text(store_error_from([&] { store.put("/b", std::string(101, 'x')); }),
                   "store: refused to write /b: its value of 101 bytes is over the 100 bytes a "
                   "value may have"));
  CHECK(holds_text(store_error_from([&] { store.put(std::string(4097, 'k'), "v"); }),
                   "refused to write a key of 4097 bytes: the maximum is 4096"));
  store.put("/b", std::string(100, 'b'));
  CHECK(holds_text(store_error_from([&] { store.put("/c", std::string(100, 'c')); }),
                   "store: refused to write /c: the store would hold 399 bytes, over its maximum "
                   "of 333"));
  store.put("/c", "3");
  CHECK(holds_text(store_error_from([&] { store.put("/d", "4"); }),
                   "store: refused to write /d: the store holds 3 keys, its maximum"));
  CHECK_THROWS_AS(store.compare_and_swap("/d", 0, "4"), StoreError);
  // Nothing of the refused writes; a key held may be rewritten, and room
  // made by a delete (or an expired lease) is taken again.
  CHECK(store.get_prefix("/").size() == 3);
  CHECK(store.get("/b")->value == std::string(100, 'b'));
  store.put("/c", "33");
  store.erase("/b");
  store.put("/d", std::string(100, 'd'));
  CHECK(store.get_prefix("/").size() == 3);
}

TEST_CASE("rendezvous store: all it may hold fits in one read answer of the agents' protocol") {
  auto hosted = std::make_shared<MemoryStore>("hosted");
  StoreServer server("", 0, hosted);
  RendezvousClient client("127.0.0.1", server.port(), 10000ms, "rendezvous");
  // 1 MiB values until the store is full: under the frame of a read.
  const std::string mib(1u << 20, 'x');
  int written = 0;
  std::string refused;
  for (; written < 16 && refused.empty(); ++written)
    refused = store_error_from([&] { client.put("/j/nodes/big" + std::to_string(written), mib); });
  CHECK(holds_text(refused, "over its maximum of 6291456"));
  CHECK(written == 6);
  CHECK(client.get_prefix("/j/nodes/").size() == 5);
  // Two reads of it at once would not fit: an error answer, the
  // connection kept.
  const std::string twice = store_error_from([&] {
    client.read({RangeRead{"/j/", true}, RangeRead{"/j/", true}});
  });
  CHECK(holds_text(twice, "over the 8388608 bytes of a frame: read fewer ranges at once"));
  CHECK(client.get("/j/nodes/big0")->value.size() == mib.size());
  // A value of 5 MiB: refused by the store, not a frame too large.
  CHECK(
      holds_text(store_error_from([&] { client.put("/j/nodes/huge", std::string(5u << 20, 'y')); }),
                 "its value of 5242880 bytes is over the 1048576 bytes a value may have"));
}

TEST_CASE("rendezvous secret: only agents that prove it are served - strangers are closed") {
  auto hosted = std::make_shared<MemoryStore>("hosted");
  StoreServer server("", 0, hosted, StoreLimits{}, "the job's secret");
  const int port = server.port();
  RendezvousClient agent("127.0.0.1", port, 2000ms, "the c10d rendezvous", "the job's secret");
  agent.put("/job/x", "1");
  CHECK(agent.get("/job/x")->value == "1");

  // No secret: refused, by name of the variables; nothing written.
  RendezvousClient stranger("127.0.0.1", port, 2000ms, "the c10d rendezvous");
  try {
    stranger.put("/job/x", "stranger");
    FAIL("a stranger wrote");
  } catch (const StoreRefused& e) {
    CHECK(holds_text(e.what(),
                     "the c10d rendezvous: this rendezvous admits the agents of its job "
                     "only, and this agent gave no proof of the job's secret: give every "
                     "agent of the job the same DUCTILE_RDZV_SECRET or "
                     "DUCTILE_RDZV_SECRET_FILE"));
  }
  // Another secret: the host's proof does not match (the agent never
  // sends a proof the host could learn from).
  RendezvousClient other("127.0.0.1", port, 2000ms, "the c10d rendezvous", "another secret");
  try {
    other.put("/job/x", "other");
    FAIL("an agent with another secret wrote");
  } catch (const StoreRefused& e) {
    CHECK(holds_text(e.what(),
                     "the host's proof of the secret does not match this agent's: the "
                     "secrets differ"));
  }
  // A raw put without the proof: an unauthorized answer, then closed.
  int fd = connect_raw(port);
  const std::string put = raw_put("/job/x", "raw");
  REQUIRE(send(fd, put.data(), put.size(), 0) == static_cast<ssize_t>(put.size()));
  std::string answer;
  CHECK(ductile::test::closed_by_peer(fd, 30s, &answer));
  close(fd);
  REQUIRE(answer.size() > 5);
  CHECK(answer[4] == '\x02');  // Status::unauthorized
  CHECK(agent.get("/job/x")->value == "1");

  // A host without a secret and an agent with one: refused too (the agent
  // would trust a host that proves nothing).
  StoreServer open_server("", 0, std::make_shared<MemoryStore>("open"));
  RendezvousClient holder("127.0.0.1", open_server.port(), 2000ms, "the c10d rendezvous",
                          "the job's secret");
  CHECK(holds_text(store_error_from([&] { holder.get("/x"); }),
                   "the host has no secret and this agent has one: the secrets differ"));
  RendezvousClient plain("127.0.0.1", open_server.port(), 2000ms, "the c10d rendezvous");
  plain.put("/x", "1");

  // Silent after the magic: closed once the proof's time is up (5 s).
  fd = connect_raw(port);
  REQUIRE(send(fd, "DKV1", 4, 0) == 4);
  const auto silent_since = std::chrono::steady_clock::now();
  CHECK(ductile::test::closed_by_peer(fd, 60s));
  CHECK(std::chrono::steady_clock::now() - silent_since >= 4s);
  close(fd);
  CHECK(agent.get("/job/x")->value == "1");
}
