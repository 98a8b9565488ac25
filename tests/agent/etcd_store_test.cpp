// EtcdStore against a real etcd started by the test.
#include <doctest/doctest.h>

#include <signal.h>

#include <sstream>

#include "agent_support.hpp"
#include "ductile/agent/etcd_store.hpp"
#include "ductile/error.hpp"
#include "temp_dir.hpp"

using namespace ductile;
using namespace ductile::test;

TEST_CASE("etcd store: put prefix reads compare-and-swap leases that expire") {
  TempDir dir;
  EtcdServer etcd(dir.path());
  agent::EtcdStore store(etcd.endpoint());
  CHECK(store.describe() == "etcd at " + etcd.endpoint());

  store.put("/t/a", "1");
  store.put("/t/b", std::string("bin\0ary\xff", 8));
  store.put("/u/c", "3");
  auto kvs = store.get_prefix("/t/");
  REQUIRE(kvs.size() == 2);
  CHECK(kvs[0].key == "/t/a");
  CHECK(kvs[1].value == std::string("bin\0ary\xff", 8));
  CHECK(kvs[0].create_revision < kvs[1].create_revision);

  // Compare-and-swap: 0 means "absent"; a stale revision loses.
  CHECK_FALSE(store.compare_and_swap("/t/a", 0, "x"));
  CHECK(store.compare_and_swap("/t/new", 0, "first"));
  auto current = store.get("/t/new");
  REQUIRE(current);
  CHECK(store.compare_and_swap("/t/new", current->mod_revision, "second"));
  CHECK_FALSE(store.compare_and_swap("/t/new", current->mod_revision, "third"));
  CHECK(store.get("/t/new")->value == "second");

  // Several reads in one: a key, the oldest keys of a prefix (by create
  // revision, not key order), a key that is absent.
  store.put("/o/z", "first");
  store.put("/o/a", "second");
  store.put("/o/m", "third");
  store.put("/o/z", "first again");  // keeps its create revision
  auto reads = store.read({agent::RangeRead{"/u/c"}, agent::RangeRead{"/o/", true, 2, true},
                           agent::RangeRead{"/o/", true}, agent::RangeRead{"/o/absent"}});
  REQUIRE(reads.size() == 4);
  REQUIRE(reads[0].size() == 1);
  CHECK(reads[0][0].value == "3");
  REQUIRE(reads[1].size() == 2);
  CHECK(reads[1][0].key == "/o/z");
  CHECK(reads[1][0].value == "first again");
  CHECK(reads[1][1].key == "/o/a");
  REQUIRE(reads[2].size() == 3);
  CHECK(reads[2][0].key == "/o/a");
  CHECK(reads[2][2].key == "/o/z");
  CHECK(reads[3].empty());
  CHECK(store.read({}).empty());

  // A compare-and-swap with reads in the same request: they see the write
  // (the key's create revision) and the state of its revision; a swap that
  // loses reads nothing.
  const auto joined = store.compare_and_swap_then_read(
      "/o/new", 0, "fourth", 0,
      {agent::RangeRead{"/o/new"}, agent::RangeRead{"/o/", true, 2, true}});
  REQUIRE(joined);
  REQUIRE(joined->size() == 2);
  REQUIRE((*joined)[0].size() == 1);
  CHECK((*joined)[0][0].value == "fourth");
  CHECK((*joined)[0][0].create_revision == store.changed_at());
  REQUIRE((*joined)[1].size() == 2);
  CHECK((*joined)[1][0].key == "/o/z");
  CHECK_FALSE(store.compare_and_swap_then_read("/o/new", 0, "fifth", 0, {agent::RangeRead{"/o/"}}));
  CHECK(store.get("/o/new")->value == "fourth");
  const auto no_reads = store.compare_and_swap_then_read("/o/other", 0, "sixth", 0, {});
  REQUIRE(no_reads);
  CHECK(no_reads->empty());

  store.erase_prefix("/t/");
  CHECK(store.get_prefix("/t/").empty());
  CHECK(store.get("/u/c"));

  // A key on a lease that is not renewed disappears; a revoked lease at once.
  auto lease = store.grant_lease(2);
  store.put("/l/short", "v", lease);
  CHECK(store.get("/l/short")->lease == lease);
  CHECK(store.keep_alive(lease));
  CHECK(store.lease_remaining(lease) >= 0);  // whole seconds left: 1 or 0
  CHECK(store.lease_remaining(lease) <= 2);
  CHECK(wait_until([&] { return !store.get("/l/short"); }, 20s));
  CHECK_FALSE(store.keep_alive(lease));
  CHECK(store.lease_remaining(lease) == -1);
  auto second = store.grant_lease(30);
  store.put("/l/long", "v", second);
  store.revoke_lease(second);
  CHECK_FALSE(store.get("/l/long"));
  store.revoke_lease(second);  // already gone: no error
}

