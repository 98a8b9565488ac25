// The stores an agent holds and serves (no etcd): a MemoryStore has etcd's
// semantics and answers the same through a StoreServer to a
// RendezvousClient; torch's own TCPStore client gets from a StoreServer
// what torch's server answers it; a reset empties the workers' store; a
// client that breaks the protocol is dropped and the server goes on; a
// host that is gone is told apart from one not reached yet.
#include <doctest/doctest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <sstream>
#include <thread>

#include "ductile/agent/memory_store.hpp"
#include "ductile/agent/store_server.hpp"
#include "ports.hpp"
#include "process.hpp"

using namespace ductile::agent;
using namespace std::chrono_literals;

namespace {

std::string show(const std::vector<KeyValue>& kvs) {
  std::ostringstream out;
  for (const auto& kv : kvs)
    out << kv.key << "=" << kv.value << "@" << kv.create_revision << "/" << kv.mod_revision
        << (kv.lease ? "+lease" : "") << " ";
  return out.str();
}

// The same operations on any store; what each answered, one line each.
std::vector<std::string> exercise(KeyValueStore& store) {
  std::vector<std::string> out;
  store.put("/a/1", "one");
  store.put("/a/2", "two");
  store.put("/b", "bee");
  out.push_back(show(store.get_prefix("/a/")));
  auto one = store.get("/a/1");
  REQUIRE(one);
  out.push_back(std::to_string(store.compare_and_swap("/a/1", one->mod_revision + 1, "x")));
  out.push_back(std::to_string(store.compare_and_swap("/a/1", one->mod_revision, "uno")));
  out.push_back(std::to_string(store.compare_and_swap("/c", 0, "new")));
  out.push_back(std::to_string(store.compare_and_swap("/c", 0, "again")));
  // A key written again keeps its create revision; erased and written, a new one.
  store.put("/a/2", "zwei");
  store.erase("/a/2");
  store.put("/a/2", "deux");
  out.push_back(show(store.get_prefix("/a/")));
  const std::int64_t lease = store.grant_lease(2);
  store.put("/l/x", "leased", lease);
  store.put("/l/y", "leased too", lease);
  out.push_back(show(store.get_prefix("/l/")));
  out.push_back(std::to_string(store.lease_remaining(lease) >= 1));
  auto reads = store.read({RangeRead{"/a/", true, 1, true}, RangeRead{"/b"}, RangeRead{"/none"}});
  for (const auto& r : reads) out.push_back(show(r));
  store.revoke_lease(lease);
  out.push_back(show(store.get_prefix("/l/")) + "|" + std::to_string(store.lease_remaining(lease)) +
                "|" + std::to_string(store.keep_alive(lease)));
  try {
    store.put("/l/z", "on a revoked lease", lease);
    out.push_back("put on a revoked lease accepted");
  } catch (const StoreError&) {
    out.push_back("put on a revoked lease refused");
  }
  store.erase_prefix("/a/");
  out.push_back(show(store.get_prefix("/")));
  return out;
}

// A raw TCP connection to the server, for bytes no client sends.
int connect_to(int port) {
  const int fd = ductile::test::connect_loopback(port);
  REQUIRE(fd >= 0);
  return fd;
}

}  // namespace

TEST_CASE(
    "memory store: etcd's revisions, leases and compare-and-swap - the same through a server") {
  MemoryStore local("local");
  const auto direct = exercise(local);
  CHECK(direct[1] == "0");  // a stale revision
  CHECK(direct[2] == "1");
  CHECK(direct[3] == "1");  // created
  CHECK(direct[4] == "0");  // exists
  CHECK(direct[5].find("/a/1=uno@") == 0);
  CHECK(direct[7] == "1");
  CHECK(direct[8].find("/a/1=uno") == 0);  // the oldest of /a/, one
  CHECK(direct[8].find("/a/2") == std::string::npos);
  CHECK(direct[9].find("/b=bee") == 0);
  CHECK(direct[10].empty());
  CHECK(direct[11] == "|-1|0");  // the lease's keys went with it
  CHECK(direct[12] == "put on a revoked lease refused");
  CHECK(direct[13].find("/a/") == std::string::npos);

  auto hosted = std::make_shared<MemoryStore>("hosted");
  StoreServer server("", 0, hosted);
  RendezvousClient client("127.0.0.1", server.port(), 2000ms, "the test's rendezvous");
  CHECK(exercise(client) == direct);
  CHECK(client.describe() == "the test's rendezvous");

  // A lease not renewed expires and takes its key; one renewed lives on.
  const std::int64_t dying = client.grant_lease(1), living = client.grant_lease(5);
  client.put("/dying", "x", dying);
  client.put("/living", "y", living);
  const auto granted = std::chrono::steady_clock::now();
  bool expired = false;
  while (!expired && std::chrono::steady_clock::now() - granted < 30s) {
    CHECK(client.keep_alive(living));
    expired = !client.get("/dying");
    std::this_thread::sleep_for(100ms);
  }
  CHECK(expired);
  CHECK(std::chrono::steady_clock::now() - granted >= 1s);
  CHECK(client.get("/living"));
  CHECK_FALSE(client.keep_alive(dying));
}

