// A job's snapshot ports under a stranger's idle connections: two agents
// with the job's secret replicate each other's snapshot while the test,
// from another address, holds 200 connections to each agent's snapshot
// port that never prove anything (and opens a new one whenever a server
// cuts one). Real agents, a real etcd, the stranger's client written here.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../agent/src/snapshot_server.hpp"
#include "agent_job.hpp"
#include "ductile/agent/etcd_store.hpp"
#include "process.hpp"
#include "snapshot_worker.hpp"

using namespace ductile::test;
using namespace std::chrono_literals;

// Not an anonymous namespace: a unity build puts this file beside other
// tests, whose helpers' names would clash.
namespace snapshot_port_hostile_test {

// A connection from 127.0.0.2 (another host, to the agents on 127.0.0.1)
// to 127.0.0.1:port that sends nothing; -1 when it cannot be made.
int stranger_connection(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, "127.0.0.2", &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<std::uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0 ||
      (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0 && errno != EINPROGRESS)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The stranger: `per_port` idle connections to each port, each opened again
// when the server closes it, until stopped. Counts the connections the
// servers closed.
class IdleStranger {
 public:
  IdleStranger(std::vector<int> ports, std::size_t per_port)
      : thread_([this, ports, per_port] { run(ports, per_port); }) {}
  ~IdleStranger() {
    stop_ = true;
    thread_.join();
  }
  std::size_t cut() const { return cut_; }
  std::size_t opened() const { return opened_; }

 private:
  void run(const std::vector<int>& ports, std::size_t per_port) {
    std::vector<std::pair<int, int>> held;  // socket, port
    for (int port : ports)
      for (std::size_t i = 0; i < per_port; ++i)
        if (int fd = stranger_connection(port); fd >= 0) {
          held.emplace_back(fd, port);
          ++opened_;
        }
    while (!stop_) {
      std::vector<pollfd> polled;
      for (const auto& [fd, port] : held) polled.push_back({fd, POLLIN | POLLRDHUP, 0});
      ::poll(polled.data(), polled.size(), 50);
      for (std::size_t i = 0; i < held.size(); ++i) {
        if (!(polled[i].revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR))) continue;
        char byte;
        if (::recv(held[i].first, &byte, 1, MSG_DONTWAIT) > 0) continue;
        ::close(held[i].first);
        ++cut_;
        held[i].first = stranger_connection(held[i].second);
        if (held[i].first >= 0) ++opened_;
      }
      std::erase_if(held, [](const auto& h) { return h.first < 0; });
    }
    for (const auto& h : held) ::close(h.first);
  }

  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> cut_{0}, opened_{0};
  std::thread thread_;
};

}  // namespace snapshot_port_hostile_test

using namespace snapshot_port_hostile_test;

// Each worker waits for the test's go, commits a snapshot of its rank's
// shard with one replica, and waits at most 30 s for the other node's
// replica to arrive in its area; it copies both out for the test. Before
// the go, the stranger holds 200 idle connections to each agent's snapshot
// port, and keeps holding as many. A server that let them hold its slots
// would make the copies wait for them to time out, one slot at a time,
// far past 30 s.
TEST_CASE("agent: replicas copied while a stranger holds 200 idle connections to each port") {
  TempDir dir;
  const std::string marker = new_marker();
  EtcdServer etcd(dir.path());
  auto config = dir.write("job.toml", kJobToml);
  const auto shm = dir / "shm";
  const auto out = dir / "out";
  std::filesystem::create_directories(shm);
  std::filesystem::create_directories(out);
  const std::string worker = replicating_worker(R"sh(i=0
until [ -f "$OUT/go" ]; do
  i=$((i+1)); [ $i -lt 1800 ] || { echo "no go after 180 s"; exit 5; }; sleep 0.1
done
)sh",
                                                30);
  auto agent_argv = [&](const std::string& name) {
    return std::vector<std::string>{DUCTILE_CLI,
                                    "agent",
                                    "--config",
                                    config.string(),
                                    "--rdzv",
                                    etcd.url(),
                                    "--job-id",
                                    "hostile",
                                    "--node-id",
                                    name,
                                    "--node-addr",
                                    "127.0.0.1",
                                    "--nproc-per-node",
                                    "1",
                                    "--min-nodes",
                                    "2",
                                    "--settle",
                                    "0",
                                    "--lease-ttl",
                                    "2",
                                    "--snapshot-dir",
                                    shm.string(),
                                    "--",
                                    "/bin/sh",
                                    "-c",
                                    worker};
  };
  const std::vector<std::string> env = {marker, "OUT=" + out.string(),
                                        "DUCTILE_RDZV_SECRET=the job's secret"};
  Child a(agent_argv("a"), env, dir / "a.log");
  Child b(agent_argv("b"), env, dir / "b.log");

  // Each agent's snapshot port, from its registration in etcd.
  ductile::agent::EtcdStore store(etcd.endpoint(), 2000ms);
  std::map<std::string, int> ports;
  const bool published = wait_until(
      [&] {
        for (const char* node : {"a", "b"})
          if (auto record = store.get(std::string("/ductile/agent/hostile/nodes/") + node))
            ports[node] = nlohmann::json::parse(record->value).at("snapshot_port").get<int>();
        return ports.size() == 2;
      },
      120s);
  if (!published) std::cout << a.output() << b.output();
  REQUIRE(published);

  std::size_t cut = 0, opened = 0;
  double took = 0;
  {
    IdleStranger stranger({ports["a"], ports["b"]}, 200);
    REQUIRE(wait_until([&] { return stranger.opened() >= 400; }, 30s));
    const auto go = Clock::now();
    dir.write("out/go", "go\n");
    const bool replicated = wait_until(
        [&] {
          return std::filesystem::exists(out / "a" / "replica") &&
                 std::filesystem::exists(out / "b" / "replica");
        },
        60s);
    took = seconds_since(go);
    cut = stranger.cut();
    opened = stranger.opened();
    if (!replicated) std::cout << a.output() << b.output();
    REQUIRE(replicated);
  }
  std::cout << "replicas of 2 nodes copied in " << took << " s beside 200 idle connections to "
            << "each snapshot port (" << opened << " opened, " << cut << " cut by the servers)\n";
  // The servers kept 8 of the stranger's connections each and cut the
  // rest as they came.
  CHECK(cut >= 2 * (200 - ductile::agent::kMaxSnapshotUnprovenPerAddress));
  for (const auto& [holder, origin] : {std::pair{"a", "b"}, std::pair{"b", "a"}}) {
    INFO("node " << holder << " holds node " << origin << "'s snapshot");
    const auto original = read_text(out / origin / "own.bin");
    CHECK(original.size() == 300000);
    std::string copied;
    for (const auto& entry : std::filesystem::directory_iterator(out / holder / "replica"))
      if (entry.path().filename().string().starts_with("rank")) copied = read_text(entry.path());
    const bool same = copied == original;
    CHECK(same);
  }
  dir.write("out/release", "1\n");
  auto sa = a.wait(120s), sb = b.wait(120s);
  if (sa != std::optional<int>(0) || sb != std::optional<int>(0))
    std::cout << a.output() << b.output();
  CHECK(sa == std::optional<int>(0));
  CHECK(sb == std::optional<int>(0));
  CHECK(no_marked_processes(marker));
}
