// What an agent trusts of another node's snapshots: forged notifies to a
// node's snapshot server (a random SHA-256, no secret) are refused while
// its verified replica stays, and logged once per interval; under a
// checkpoint key a copy whose manifest or shard bytes were altered is
// refused; a holdings record whose step or world size does not fit the
// job is refused. Snapshot folders are written here in the workers'
// layout; SHA-256 sums and HMACs come from sha256sum and openssl, not
// from the code under test.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../agent/src/agent_common.hpp"
#include "../../agent/src/snapshot_area.hpp"
#include "../../agent/src/snapshot_replication.hpp"
#include "../../agent/src/snapshot_server.hpp"
#include "../../agent/src/snapshot_trust.hpp"
#include "ductile/error.hpp"
#include "process.hpp"
#include "temp_dir.hpp"

using namespace ductile::agent;
namespace fs = std::filesystem;

// Not an anonymous namespace: a unity build puts this file beside other
// tests, whose helpers' names would clash.
namespace snapshot_trust_test {

const std::string kKey = "0123456789abcdef0123456789abcdef";

void put_file(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string file_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string digest_of(const fs::path& file) {
  auto r = ductile::test::run_process({"sha256sum", file.string()});
  REQUIRE(r.exit_code == 0);
  return r.out.substr(0, 64);
}

std::string hmac_of(const fs::path& file, const std::string& key) {
  auto r =
      ductile::test::run_process({"openssl", "dgst", "-sha256", "-hmac", key, "-r", file.string()});
  REQUIRE(r.exit_code == 0);
  return r.out.substr(0, 64);
}

// Node A's snapshot of `step` (rank 0 of 2) in its workers' root, signed
// with `key` when one is given (the manifest records each shard's
// SHA-256); committed. Returns the manifest's SHA-256.
std::string snapshot_of_a(const fs::path& root, std::int64_t step, const std::string& key = "") {
  const std::string tag = "step" + std::to_string(step);
  std::mt19937 random(static_cast<unsigned>(step));
  std::string bytes(4096, '\0');
  for (auto& b : bytes) b = static_cast<char>(random() & 0xff);
  put_file(root / tag / "rank0-of-2.bin", bytes);
  nlohmann::json shards = nlohmann::json::array();
  for (int r = 0; r < 2; ++r) {
    nlohmann::json shard = {{"file", "rank" + std::to_string(r) + "-of-2.bin"},
                            {"bytes", bytes.size()}};
    // Rank 1's file lies on another node: its digest is that node's.
    if (!key.empty())
      shard["sha256"] = r == 0 ? digest_of(root / tag / "rank0-of-2.bin") : std::string(64, 'e');
    shards.push_back(shard);
  }
  const nlohmann::json manifest = {{"format", "ductile-zero3-checkpoint"},
                                   {"version", 4},
                                   {"step", step},
                                   {"world_size", 2},
                                   {"shards", shards}};
  put_file(root / tag / "manifest.json", manifest.dump());
  const std::string sha = digest_of(root / tag / "manifest.json");
  put_file(root / tag / "manifest.json.sha256", sha + "  manifest.json\n");
  if (!key.empty())
    put_file(root / tag / "manifest.json.hmac",
             "hmac-sha256 " + hmac_of(root / tag / "manifest.json", key) + "  manifest.json\n");
  put_file(root / "latest", tag + "\nsha256 " + sha + "\n");
  return sha;
}

std::string refusal_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ductile::Error& e) {
    return e.what();
  }
  return "";
}

