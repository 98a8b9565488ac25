// In-memory snapshots, the agent's pieces: the snapshot area made private
// (and refused when it is not the agent's), its committed snapshots
// listed, its files served to another agent over loopback (and every path
// that is not a snapshot file refused, as is an agent without the job's
// secret), a node's snapshots replicated into another's area (pulled
// when the origin announces a commit, acknowledged back into its
// own/replicated; a malformed announcement refused; a stalled pull never
// holding up the server), a restore's file taken from its next holder, a
// dead agent's area removed at the next agent's start, and the workers'
// environment that names the snapshot folders. The
// snapshot folders are written here in the workers' checkpoint layout;
// SHA-256 sums come from sha256sum, not from the code under test.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../agent/src/agent_common.hpp"
#include "../../agent/src/snapshot_area.hpp"
#include "../../agent/src/snapshot_replication.hpp"
#include "../../agent/src/snapshot_server.hpp"
#include "ductile/error.hpp"
#include "process.hpp"
#include "temp_dir.hpp"

using namespace ductile::agent;
namespace fs = std::filesystem;

// Not an anonymous namespace: a unity build puts this file beside other
// tests, whose helpers' names would clash.
namespace snapshot_area_test {

std::string random_bytes(std::size_t size, unsigned seed) {
  std::mt19937 random(seed);
  std::string bytes(size, '\0');
  for (auto& b : bytes) b = static_cast<char>(random() & 0xff);
  return bytes;
}

void write_file(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string sha256sum(const fs::path& file) {
  auto r = ductile::test::run_process({"sha256sum", file.string()});
  REQUIRE(r.exit_code == 0);
  return r.out.substr(0, 64);
}

std::string rank_file(int rank, int world) {
  return "rank" + std::to_string(rank) + "-of-" + std::to_string(world) + ".bin";
}

// A snapshot of `step` as the workers of one node write it into their
// root: the shard files of `ranks` (of `world`; rank r's of `shard_bytes`
// + 37 r + step bytes), the manifest listing every rank's shard and its
// size, its sidecar; `latest` names it when `commit`. Returns the
// manifest's SHA-256.
std::string write_snapshot(const fs::path& root, std::int64_t step, int world,
                           const std::vector<int>& ranks, bool commit,
                           std::size_t shard_bytes = 1000) {
  const std::string tag = "step" + std::to_string(step);
  nlohmann::json shards = nlohmann::json::array();
  for (int r = 0; r < world; ++r) {
    const std::size_t size =
        shard_bytes + 37 * static_cast<std::size_t>(r) + static_cast<std::size_t>(step);
    shards.push_back({{"file", rank_file(r, world)}, {"bytes", size}, {"crc32", 0}});
    if (std::find(ranks.begin(), ranks.end(), r) != ranks.end())
      write_file(root / tag / rank_file(r, world),
                 random_bytes(size, static_cast<unsigned>(step * 100 + r)));
  }
  const nlohmann::json manifest = {{"format", "ductile-zero3-checkpoint"},
                                   {"version", 3},
                                   {"step", step},
                                   {"tag", tag},
                                   {"world_size", world},
                                   {"shards", shards}};
  write_file(root / tag / "manifest.json", manifest.dump(1));
  const std::string sha = sha256sum(root / tag / "manifest.json");
  write_file(root / tag / "manifest.json.sha256", sha + "  manifest.json\n");
  if (commit) write_file(root / "latest", tag + "\nsha256 " + sha + "\n");
  return sha;
}

NodeIdentity identity(const std::string& id) {
  return NodeIdentity{"/ductile/agent/test/", id, "127.0.0.1"};
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ductile::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace snapshot_area_test

using namespace snapshot_area_test;

TEST_CASE("snapshot area: private, each agent's own, removed at the end") {
  ductile::test::TempDir base;
  fs::path root;
  {
    SnapshotArea area(base.path().string(), "job1", "node-a");
    root = area.root();
    CHECK(root.parent_path() == base.path());
    CHECK(root.filename().string().starts_with("ductile-snapshots-job1-node-a-"));
    struct stat info {};
    REQUIRE(::lstat(root.c_str(), &info) == 0);
    CHECK(S_ISDIR(info.st_mode));
    CHECK((info.st_mode & 07777) == 0700);
    for (const char* part : {"own", "replicas", "restore"}) CHECK(fs::is_directory(root / part));
    // Two agents of one job and node id (a restart, concurrent tests): one
    // area each.
    SnapshotArea twin(base.path().string(), "job1", "node-a");
    CHECK(twin.root() != root);
    CHECK(fs::is_directory(root / "own"));
    write_file(area.own() / "leftover", "x");
  }
  CHECK_FALSE(fs::exists(root));
  CHECK(fs::is_empty(base.path()));  // nothing hidden left either

  const std::string message =
      error_of([&] { SnapshotArea area((base / "absent").string(), "job1", "node-a"); });
  CHECK(message.find("--snapshot-dir") != std::string::npos);
  CHECK(message.find("absent") != std::string::npos);
}

TEST_CASE("snapshot area: the committed snapshots and the replicas it holds") {
  ductile::test::TempDir base;
  SnapshotArea area(base.path().string(), "job", "node-a");
  CHECK(area.own_copies().empty());  // no `latest` yet
  write_snapshot(area.own(), 3, 4, {0, 1}, true);
  const std::string sha5 = write_snapshot(area.own(), 5, 4, {0, 1}, true);
  // Renamed by a save killed before its `latest`: not committed.
  write_snapshot(area.own(), 6, 4, {0, 1}, false);
  write_file(area.own() / "step7.tmp" / "rank0-of-4.bin", "half");
  write_file(area.own() / "replicas", "1\n");

  const auto own = area.own_copies();
  REQUIRE(own.size() == 2);
  CHECK(own[0].tag == "step5");
  CHECK(own[0].step == 5);
  CHECK(own[0].world == 4);
  CHECK(own[0].sha256 == sha5);
  CHECK(own[0].files == std::vector<std::string>{"manifest.json", "manifest.json.sha256",
                                                 "rank0-of-4.bin", "rank1-of-4.bin"});
  CHECK(own[1].tag == "step3");
  CHECK(area.replicas_wanted() == 1);

  write_snapshot(area.replicas() / "node-b", 4, 4, {2, 3}, false);
  // A folder being copied, and one whose sidecar is missing: not held.
  write_file(area.replicas() / "node-b" / "step8.tmp" / "manifest.json", "{}");
  write_file(area.replicas() / "node-c" / "step2" / "manifest.json", "{}");
  const auto replicas = area.replica_copies();
  REQUIRE(replicas.size() == 1);
  REQUIRE(replicas.at("node-b").size() == 1);
  CHECK(replicas.at("node-b")[0].files ==
        std::vector<std::string>{"manifest.json", "manifest.json.sha256", "rank2-of-4.bin",
                                 "rank3-of-4.bin"});
}

TEST_CASE("snapshot server: a file copied byte for byte, every other path refused") {
  ductile::test::TempDir base;
  SnapshotArea a(base.path().string(), "job", "node-a");
  SnapshotArea b(base.path().string(), "job", "node-b");
  const std::string secret = "the job's secret";
  SnapshotServer server(a.root(), "127.0.0.1", secret);
  const std::string big = random_bytes((3u << 20) + 12345, 7);  // several chunks
  write_file(a.own() / "step5" / "rank0-of-2.bin", big);
  const auto timeout = std::chrono::seconds(30);

  const fs::path copy = b.restore() / "rank0-of-2.bin";
  CHECK(fetch_file("127.0.0.1", server.port(), "own/step5/rank0-of-2.bin", copy, secret, timeout) ==
        big.size());
  CHECK(read_file(copy) == big);
  // Never over a file that exists (O_EXCL).
  CHECK(error_of([&] {
          fetch_file("127.0.0.1", server.port(), "own/step5/rank0-of-2.bin", copy, secret, timeout);
        }).find("cannot create the copy") != std::string::npos);
  CHECK(read_file(copy) == big);

  // A size other than the one expected: refused before a byte is written.
  const fs::path other = b.restore() / "other";
  CHECK(error_of([&] {
          fetch_file("127.0.0.1", server.port(), "own/step5/rank0-of-2.bin", other, secret, timeout,
                     big.size() - 1);
        }).find("not the " + std::to_string(big.size() - 1) + " expected") != std::string::npos);
  CHECK_FALSE(fs::exists(other));

  // A link to a file outside, a link to a folder, a FIFO, a file that is
  // not there, a path out of the area, a name no snapshot has.
  fs::create_symlink("/etc/hostname", a.own() / "step5" / "rank1-of-2.bin");
  fs::create_directory_symlink(a.own() / "step5", a.own() / "step6");
  REQUIRE(::mkfifo((a.own() / "step5" / "manifest.json").c_str(), 0600) == 0);
  write_file(a.root() / "secret.txt", "not served");
  const std::vector<std::pair<std::string, std::string>> refusals = {
      {"own/step5/rank1-of-2.bin", "a symbolic link"},
      {"own/step6/rank0-of-2.bin", "'step6' is not a directory"},
      {"own/step5/manifest.json", "not a regular file"},
      {"replicas/node-z/step1/manifest.json", "No such file or directory"},
      {"own/step5/../../secret.txt", "is not a snapshot file"},
      {"own/../own/step5/rank0-of-2.bin", "is not a snapshot file"},
      {"/own/step5/rank0-of-2.bin", "is not a snapshot file"},
      {"secret.txt", "is not a snapshot file"},
      {"own/step5/notes.txt", "is not a snapshot file"},
      {"restore/step5/rank0-of-2.bin", "is not a snapshot file"},
  };
  for (const auto& [path, why] : refusals) {
    CAPTURE(path);
    const fs::path dest = b.restore() / "refused";
    const std::string message =
        error_of([&] { fetch_file("127.0.0.1", server.port(), path, dest, secret, timeout); });
    CHECK(message.find("the server refused it") != std::string::npos);
    CHECK(message.find(why) != std::string::npos);
    CHECK_FALSE(fs::exists(dest));
  }

  // Without the job's secret, or with another: nothing is served.
  const fs::path dest = b.restore() / "unauthorized";
  CHECK(error_of([&] {
          fetch_file("127.0.0.1", server.port(), "own/step5/rank0-of-2.bin", dest, "another",
                     timeout);
        }).find("secrets differ") != std::string::npos);
  CHECK(error_of([&] {
          fetch_file("127.0.0.1", server.port(), "own/step5/rank0-of-2.bin", dest, "", timeout);
        }).find("has none") != std::string::npos);
  SnapshotServer open_server(a.root(), "127.0.0.1", "");
  CHECK(error_of([&] {
          fetch_file("127.0.0.1", open_server.port(), "own/step5/rank0-of-2.bin", dest, secret,
                     timeout);
        }).find("the server has no secret and this agent has one") != std::string::npos);
  CHECK_FALSE(fs::exists(dest));
  // Both without a secret: served.
  CHECK(fetch_file("127.0.0.1", open_server.port(), "own/step5/rank0-of-2.bin", dest, "",
                   timeout) == big.size());
}

TEST_CASE("snapshot copy: checked against the manifest's SHA-256 and sizes") {
  ductile::test::TempDir base;
  SnapshotArea a(base.path().string(), "job", "node-a");
  SnapshotArea b(base.path().string(), "job", "node-b");
  SnapshotServer server(a.root(), "127.0.0.1", "");
  const std::string sha = write_snapshot(a.own(), 9, 2, {0}, true);
  write_snapshot(b.own(), 9, 2, {1}, true);
  auto source = [&](const std::string& file, bool local) {
    SnapshotFileSource s;
    s.file = file;
    if (local) {
      s.local = b.own() / "step9" / file;
    } else {
      s.host = "127.0.0.1";
      s.port = server.port();
      s.relative = "own/step9/" + file;
    }
    return s;
  };
  const std::vector<SnapshotFileSource> all = {
      source("manifest.json", false), source("manifest.json.sha256", false),
      source("rank0-of-2.bin", false), source("rank1-of-2.bin", true)};
  const auto timeout = std::chrono::seconds(30);
  // Complete: every rank's shard, from A's server and from B's own copy.
  copy_snapshot(all, b.restore() / "step9", sha, "", timeout, true);
  CHECK(read_file(b.restore() / "step9" / "rank0-of-2.bin") ==
        read_file(a.own() / "step9" / "rank0-of-2.bin"));
  CHECK(read_file(b.restore() / "step9" / "rank1-of-2.bin") ==
        read_file(b.own() / "step9" / "rank1-of-2.bin"));
  CHECK(sha256sum(b.restore() / "step9" / "manifest.json") == sha);
  CHECK_FALSE(fs::exists(b.restore() / "step9.tmp"));

  // A shard missing, the wrong snapshot's identity, a shard of another
  // size than the manifest gives: refused, nothing left behind.
  CHECK(error_of([&] {
          copy_snapshot({all[0], all[1], all[2]}, b.restore() / "x", sha, "", timeout, true);
        }).find("no holder of 'rank1-of-2.bin'") != std::string::npos);
  CHECK(error_of([&] {
          copy_snapshot(all, b.restore() / "x", std::string(64, 'a'), "", timeout, true);
        }).find("not the snapshot's") != std::string::npos);
  write_file(b.own() / "step9" / "rank1-of-2.bin", "short");
  CHECK(error_of([&] {
          copy_snapshot(all, b.restore() / "x", sha, "", timeout, true);
        }).find("not the 1046 its manifest gives") != std::string::npos);
  CHECK_FALSE(fs::exists(b.restore() / "x"));
  CHECK_FALSE(fs::exists(b.restore() / "x.tmp"));
}

TEST_CASE("snapshot replication: the previous member's newest snapshot pulled, 2 kept") {
  ductile::test::TempDir base;
  SnapshotArea a(base.path().string(), "job", "node-a");
  SnapshotArea b(base.path().string(), "job", "node-b");
  const std::string secret = "s";
  SnapshotServer server(a.root(), "127.0.0.1", secret);
  const NodeIdentity self = identity("node-b");
  SnapshotReplication replication(b, self, secret);
  write_file(b.own() / "replicas", "1\n");  // B's workers' snapshot_replicas

  // Node B (group index 1 of 2) pulls node A's newest (index 0).
  auto step_of_a = [&](std::int64_t step) {
    write_snapshot(a.own(), step, 2, {0}, true);
    Holdings held;
    held.node = "node-a";
    held.addr = "127.0.0.1";
    held.port = server.port();
    held.own = a.own_copies();
    REQUIRE(held.own.front().step == step);
    const std::size_t before = replication.copies_made();
    replication.update({"node-a", "node-b"}, {{"node-a", held}});
    // Bounded far above the milliseconds a copy takes.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (replication.copies_made() == before && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    REQUIRE(replication.copies_made() == before + 1);
  };
  step_of_a(1);
  step_of_a(2);
  step_of_a(3);
  const auto held = b.replica_copies();
  REQUIRE(held.count("node-a") == 1);
  const auto& copies = held.at("node-a");
  REQUIRE(copies.size() == 2);
  CHECK(copies[0].tag == "step3");
  CHECK(copies[1].tag == "step2");
  CHECK(copies[0].sha256 == sha256sum(a.own() / "step3" / "manifest.json"));
  CHECK(read_file(b.replicas() / "node-a" / "step3" / "rank0-of-2.bin") ==
        read_file(a.own() / "step3" / "rank0-of-2.bin"));
  CHECK_FALSE(fs::exists(b.replicas() / "node-a" / "step1"));
  CHECK(replication.freeze(std::chrono::seconds(30)));
}

TEST_CASE("worker environment: the snapshot folder every round, the restore when one is made") {
  AgentOptions o;
  o.job_id = "job";
  o.nproc_per_node = 2;
  o.command = {"python3", "train.py"};
  const auto policy = JobPolicy::any_size(2, 1, 1);
  RoundRecord round;
  round.round = 3;
  round.members = {"node-a"};
  round.world_size = 2;
  round.master_addr = "127.0.0.1";
  round.master_port = 29500;
  const fs::path run_dir = "/tmp/run", own = "/dev/shm/area/own",
                 restore = "/dev/shm/area/restore/step5", none;
  // What the agent's own environment holds is never passed on.
  ::setenv("DUCTILE_SNAPSHOT_RESTORE", "/stale/step1", 1);
  ::setenv("DUCTILE_SNAPSHOT_DIR", "/stale", 1);
  auto values = [](const WorkerSpec& spec, const std::string& name) {
    std::vector<std::string> found;
    for (const auto& entry : spec.env)
      if (entry.starts_with(name + "=")) found.push_back(entry.substr(name.size() + 1));
    return found;
  };
  const auto restoring = worker_specs({o, policy, round, 0, "node-a", run_dir, own, restore});
  REQUIRE(restoring.size() == 2);
  for (const auto& spec : restoring) {
    CHECK(values(spec, "DUCTILE_SNAPSHOT_DIR") == std::vector<std::string>{own.string()});
    CHECK(values(spec, "DUCTILE_SNAPSHOT_RESTORE") == std::vector<std::string>{restore.string()});
  }
  const auto fresh = worker_specs({o, policy, round, 0, "node-a", run_dir, own, none});
  for (const auto& spec : fresh) {
    CHECK(values(spec, "DUCTILE_SNAPSHOT_DIR") == std::vector<std::string>{own.string()});
    CHECK(values(spec, "DUCTILE_SNAPSHOT_RESTORE").empty());
  }
  ::unsetenv("DUCTILE_SNAPSHOT_RESTORE");
  ::unsetenv("DUCTILE_SNAPSHOT_DIR");
}

TEST_CASE("snapshot server: a client that skips the proof, or asks too much, is refused") {
  ductile::test::TempDir base;
  SnapshotArea a(base.path().string(), "job", "node-a");
  write_file(a.own() / "step5" / "rank0-of-2.bin", "shard");
  SnapshotServer server(a.root(), "127.0.0.1", "the job's secret");
  // The client's side of the protocol by hand (snapshot_server.hpp): the
  // hello, the server's proof read and ignored, then no proof of its own.
  auto ask = [&](int port, bool secret, std::uint8_t proving, const std::string& path) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<std::uint16_t>(port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0);
    timeval wait{30, 0};  // far above what the server takes to answer
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
    std::string hello = "DSN1" + std::string(32, 'n');
    REQUIRE(::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(hello.size()));
    std::string answer;
    char buffer[4096];
    // The server's hello: 1, its nonce (32 bytes), its proof (32 bytes);
    // or 0 without a secret.
    while (answer.size() < (secret ? 65u : 1u)) {
      const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
      REQUIRE(n > 0);
      answer.append(buffer, static_cast<std::size_t>(n));
    }
    CHECK(answer[0] == (secret ? 1 : 0));
    std::string request(1, static_cast<char>(proving));
    if (proving == 1) request += std::string(32, 'p');  // not the proof
    const auto size = static_cast<std::uint32_t>(path.size());
    request.append(reinterpret_cast<const char*>(&size), sizeof size);
    request += path;
    ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    std::string reply;
    for (ssize_t n; (n = ::recv(fd, buffer, sizeof buffer, 0)) > 0;)
      reply.append(buffer, static_cast<std::size_t>(n));
    ::close(fd);
    return reply;
  };
  std::string reply = ask(server.port(), true, 0, "own/step5/rank0-of-2.bin");
  REQUIRE_FALSE(reply.empty());
  CHECK(reply[0] == 2);  // unauthorized
  CHECK(reply.find("gave no proof of the job's secret") != std::string::npos);
  CHECK(reply.find("shard") == std::string::npos);
  reply = ask(server.port(), true, 1, "own/step5/rank0-of-2.bin");
  REQUIRE_FALSE(reply.empty());
  CHECK(reply[0] == 2);
  CHECK(reply.find("secrets differ") != std::string::npos);
  CHECK(reply.find("shard") == std::string::npos);

  // Without a secret, a request over 4 KiB is refused before it is read
  // (and the client never sends one).
  SnapshotServer open_server(a.root(), "127.0.0.1", "");
  reply = ask(open_server.port(), false, 0, "own/step5/" + std::string(5000, 'x'));
  REQUIRE_FALSE(reply.empty());
  CHECK(reply[0] == 1);  // refused
  CHECK(reply.find("a request of 5010 bytes, over the 4096 allowed") != std::string::npos);
  const fs::path dest = a.restore() / "copy";
  CHECK(error_of([&] {
          fetch_file("127.0.0.1", open_server.port(), "own/step5/" + std::string(5000, 'x'), dest,
                     "", std::chrono::seconds(30));
        }).find("the path is too long") != std::string::npos);
  CHECK_FALSE(fs::exists(dest));
  // Served to the same client that asks by the rules.
  reply = ask(open_server.port(), false, 0, "own/step5/rank0-of-2.bin");
  REQUIRE(reply.size() == 1 + 8 + 5);
  CHECK(reply[0] == 0);
  CHECK(reply.substr(9) == "shard");
}

namespace snapshot_area_test {

// Waits (bounded far above the milliseconds it takes) until `done`.
bool eventually(const std::function<bool()>& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// One node's agent pieces: its area, its replication and the server that
// hands it the messages.
struct Node {
  Node(const fs::path& base, const std::string& id, const std::string& secret,
       std::chrono::milliseconds timeout = std::chrono::seconds(30))
      : self(identity(id)),
        area(base.string(), "job", id),
        replication(area, self, secret, timeout),
        server(area.root(), "127.0.0.1", secret,
               [this](const SnapshotMessage& m) { return replication.on_message(m); }) {}
  Holdings holdings() const {
    Holdings h;
    h.node = self.id;
    h.addr = "127.0.0.1";
    h.port = server.port();
    return h;
  }
  NodeIdentity self;
  SnapshotArea area;
  SnapshotReplication replication;
  SnapshotServer server;
};

}  // namespace snapshot_area_test

TEST_CASE("snapshot replication: a committed snapshot announced, pulled at once, acknowledged") {
  ductile::test::TempDir base;
  const std::string secret = "s";
  Node a(base.path(), "node-a", secret);
  Node b(base.path(), "node-b", secret);
  Node c(base.path(), "node-c", secret);
  for (Node* n : {&a, &b, &c}) write_file(n->area.own() / "replicas", "1\n");
  const fs::path replicated = a.area.own() / "replicated";

  // A round of one member has no successor; of several, nothing is
  // replicated yet.
  c.replication.start_round({"node-c"});
  CHECK(read_file(c.area.own() / "replicated") == "off\n");
  const std::vector<std::string> members = {"node-a", "node-b", "node-c"};
  for (Node* n : {&a, &b, &c}) n->replication.start_round(members);
  CHECK(read_file(replicated) == "0\n");
  CHECK(read_file(c.area.own() / "replicated") == "0\n");
  // The holdings give the servers' addresses and no snapshot: only a
  // notify makes B pull (the periodic pull finds nothing to copy).
  const std::map<std::string, Holdings> holdings = {
      {"node-a", a.holdings()}, {"node-b", b.holdings()}, {"node-c", c.holdings()}};
  for (Node* n : {&a, &b, &c}) n->replication.update(members, holdings);

  // A's workers commit step 4: B (A's successor, R = 1) holds it, A knows.
  const std::string sha4 = write_snapshot(a.area.own(), 4, 3, {0}, true);
  CHECK(eventually([&] { return read_file(replicated) == "4\n"; }));
  CHECK(read_file(b.area.replicas() / "node-a" / "step4" / "rank0-of-3.bin") ==
        read_file(a.area.own() / "step4" / "rank0-of-3.bin"));
  CHECK(sha256sum(b.area.replicas() / "node-a" / "step4" / "manifest.json") == sha4);
  CHECK_FALSE(fs::exists(c.area.replicas() / "node-a"));  // C is not A's successor
  write_snapshot(a.area.own(), 5, 3, {0}, true);
  CHECK(eventually([&] { return read_file(replicated) == "5\n"; }));
  CHECK(b.replication.copies_made() == 2);

  // A new round starts counting again; what was committed before it is not
  // announced.
  a.replication.start_round({"node-a", "node-c"});
  CHECK(read_file(replicated) == "0\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(read_file(replicated) == "0\n");
  CHECK(c.replication.copies_made() == 0);
}

TEST_CASE("snapshot server: a notify or have with bad names is refused, answered off the pull") {
  ductile::test::TempDir base;
  // B copies with a patience far longer than the test: a stalled pull
  // never ends on its own here.
  Node b(base.path(), "node-b", "", std::chrono::seconds(600));
  write_file(b.area.own() / "replicas", "1\n");
  const std::vector<std::string> members = {"node-a", "node-b"};
  b.replication.start_round(members);
  auto send = [&](const SnapshotMessage& m) {
    return error_of([&] {
      send_snapshot_message("127.0.0.1", b.server.port(), m, "", std::chrono::seconds(30));
    });
  };
  SnapshotMessage notify;
  notify.origin = "node-a";
  notify.tag = "step3";
  notify.sha256 = std::string(64, 'a');
  notify.files = {"manifest.json", "manifest.json.sha256", "rank0-of-2.bin"};
  const std::vector<std::function<void(SnapshotMessage&)>> bad_names = {
      [](SnapshotMessage& m) { m.origin = ".."; }, [](SnapshotMessage& m) { m.tag = "latest"; },
      [](SnapshotMessage& m) { m.sha256 = "ABC"; }};
  for (const auto& bad : bad_names) {
    SnapshotMessage m = notify;
    bad(m);
    CHECK(send(m).find("is not a snapshot message") != std::string::npos);
  }
  SnapshotMessage escaping = notify;
  escaping.files.push_back("../../lock");
  CHECK(send(escaping).find("'../../lock' in a notify's file list is not a snapshot file") !=
        std::string::npos);
  SnapshotMessage twice = notify;
  twice.files.push_back("rank0-of-2.bin");
  CHECK(send(twice).find("listed twice") != std::string::npos);
  SnapshotMessage have = notify;
  have.kind = SnapshotMessage::Kind::have;
  have.holder = "node-a";
  CHECK(send(have).find("a have of node node-a's snapshot sent to node node-b") !=
        std::string::npos);

  // A's server accepts a connection and never answers: B's pull of A's
  // snapshot stalls, and B's server still answers every notify at once.
  const int silent = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(silent >= 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(silent, reinterpret_cast<sockaddr*>(&at), sizeof at) == 0);
  REQUIRE(::listen(silent, 16) == 0);
  socklen_t size = sizeof at;
  REQUIRE(::getsockname(silent, reinterpret_cast<sockaddr*>(&at), &size) == 0);
  Holdings a;
  a.node = "node-a";
  a.addr = "127.0.0.1";
  a.port = ntohs(at.sin_port);
  b.replication.update(members, {{"node-a", a}});
  CHECK(send(notify) == "");
  // The pull has connected (it waits for the server's hello).
  CHECK(eventually([&] {
    pollfd p{silent, POLLIN, 0};
    return ::poll(&p, 1, 0) == 1;
  }));
  for (int step = 4; step < 8; ++step) {
    SnapshotMessage next = notify;
    next.tag = "step" + std::to_string(step);
    CHECK(send(next) == "");
  }
  CHECK(b.replication.copies_made() == 0);
  CHECK(b.replication.freeze(std::chrono::seconds(30)));  // the stalled pull abandoned
  ::close(silent);
}

TEST_CASE("snapshot copy: a file its first holder cannot give is taken from the next") {
  ductile::test::TempDir base;
  SnapshotArea a(base.path().string(), "job", "node-a");
  SnapshotArea b(base.path().string(), "job", "node-b");
  SnapshotServer server(a.root(), "127.0.0.1", "");
  const std::string sha = write_snapshot(a.own(), 9, 1, {0}, true);
  std::vector<SnapshotFileSource> sources;
  for (const std::string file : {"manifest.json", "manifest.json.sha256", "rank0-of-1.bin"}) {
    // Listed by A as a replica it does not hold, then as its own copy.
    sources.push_back({file, "127.0.0.1", server.port(), "replicas/node-c/step9/" + file, {}});
    sources.push_back({file, "127.0.0.1", server.port(), "own/step9/" + file, {}});
  }
  copy_snapshot(sources, b.restore() / "step9", sha, "", std::chrono::seconds(30), true);
  CHECK(read_file(b.restore() / "step9" / "rank0-of-1.bin") ==
        read_file(a.own() / "step9" / "rank0-of-1.bin"));
  // No holder gives it: the error names the file and every holder's
  // failure.
  std::vector<SnapshotFileSource> none(sources.begin(), sources.begin() + 4);
  const std::string message = error_of(
      [&] { copy_snapshot(none, b.restore() / "x", sha, "", std::chrono::seconds(30), true); });
  CHECK(message.find("no holder of 'rank0-of-1.bin'") != std::string::npos);
  none.push_back(sources[4]);
  none.push_back(sources[5]);  // A's own copy, removed below
  fs::remove(a.own() / "step9" / "rank0-of-1.bin");
  const std::string failed = error_of(
      [&] { copy_snapshot(none, b.restore() / "x", sha, "", std::chrono::seconds(30), true); });
  CHECK(failed.find("'rank0-of-1.bin' of snapshot " + sha + " from none of its 2 holders") !=
        std::string::npos);
  CHECK(failed.find("replicas/node-c/step9/rank0-of-1.bin") != std::string::npos);
  CHECK_FALSE(fs::exists(b.restore() / "x.tmp"));
}

TEST_CASE("snapshot area: a dead agent's area is removed by the next agent, a live one's kept") {
  ductile::test::TempDir base;
  const fs::path dead_record = base / "dead-area";
  SnapshotArea live(base.path().string(), "job", "node-live");
  write_file(live.own() / "kept", "x");
  // An agent killed: its process ends without removing its area.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    try {
      auto* area = new SnapshotArea(base.path().string(), "job", "node-dead");  // never destroyed
      write_file(dead_record, area->root().string());
    } catch (...) {
      std::_Exit(3);
    }
    std::_Exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  const fs::path dead = read_file(dead_record);
  REQUIRE(fs::is_directory(dead / "own"));
  // Not an area, and not private: left alone.
  const fs::path other = base / "ductile-snapshots-other";
  REQUIRE(::mkdir(other.c_str(), 0755) == 0);
  ::chmod(other.c_str(), 0755);

  SnapshotArea next(base.path().string(), "job", "node-next");
  CHECK(next.removed_stale() == std::vector<fs::path>{dead});
  CHECK_FALSE(fs::exists(dead));
  CHECK(read_file(live.own() / "kept") == "x");
  CHECK(fs::is_directory(other));
  CHECK(read_file(live.own() / "kept") == "x");
}

namespace snapshot_area_test {

// What the files in `area` take in memory (their blocks, each inode once):
// the shard files' ("rank*.bin") and every other file's (manifests, their
// sidecars, the pointers and counts).
struct HeldBytes {
  std::uintmax_t shards = 0;
  std::uintmax_t other = 0;
};

HeldBytes held_bytes(const fs::path& area) {
  HeldBytes held;
  std::set<std::pair<dev_t, ino_t>> seen;
  for (const auto& entry : fs::recursive_directory_iterator(area)) {
    struct stat info {};
    if (::lstat(entry.path().c_str(), &info) != 0 || !S_ISREG(info.st_mode) ||
        !seen.insert({info.st_dev, info.st_ino}).second)
      continue;
    const auto bytes = static_cast<std::uintmax_t>(info.st_blocks) * 512;
    (entry.path().filename().string().starts_with("rank") ? held.shards : held.other) += bytes;
  }
  return held;
}

bool receive_exactly(int fd, char* into, std::size_t size) {
  for (std::size_t got = 0; got < size;) {
    const ssize_t n = ::recv(fd, into + got, size - got, 0);
    if (n <= 0) return false;
    got += static_cast<std::size_t>(n);
  }
  return true;
}

bool send_exactly(int fd, const std::string& bytes) {
  for (std::size_t sent = 0; sent < bytes.size();) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<std::size_t>(n);
  }
  return true;
}

// A holder's snapshot server without a secret that serves the files of
// `folder`, a shard file's first half only until release(): the copy of a
// replica held at half-way.
class HalfwayHolder {
 public:
  explicit HalfwayHolder(fs::path folder) : folder_(std::move(folder)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(listener_ >= 0);
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listener_, reinterpret_cast<sockaddr*>(&at), sizeof at) == 0);
    REQUIRE(::listen(listener_, 16) == 0);
    socklen_t size = sizeof at;
    REQUIRE(::getsockname(listener_, reinterpret_cast<sockaddr*>(&at), &size) == 0);
    port_ = ntohs(at.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~HalfwayHolder() {
    release();
    ::shutdown(listener_, SHUT_RDWR);
    thread_.join();
    ::close(listener_);
  }
  int port() const { return port_; }
  void release() {
    std::unique_lock lock(mutex_);
    released_ = true;
    changed_.notify_all();
  }

 private:
  void serve() {
    for (;;) {
      const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;
      timeval wait{30, 0};  // far above what the agent takes to ask
      ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
      answer(fd);
      ::close(fd);
    }
  }
  // One request: the client's hello ("DSN1", its nonce), "no secret", the
  // path asked for; its file (a message: nothing) after the status and size.
  void answer(int fd) {
    char hello[36];
    char proving = 0;
    std::uint32_t size = 0;
    if (!receive_exactly(fd, hello, sizeof hello) || !send_exactly(fd, std::string(1, '\0')) ||
        !receive_exactly(fd, &proving, 1) ||
        !receive_exactly(fd, reinterpret_cast<char*>(&size), sizeof size) || size > 4096)
      return;
    std::string path(size, '\0');
    if (!receive_exactly(fd, path.data(), size)) return;
    const std::string file = path.substr(path.rfind('/') + 1);
    const std::string bytes = path.starts_with("own/") ? read_file(folder_ / file) : std::string();
    std::string head(1, '\0');
    const std::uint64_t length = bytes.size();
    head.append(reinterpret_cast<const char*>(&length), sizeof length);
    const std::size_t first = file.starts_with("rank") ? bytes.size() / 2 : bytes.size();
    if (!send_exactly(fd, head + bytes.substr(0, first)) || first == bytes.size()) return;
    std::unique_lock lock(mutex_);
    changed_.wait_for(lock, std::chrono::seconds(60), [this] { return released_; });
    lock.unlock();
    send_exactly(fd, bytes.substr(first));
  }

  fs::path folder_;
  int listener_ = -1;
  int port_ = 0;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool released_ = false;
  std::thread thread_;
};

}  // namespace snapshot_area_test

// The bound on a node's memory for snapshots, with replicas = 1: its own
// two (double-buffered) and two of its predecessor's, also while a third of
// the predecessor's arrives: (1 + 1) x 2 x the node's shard bytes, plus the
// small files (manifests, sidecars, pointers, counts, the lock), counted
// apart.
TEST_CASE("snapshot replication: a replica arriving takes the older one's place, 2 held at most") {
  ductile::test::TempDir base;
  constexpr std::size_t kShard = 1 << 20;  // each rank's shard: the node's state
  SnapshotArea a(base.path().string(), "job", "node-a");
  SnapshotServer server(a.root(), "127.0.0.1", "");
  Node b(base.path(), "node-b", "");
  write_file(b.area.own() / "replicas", "1\n");
  // B's workers' two snapshots (rank 1 of 2), and A's (rank 0) pulled by B.
  write_snapshot(b.area.own(), 2, 2, {1}, false, kShard);
  write_snapshot(b.area.own(), 3, 2, {1}, true, kShard);
  struct stat shard {};
  REQUIRE(::stat((b.area.own() / "step3" / "rank1-of-2.bin").c_str(), &shard) == 0);
  const auto state = static_cast<std::uintmax_t>(shard.st_blocks) * 512;
  const std::uintmax_t bound = (1 + 1) * 2 * state;
  auto holdings_of_a = [&](int port) {
    Holdings held;
    held.node = "node-a";
    held.addr = "127.0.0.1";
    held.port = port;
    held.own = a.own_copies();
    return held;
  };
  for (std::int64_t step : {2, 3}) {
    write_snapshot(a.own(), step, 2, {0}, true, kShard);
    const std::size_t before = b.replication.copies_made();
    b.replication.update({"node-a", "node-b"}, {{"node-a", holdings_of_a(server.port())}});
    REQUIRE(eventually([&] { return b.replication.copies_made() == before + 1; }));
  }
  CHECK(held_bytes(b.area.root()).shards <= bound);

  // A's step 4 arrives from a holder that gives half of its shard file and
  // waits: step 2's replica is gone already.
  write_snapshot(a.own(), 4, 2, {0}, true, kShard);
  HalfwayHolder holder(a.own() / "step4");
  b.replication.update({"node-a", "node-b"}, {{"node-a", holdings_of_a(holder.port())}});
  const fs::path arriving = b.area.replicas() / "node-a" / "step4.tmp" / "rank0-of-2.bin";
  const std::uintmax_t half = fs::file_size(a.own() / "step4" / "rank0-of-2.bin") / 2;
  REQUIRE(eventually([&] {
    std::error_code ec;
    return fs::file_size(arriving, ec) == half;
  }));
  const HeldBytes during = held_bytes(b.area.root());
  CHECK(during.shards <= bound);
  // 11 small files (B's 2 manifests and sidecars, latest, replicas, the
  // lock; the manifests and sidecars of A's step 3 and step 4), a page each.
  CHECK(during.other <= 16 * 4096);
  CHECK_FALSE(fs::exists(b.area.replicas() / "node-a" / "step2"));
  CHECK(fs::exists(b.area.replicas() / "node-a" / "step3"));

  holder.release();
  REQUIRE(eventually([&] { return b.replication.copies_made() == 3; }));
  const auto held = b.area.replica_copies();
  REQUIRE(held.count("node-a") == 1);
  REQUIRE(held.at("node-a").size() == 2);
  CHECK(held.at("node-a")[0].tag == "step4");
  CHECK(held.at("node-a")[1].tag == "step3");
  CHECK(read_file(b.area.replicas() / "node-a" / "step4" / "rank0-of-2.bin") ==
        read_file(a.own() / "step4" / "rank0-of-2.bin"));
  CHECK(held_bytes(b.area.root()).shards <= bound);
  CHECK(b.replication.freeze(std::chrono::seconds(30)));
}
