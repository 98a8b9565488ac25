// `ductile agent` against a forged snapshots/<node> record: written into an
// etcd without authentication (no lease, a stranger's address, a step the
// job never reached, a world size of 1). The agents ignore it and log it;
// when that node is lost, the survivor restores the job's own snapshot
// from its memory and never contacts the stranger. The workers are shell
// scripts that write snapshots in the workers' layout. A real etcd
// started by the test.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "agent_job.hpp"

using namespace ductile::test;
using ductile::agent::EtcdStore;

namespace {

// Each rank writes its shard of steps 1 to 3 into its node's snapshot
// area, and the manifest every node writes alike (the same SHA-256 on
// both); then it waits for `stop`. A restored worker says what it got:
// both ranks' shards.
std::vector<std::string> snapshot_worker(const std::string& stop) {
  return sh(R"SH(d="$DUCTILE_SNAPSHOT_DIR"
echo "up rank $RANK world $WORLD_SIZE round $DUCTILE_ROUND"
if [ -n "$DUCTILE_SNAPSHOT_RESTORE" ]; then
  # Started ahead of the restore: the agent links the folder once whole.
  while [ ! -e "$DUCTILE_SNAPSHOT_RESTORE" ]; do sleep 0.05; done
  echo "restored $(cat "$DUCTILE_SNAPSHOT_RESTORE/rank0-of-2.bin" "$DUCTILE_SNAPSHOT_RESTORE/rank1-of-2.bin")"
elif [ "$WORLD_SIZE" = 2 ]; then
  printf '1\n' > "$d/replicas"
  for s in 1 2 3; do
    t="$d/step$s"; mkdir -p "$t"
    printf 'rank%s-step%08d' "$RANK" "$s" > "$t/rank$RANK-of-2.bin"
    printf '{"shards":[{"file":"rank0-of-2.bin","bytes":18},{"file":"rank1-of-2.bin","bytes":18}],"step":%s}' "$s" > "$t/manifest.json"
    sum=$(sha256sum "$t/manifest.json" | cut -c1-64)
    printf '%s  manifest.json\n' "$sum" > "$t/manifest.json.sha256"
    printf 'step%s\nsha256 %s\n' "$s" "$sum" > "$d/latest.new" && mv "$d/latest.new" "$d/latest"
    echo "committed step $s round $DUCTILE_ROUND"
    sleep 0.3
  done
fi
while [ ! -e )SH" +
            stop + R"SH( ]; do sleep 0.1; done
echo "finished round $DUCTILE_ROUND")SH");
}

// A listening socket no one is meant to reach: the stranger's server.
struct Stranger {
  Stranger() {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at) == 0);
    REQUIRE(::listen(fd, 64) == 0);
    socklen_t size = sizeof at;
    REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&at), &size) == 0);
    port = ntohs(at.sin_port);
  }
  ~Stranger() { ::close(fd); }
  // A connection is waiting to be accepted.
  bool contacted() const {
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 1;
  }
  int fd = -1;
  int port = 0;
};

}  // namespace

TEST_CASE("agent: a forged snapshots record is ignored - the survivor restores the job's own") {
  Job job;
  const std::string stop = (job.dir / "stop").string();
  const std::string shm = (job.dir / "shm").string();
  std::filesystem::create_directories(shm);
  const std::vector<std::string> options = {"--nproc-per-node", "1", "--min-nodes",    "1",
                                            "--settle",         "1", "--stop-grace",   "1",
                                            "--lease-ttl",      "4", "--snapshot-dir", shm};
  const auto worker = snapshot_worker(stop);
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  // Both ranks of round 1 committed step 3, and each node published its
  // last record: its own step 3 and its replica of the other's (no record
  // of theirs changes after that).
  EtcdStore store(job.etcd.endpoint());
  const std::string prefix = "/ductile/agent/job/snapshots/";
  bool replicated = wait_until(
      [&] {
        if (count_of(job.all_output(), "committed step 3 round 1") != 2) return false;
        for (const char* node : {"a", "b"}) {
          const auto record = store.get(prefix + node);
          if (!record || count_of(record->value, R"("tag":"step3")") != 2) return false;
        }
        return true;
      },
      120s);
  if (!replicated) {
    job.dump();
    std::error_code ec;
    for (std::filesystem::recursive_directory_iterator it(shm, ec), end; !ec && it != end;
         it.increment(ec))
      std::cout << it->path().string() << "\n";
  }
  REQUIRE(replicated);

  // A's record replaced by a stranger's: no lease, its own address.
  Stranger stranger;
  const std::string forged =
      R"({"node":"a","addr":"127.0.0.1","port":)" + std::to_string(stranger.port) +
      R"(,"own":[{"tag":"step99","step":99,"world":1,"sha256":")" + std::string(64, 'f') +
      R"(","files":["manifest.json","manifest.json.sha256","rank0-of-1.bin"]}],"replicas":{}})";
  store.put(prefix + "a", forged);
  const std::string refusal = "ignoring /ductile/agent/job/snapshots/a (revision ";
  const std::string why = "snapshots record: it is not on the lease of node a's registration";
  bool seen = wait_until(
      [&] {
        const std::string out = b.output();
        const std::size_t at = out.find(refusal);
        return at != std::string::npos && out.find(why, at) != std::string::npos;
      },
      60s);
  if (!seen) job.dump();
  REQUIRE(seen);

  // A lost: B restores step 3 from its own copy and A's replica.
  a.signal(SIGKILL);
  a.wait(10s);
  bool restored =
      wait_until([&] { return b.output().find("restored rank") != std::string::npos; }, 120s);
  if (!restored) job.dump();
  REQUIRE(restored);
  std::ofstream(stop).put('\n');
  auto status = b.wait(120s);
  if (status != std::optional<int>(0)) job.dump();
  CHECK(status == std::optional<int>(0));
  const std::string out = b.output();
  INFO(out);
  CHECK(
      out.find("restored step 3 from memory: 1 of 2 nodes' own copies, 1 replica; 0 steps lost") !=
      std::string::npos);
  CHECK(out.find("restored rank0-step00000003rank1-step00000003") != std::string::npos);
  CHECK(out.find("the snapshot of step 3 is unauthenticated") != std::string::npos);
  CHECK(out.find("step 99") == std::string::npos);
  CHECK_FALSE(stranger.contacted());
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}