bool within_a_minute(const std::function<bool()>& done) {
  // Bounded far above the milliseconds it takes.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// This process's stderr (where an agent logs) into a file while alive.
struct StderrCapture {
  explicit StderrCapture(const fs::path& file) : path(file) {
    std::fflush(stderr);
    saved = ::dup(2);
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    ::dup2(fd, 2);
    ::close(fd);
  }
  std::string stop() {
    std::fflush(stderr);
    if (saved >= 0) {
      ::dup2(saved, 2);
      ::close(saved);
      saved = -1;
    }
    return file_text(path);
  }
  ~StderrCapture() { stop(); }
  fs::path path;
  int saved = -1;
};

std::size_t occurrences(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

std::vector<SnapshotFileSource> sources_of(const fs::path& folder,
                                           const std::vector<std::string>& files) {
  std::vector<SnapshotFileSource> out;
  for (const auto& f : files) out.push_back({f, "", 0, f, folder / f});
  return out;
}

}  // namespace snapshot_trust_test

using namespace snapshot_trust_test;

TEST_CASE(
    "snapshot trust: forged notifies leave the verified replica in place, logged per interval") {
  ductile::test::TempDir base;
  SnapshotArea a(base.path().string(), "job", "node-a");
  SnapshotServer a_server(a.root(), "127.0.0.1", "");
  const NodeIdentity b_self{"/ductile/agent/test/", "node-b", "127.0.0.1"};
  SnapshotArea b(base.path().string(), "job", "node-b");
  SnapshotReplication replication(b, b_self, "");
  SnapshotServer b_server(b.root(), "127.0.0.1", "",
                          [&](const SnapshotMessage& m) { return replication.on_message(m); });
  put_file(b.own() / "replicas", "1\n");
  const std::vector<std::string> members = {"node-a", "node-b"};
  replication.start_round(members);
  const std::string sha6 = snapshot_of_a(a.own(), 6);
  Holdings held;
  held.node = "node-a";
  held.addr = "127.0.0.1";
  held.port = a_server.port();
  held.own = a.own_copies();
  replication.update(members, {{"node-a", held}});
  const fs::path replica = b.replicas() / "node-a" / "step6";
  REQUIRE(within_a_minute([&] { return replication.copies_made() == 1; }));
  auto verified = [&] {
    const auto copy = read_snapshot_copy(replica);
    return copy && copy->sha256 == sha6 &&
           file_text(replica / "rank0-of-2.bin") == file_text(a.own() / "step6" / "rank0-of-2.bin");
  };
  REQUIRE(verified());

  // Notifies of the published step with random SHA-256s, as fast as the
  // server answers: each refused, the replica there and whole after each.
  StderrCapture log(base.path() / "agent.log");
  std::mt19937_64 random(7);
  const auto started = std::chrono::steady_clock::now();
  constexpr int kForged = 200;
  int refused = 0, intact = 0;
  for (int i = 0; i < kForged; ++i) {
    SnapshotMessage forged;
    forged.origin = "node-a";
    forged.tag = "step6";
    forged.sha256.clear();
    for (int d = 0; d < 4; ++d) forged.sha256 += fmt::format("{:016x}", random());
    forged.files = {"manifest.json", "manifest.json.sha256", "rank0-of-2.bin"};
    const std::string answer = refusal_of([&] {
      send_snapshot_message("127.0.0.1", b_server.port(), forged, "", std::chrono::seconds(30));
    });
    if (answer.find("is not one node node-a published (its snapshots/node-a record)") !=
        std::string::npos)
      ++refused;
    if (verified()) ++intact;
  }
  // A notify of a step A has not published: its manifest, fetched from A,
  // is not the SHA-256 it names, and nothing else is copied; the next such
  // notify is refused until A's record is read again.
  SnapshotMessage ahead;
  ahead.origin = "node-a";
  ahead.tag = "step7";
  ahead.sha256 = std::string(64, 'c');
  ahead.files = {"manifest.json", "manifest.json.sha256", "rank0-of-2.bin"};
  CHECK(refusal_of([&] {
          send_snapshot_message("127.0.0.1", b_server.port(), ahead, "", std::chrono::seconds(30));
        }) == "");
  REQUIRE(within_a_minute([&] {
    return file_text(base.path() / "agent.log").find("cannot replicate snapshot step7") !=
           std::string::npos;
  }));
  ahead.tag = "step8";
  CHECK(refusal_of([&] {
          send_snapshot_message("127.0.0.1", b_server.port(), ahead, "", std::chrono::seconds(30));
        }).find("a copy of another snapshot it had not published failed") != std::string::npos);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const std::string out = log.stop();
  CHECK(refused == kForged);
  CHECK(intact == kForged);
  CHECK(verified());
  CHECK_FALSE(fs::exists(b.replicas() / "node-a" / "step7"));
  CHECK(replication.copies_made() == 1);
  // One line per 10 s of each kind, the first at once.
  INFO(out);
  const std::size_t lines = occurrences(out, "refusing a notify: snapshot step");
  CHECK(lines >= 1);
  CHECK(lines <= 1 + static_cast<std::size_t>(seconds / 10));
  CHECK(occurrences(out, "cannot replicate snapshot step7 of node node-a") == 1);
}

TEST_CASE("snapshot trust: under a checkpoint key, altered manifests and shards are refused") {
  ductile::test::TempDir base;
  SnapshotArea a(base.path().string(), "job", "node-a");
  SnapshotArea b(base.path().string(), "job", "node-b");
  const ductile::core::CheckpointKey key{kKey, "DUCTILE_CHECKPOINT_KEY"};
  const std::string sha = snapshot_of_a(a.own(), 5, kKey);
  const fs::path folder = a.own() / "step5";
  const std::vector<std::string> files = {"manifest.json", "manifest.json.hmac",
                                          "manifest.json.sha256", "rank0-of-2.bin"};
  const auto timeout = std::chrono::seconds(30);
  // Signed and intact: copied, under the key and without one.
  copy_snapshot(sources_of(folder, files), b.restore() / "good", sha, "", timeout, false, nullptr,
                &key);
  CHECK(fs::exists(b.restore() / "good" / "rank0-of-2.bin"));

  // Another key: the HMAC does not verify.
  const ductile::core::CheckpointKey other{std::string(32, 'x'), "DUCTILE_CHECKPOINT_KEY"};
  CHECK(refusal_of([&] {
          copy_snapshot(sources_of(folder, files), b.restore() / "x", sha, "", timeout, false,
                        nullptr, &other);
        }).find("its HMAC-SHA256 under the key of DUCTILE_CHECKPOINT_KEY is not the one") !=
        std::string::npos);
  // No HMAC: refused under a key, taken without one.
  CHECK(refusal_of([&] {
          copy_snapshot(
              sources_of(folder, {"manifest.json", "manifest.json.sha256", "rank0-of-2.bin"}),
              b.restore() / "x", sha, "", timeout, false, nullptr, &key);
        }).find("no HMAC of the manifest, and DUCTILE_CHECKPOINT_KEY gives a key") !=
        std::string::npos);
  // A shard's bytes altered, its size kept: its SHA-256 is not the one the
  // signed manifest records.
  std::string shard = file_text(folder / "rank0-of-2.bin");
  shard[100] = static_cast<char>(shard[100] ^ 0x5a);
  put_file(folder / "rank0-of-2.bin", shard);
  CHECK(refusal_of([&] {
          copy_snapshot(sources_of(folder, files), b.restore() / "x", sha, "", timeout, false,
                        nullptr, &key);
        }).find("but the signed manifest records") != std::string::npos);
  CHECK_FALSE(fs::exists(b.restore() / "x"));
  CHECK_FALSE(fs::exists(b.restore() / "x.tmp"));
  // Without a key only the sizes and the manifest's SHA-256 are checked.
  copy_snapshot(sources_of(folder, files), b.restore() / "unkeyed", sha, "", timeout, false);
  CHECK(fs::exists(b.restore() / "unkeyed"));

  // The replication under the key: the altered replica is not kept.
  SnapshotServer server(a.root(), "127.0.0.1", "");
  const NodeIdentity b_self{"/ductile/agent/test/", "node-b", "127.0.0.1"};
  SnapshotReplication replication(b, b_self, "", timeout, std::chrono::milliseconds(15), key);
  put_file(b.own() / "replicas", "1\n");
  replication.start_round({"node-a", "node-b"});
  Holdings held;
  held.node = "node-a";
  held.addr = "127.0.0.1";
  held.port = server.port();
  held.own = a.own_copies();
  REQUIRE(held.own.size() == 1);
  StderrCapture log(base.path() / "agent.log");
  replication.update({"node-a", "node-b"}, {{"node-a", held}});
  REQUIRE(within_a_minute([&] {
    return file_text(base.path() / "agent.log").find("cannot replicate snapshot step5") !=
           std::string::npos;
  }));
  const std::string out = log.stop();
  CHECK(out.find("but the signed manifest records") != std::string::npos);
  CHECK(replication.copies_made() == 0);
  CHECK_FALSE(fs::exists(b.replicas() / "node-a" / "step5"));
}

// A replica asked for from a record read before its origin removed the
// snapshot (its successor committed, or a restore left it behind): the
// origin answers that it holds no such file; nothing is copied and nothing
// is logged. A copy that fails otherwise is still logged.
TEST_CASE("snapshot trust: a snapshot its origin no longer holds is neither copied nor logged") {
  ductile::test::TempDir base;
  SnapshotArea a(base.path().string(), "job", "node-a");
  SnapshotArea c(base.path().string(), "job", "node-c");
  SnapshotArea b(base.path().string(), "job", "node-b");
  SnapshotServer a_server(a.root(), "127.0.0.1", "");
  SnapshotServer c_server(c.root(), "127.0.0.1", "");
  const NodeIdentity b_self{"/ductile/agent/test/", "node-b", "127.0.0.1"};
  SnapshotReplication replication(b, b_self, "");
  // Two replicas: node-b (group index 2) pulls node-c's (k = 1), then
  // node-a's (k = 2), in one pass.
  put_file(b.own() / "replicas", "2\n");
  const std::vector<std::string> members = {"node-a", "node-c", "node-b"};
  replication.start_round(members);
  auto holdings_of = [](const std::string& node, const SnapshotServer& server,
                        const SnapshotArea& area) {
    Holdings held;
    held.node = node;
    held.addr = "127.0.0.1";
    held.port = server.port();
    held.own = area.own_copies();
    return held;
  };
  snapshot_of_a(c.own(), 5);
  const Holdings c_stale = holdings_of("node-c", c_server, c);
  REQUIRE(c_stale.own.size() == 1);
  fs::remove_all(c.own() / "step5");
  snapshot_of_a(a.own(), 6);
  StderrCapture log(base.path() / "agent.log");
  replication.update(members,
                     {{"node-a", holdings_of("node-a", a_server, a)}, {"node-c", c_stale}});
  REQUIRE(within_a_minute([&] { return replication.copies_made() == 1; }));
  CHECK(fs::exists(b.replicas() / "node-a" / "step6"));
  CHECK_FALSE(fs::exists(b.replicas() / "node-c" / "step5"));

  // node-c's next snapshot, its manifest altered after it was published:
  // a real failure, logged.
  snapshot_of_a(c.own(), 7);
  const Holdings c_altered = holdings_of("node-c", c_server, c);
  put_file(c.own() / "step7" / "manifest.json",
           file_text(c.own() / "step7" / "manifest.json") + " ");
  replication.update(members,
                     {{"node-a", holdings_of("node-a", a_server, a)}, {"node-c", c_altered}});
  REQUIRE(within_a_minute([&] {
    return file_text(base.path() / "agent.log")
               .find(
                   "cannot replicate snapshot step7 of node "
                   "node-c") != std::string::npos;
  }));
  const std::string out = log.stop();
  INFO(out);
  CHECK(out.find("step5") == std::string::npos);
  CHECK(replication.copies_made() == 1);
}

TEST_CASE("snapshot trust: a record's step or world size that does not fit the job is refused") {
  // 2 to 3 nodes of 2 workers, valid GPU counts [2, 4, 6]: worlds 4 and 6.
  SnapshotBounds bounds;
  bounds.worlds = job_world_sizes({2, 4, 6}, 2, 2, 3);
  CHECK(bounds.worlds == std::vector<std::int64_t>{4, 6});
  CHECK(job_world_sizes({}, 1, 1, 3) == std::vector<std::int64_t>{1, 2, 3});
  SnapshotCopy copy{"step12", 12, 4, std::string(64, 'a'), {"manifest.json"}};
  Holdings h;
  h.node = "b";
  h.own = {copy};
  // Before this node's workers committed anything, any step.
  CHECK(holdings_problem(h, bounds) == "");
  // Its own snapshots of steps 10 and 8 (interval 2): at most 14.
  note_reached(bounds, {SnapshotCopy{"step10", 10, 4, "", {}}, SnapshotCopy{"step8", 8, 4, "", {}}},
               -1);
  CHECK(holdings_problem(h, bounds) == "");
  h.own[0].step = 99;
  h.own[0].tag = "step99";
  CHECK(holdings_problem(h, bounds) ==
        "snapshots record: \"own[0].step\" is 99; expected at most 14 (the newest step this "
        "node's workers reached, 10, and 4 more)");
  h.own[0] = copy;
  h.replicas["c"] = {SnapshotCopy{"step10", 10, 1, std::string(64, 'b'), {}}};
  CHECK(holdings_problem(h, bounds) ==
        "snapshots record: \"replicas.c[0].world\" is 1; expected a world size of this job (4, 6)");
  // A restore of step 30 raises the bound.
  h.replicas.clear();
  h.own[0].step = 31;
  h.own[0].tag = "step31";
  note_reached(bounds, {}, 30);
  CHECK(holdings_problem(h, bounds) == "");
}