namespace etcd_store_test {

// The streams etcd started for `method` ("LeaseKeepAlive"), from its
// /metrics.
double streams_started(const EtcdServer& etcd, const std::string& method) {
  auto r = run_process({"curl", "-s", "--max-time", "10", etcd.endpoint() + "/metrics"});
  REQUIRE(r.exit_code == 0);
  std::istringstream lines(r.out);
  double total = 0;
  for (std::string line; std::getline(lines, line);)
    if (line.starts_with("grpc_server_started_total{") &&
        line.find("grpc_method=\"" + method + "\"") != std::string::npos)
      total += std::stod(line.substr(line.rfind(' ')));
  return total;
}

}  // namespace etcd_store_test

TEST_CASE("etcd store: lease renewals on one stream - a lost lease, a stopped and a new etcd") {
  using etcd_store_test::streams_started;
  TempDir dir;
  EtcdServer etcd(dir.path());
  agent::EtcdStore store(etcd.endpoint(), std::chrono::milliseconds(1000));
  const auto lease = store.grant_lease(60);
  for (int i = 0; i < 20; ++i) CHECK(store.keep_alive(lease));
  CHECK(streams_started(etcd, "LeaseKeepAlive") == 1);
  // A lease that is gone is said on the stream, which goes on.
  const auto gone = store.grant_lease(60);
  store.revoke_lease(gone);
  CHECK_FALSE(store.keep_alive(gone));
  CHECK(store.keep_alive(lease));
  CHECK(streams_started(etcd, "LeaseKeepAlive") == 1);

  // A stopped etcd: the renewal gives up after the store's timeout; once
  // it runs again a renewal succeeds, on a new stream (the answer the
  // stopped one owes is never taken for a later renewal's).
  REQUIRE(kill(etcd.pid(), SIGSTOP) == 0);
  const auto asked = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(store.keep_alive(lease), agent::StoreTimeout);
  CHECK(std::chrono::steady_clock::now() - asked < 5s);
  REQUIRE(kill(etcd.pid(), SIGCONT) == 0);
  CHECK(store.keep_alive(lease));
  CHECK_FALSE(store.keep_alive(gone));
  CHECK(store.keep_alive(lease));
  CHECK(streams_started(etcd, "LeaseKeepAlive") == 2);

  // etcd restarted: its stream is gone; the renewals go on once it is back
  // (a lease outlives a restart).
  etcd.stop();
  CHECK_THROWS_AS(store.keep_alive(lease), agent::StoreUnavailable);
  etcd.start();
  CHECK(wait_until(
      [&] {
        try {
          return store.keep_alive(lease);
        } catch (const agent::StoreUnavailable&) {
          return false;
        }
      },
      20s));
  // The new etcd started one stream per renewal that reached it before one
  // succeeded (one, unless it was not ready yet); the renewals after it
  // all go on that one.
  const double streams = streams_started(etcd, "LeaseKeepAlive");
  CHECK(streams >= 1);
  for (int i = 0; i < 10; ++i) CHECK(store.keep_alive(lease));
  CHECK(streams_started(etcd, "LeaseKeepAlive") == streams);
}

TEST_CASE("etcd store: an unreachable server and bad addresses") {
  agent::EtcdStore store("http://127.0.0.1:" + std::to_string(free_tcp_port()),
                         std::chrono::milliseconds(500));
  CHECK_THROWS_AS(store.get("/x"), agent::StoreUnavailable);
  CHECK(agent::etcd_endpoint_from_url("etcd://10.1.2.3:2379", "--rdzv") == "http://10.1.2.3:2379");
  CHECK(agent::etcd_endpoint_from_url("https://etcd.example:2379/", "--rdzv") ==
        "https://etcd.example:2379");
  CHECK_THROWS_WITH_AS(agent::etcd_endpoint_from_url("tcp://host", "--rdzv"),
                       doctest::Contains("--rdzv 'tcp://host' is not an etcd address"),
                       ductile::Error);
  CHECK_THROWS_AS(agent::etcd_endpoint_from_url("etcd://host:99999", "--rdzv"), ductile::Error);
}