TEST_CASE("store server: torch's TCPStore client gets torch's own server's answers") {
  StoreServer server("", 0, nullptr);
  auto r = ductile::test::run_process({DUCTILE_PYTHON, DUCTILE_AGENT_WORKERS "/tcpstore_ops.py",
                                       "127.0.0.1", std::to_string(server.port())});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("DIFFERS") == std::string::npos);
  for (const char* op : {"ok get:", "ok add:", "ok compare_set right:", "ok wait:",
                         "ok wait timeout:", "ok queue_pop waits:", "ok list_keys:", "ok clone:"})
    CHECK(r.out.find(op) != std::string::npos);
}

TEST_CASE("store server: a reset empties the workers' store and drops their connections") {
  auto hosted = std::make_shared<MemoryStore>("hosted");
  StoreServer server("", 0, hosted);
  RendezvousClient agent("127.0.0.1", server.port(), 2000ms, "rendezvous");
  agent.put("/kept", "across resets");
  // A worker's connection: validated, then SET "k" = "v".
  int worker = connect_to(server.port());
  std::string hello(1, '\0');
  const std::uint32_t magic = 0x3C85F7CE;
  hello.append(reinterpret_cast<const char*>(&magic), sizeof magic);
  std::string set(1, '\1');
  const std::uint64_t one = 1;
  for (const char* field : {"k", "v"}) {
    set.append(reinterpret_cast<const char*>(&one), sizeof one);
    set += field;
  }
  std::string num_keys(1, '\7');
  std::string all = hello + set + num_keys;
  REQUIRE(send(worker, all.data(), all.size(), 0) == static_cast<ssize_t>(all.size()));
  std::int64_t count = -1;
  REQUIRE(recv(worker, &count, sizeof count, MSG_WAITALL) == sizeof count);
  CHECK(count == 1);
  server.reset_worker_store();
  CHECK(ductile::test::closed_by_peer(worker, 10s));
  close(worker);
  // A new worker finds the store empty; the agents' store is untouched.
  worker = connect_to(server.port());
  all = hello + num_keys;
  REQUIRE(send(worker, all.data(), all.size(), 0) == static_cast<ssize_t>(all.size()));
  REQUIRE(recv(worker, &count, sizeof count, MSG_WAITALL) == sizeof count);
  CHECK(count == 0);
  close(worker);
  CHECK(agent.get("/kept")->value == "across resets");
}

TEST_CASE("store server: clients that break the protocol are dropped - the others are served") {
  auto hosted = std::make_shared<MemoryStore>("hosted");
  StoreServer server("", 0, hosted);
  RendezvousClient agent("127.0.0.1", server.port(), 2000ms, "rendezvous");
  agent.put("/x", "1");
  const std::vector<std::string> garbage = {
      std::string("GET / HTTP/1.1\r\n\r\n"),     // neither protocol
      std::string("\0\1\2\3\4", 5),              // a wrong validation number
      std::string("\0\xce\xf7\x85\x3c\x63", 6),  // an unknown command
      std::string("\0\xce\xf7\x85\x3c\x01\xff\xff\xff\xff\xff\xff\xff\x7f", 14),  // a key of 2^63
      std::string("DKV1\xff\xff\xff\x7f", 8),           // a frame over the limit
      std::string("DKV1\x01\x00\x00\x00\x63", 9),       // an unknown operation
      std::string("DKV1\x02\x00\x00\x00\x01\x00", 10),  // a request cut short
  };
  for (const auto& bytes : garbage) {
    int fd = connect_to(server.port());
    REQUIRE(send(fd, bytes.data(), bytes.size(), 0) == static_cast<ssize_t>(bytes.size()));
    INFO(bytes.size() << " bytes");
    CHECK(ductile::test::closed_by_peer(fd, 10s));
    close(fd);
  }
  // Half a message, then the client goes away: nothing waits for it.
  int fd = connect_to(server.port());
  REQUIRE(send(fd, "DKV1\x10\x00", 6, 0) == 6);
  close(fd);
  CHECK(agent.get("/x")->value == "1");
  // No agents' protocol on a workers' store.
  StoreServer workers_only("", 0, nullptr);
  RendezvousClient wrong("127.0.0.1", workers_only.port(), 2000ms, "workers' store");
  CHECK_THROWS_AS(wrong.get("/x"), StoreUnavailable);
}

TEST_CASE(
    "rendezvous client: a host not up yet is unavailable - one that answered and left is gone") {
  const int port = ductile::test::free_tcp_port();
  RendezvousClient client("127.0.0.1", port, 1000ms, "the c10d rendezvous");
  try {
    client.get("/x");
    FAIL("no server, yet an answer");
  } catch (const StoreGone&) {
    FAIL("a host never reached is not gone");
  } catch (const StoreUnavailable& e) {
    CHECK(std::string(e.what()).find("the c10d rendezvous: cannot connect to 127.0.0.1:") == 0);
  }
  {
    StoreServer server("", port, std::make_shared<MemoryStore>("hosted"));
    client.put("/x", "1");
    CHECK(client.get("/x")->value == "1");
    // Its port is taken while it serves.
    CHECK_THROWS_AS(StoreServer("", port, nullptr), std::system_error);
  }
  CHECK_THROWS_AS(client.get("/x"), StoreGone);
}
