// The snapshot server under strangers' connections: idle connections that
// never prove anything, from one address or from many, do not hold up a
// copy by one of the job's agents (snapshot_server.hpp), and the copy's
// own connection is never cut for them.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "../../agent/src/snapshot_area.hpp"
#include "../../agent/src/snapshot_server.hpp"
#include "../../agent/src/store_wire.hpp"
#include "temp_dir.hpp"

using namespace ductile::agent;
namespace fs = std::filesystem;

// Not an anonymous namespace: a unity build puts this file beside other
// tests, whose helpers' names would clash.
namespace snapshot_server_test {

using Clock = std::chrono::steady_clock;

// A connection to 127.0.0.1:port from `source` (an address of the
// loopback's 127/8, each a host of its own to the server) that sends
// nothing: a stranger that holds a connection and never proves anything.
int idle_connection(const std::string& source, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  REQUIRE(::inet_pton(AF_INET, source.c_str(), &from.sin_addr) == 1);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) == 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<std::uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0);
  return fd;
}

// How many of `fds` the server has closed (end of stream, or reset), once
// `closed` of them are, or when `wait` has passed.
std::size_t closed_by_server(const std::vector<int>& fds, std::size_t closed,
                             std::chrono::milliseconds wait) {
  const auto until = Clock::now() + wait;
  std::vector<bool> ended(fds.size(), false);
  std::size_t count = 0;
  for (;;) {
    std::vector<pollfd> polled;
    for (int fd : fds) polled.push_back({fd, POLLIN | POLLRDHUP, 0});
    ::poll(polled.data(), polled.size(), 50);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (ended[i] || !polled[i].revents) continue;
      char byte;
      if (::recv(fds[i], &byte, 1, MSG_DONTWAIT) <= 0) {
        ended[i] = true;
        ++count;
      }
    }
    if (count >= closed || Clock::now() >= until) return count;
  }
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct Served {
  ductile::test::TempDir base;
  SnapshotArea area{base.path().string(), "job", "node-a"};
  SnapshotArea copies{base.path().string(), "job", "node-b"};
  const std::string secret = "the job's secret";
  const std::string shard = std::string(1 << 20, 's');
  SnapshotServer server{area.root(), "127.0.0.1", secret};
  int copied = 0;

  Served() {
    fs::create_directories(area.own() / "step5");
    std::ofstream(area.own() / "step5" / "rank0-of-1.bin", std::ios::binary) << shard;
  }
  // One copy by a job's agent; its time.
  std::chrono::milliseconds copy() {
    const fs::path dest = copies.restore() / ("copy" + std::to_string(copied++));
    const auto started = Clock::now();
    REQUIRE(fetch_file("127.0.0.1", server.port(), "own/step5/rank0-of-1.bin", dest, secret,
                       std::chrono::seconds(30)) == shard.size());
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started);
    const bool same = read_file(dest) == shard;
    CHECK(same);
    return took;
  }
};

}  // namespace snapshot_server_test

using namespace snapshot_server_test;

TEST_CASE("snapshot server: a stranger's idle connections from one address never starve a copy") {
  Served s;
  const auto unloaded = s.copy();
  std::vector<int> strangers;
  for (int i = 0; i < 200; ++i) strangers.push_back(idle_connection("127.0.0.2", s.server.port()));
  // The server keeps kMaxSnapshotUnprovenPerAddress of that address's
  // connections, the newest, and cut every older one as the next came.
  const std::size_t cut = strangers.size() - kMaxSnapshotUnprovenPerAddress;
  CHECK(closed_by_server(strangers, cut, std::chrono::seconds(10)) == cut);
  const auto loaded = s.copy();
  // The copy did not wait for the kept ones to time out: they are open
  // still (their handshake time is wire::kProofTimeout), and no more of
  // them is closed.
  std::vector<int> kept(strangers.end() - kMaxSnapshotUnprovenPerAddress, strangers.end());
  CHECK(closed_by_server(kept, 1, std::chrono::milliseconds(0)) == 0);
  std::cout << "snapshot copy of 1 MiB: " << unloaded.count() << " ms alone, " << loaded.count()
            << " ms beside 200 idle connections of one stranger\n";
  for (int fd : strangers) ::close(fd);
}

TEST_CASE("snapshot server: idle connections from many addresses never starve a copy") {
  Served s;
  std::vector<int> strangers;
  for (int i = 0; i < 200; ++i)
    strangers.push_back(idle_connection("127.0.1." + std::to_string(1 + i), s.server.port()));
  // kMaxSnapshotUnproven of them are kept, and the copy's connection cuts
  // the oldest of those in turn.
  const std::size_t cut = strangers.size() - kMaxSnapshotUnproven;
  CHECK(closed_by_server(strangers, cut, std::chrono::seconds(10)) == cut);
  const auto loaded = s.copy();
  CHECK(closed_by_server(strangers, cut + 1, std::chrono::seconds(10)) == cut + 1);
  // The others are open: the copy did not wait for them to time out.
  std::vector<int> newest(strangers.end() - (kMaxSnapshotUnproven - 1), strangers.end());
  CHECK(closed_by_server(newest, 1, std::chrono::milliseconds(0)) == 0);
  std::cout << "snapshot copy of 1 MiB beside 200 idle connections of 200 addresses: "
            << loaded.count() << " ms\n";
  for (int fd : strangers) ::close(fd);
  // A copy after they are gone is served as before.
  s.copy();
}
