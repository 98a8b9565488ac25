// A c10d job of `ductile agent` processes with the job's secret, against
// clients of its rendezvous that are not its agents: a stranger cannot
// write, an agent with another secret exits 2; a client that holds the
// secret cannot stop the job with a lease of an endless TTL, records too
// large for an answer or keys by the ten thousand (each refused past the
// store's bounds, the ignored ones logged a few lines per kind); a host
// frozen for seconds fences the other nodes, which say so once and name
// the store. Real agent processes on loopback.
#include <doctest/doctest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>
#include <thread>

#include "ductile/agent/store_server.hpp"
#include "launchers.hpp"
#include "process.hpp"
#include "temp_dir.hpp"

using namespace ductile::test;
using ductile::agent::RendezvousClient;
using ductile::agent::StoreError;
using ductile::agent::StoreRefused;

namespace {

// CPU seconds (user + system) a process used so far.
double cpu_seconds_of(int pid) {
  std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
  std::istringstream fields(stat.substr(stat.rfind(')') + 2));
  std::string field;
  long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14) utime = std::stoll(field);
    if (i == 15) stime = std::stoll(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// The share of a core a process uses over `span`.
double cpu_share_of(int pid, std::chrono::seconds span) {
  const double before = cpu_seconds_of(pid);
  const auto since = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(span);
  return (cpu_seconds_of(pid) - before) /
         std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// The message of the StoreError `call` throws ("" when none).
template <class F>
std::string refusal_of(F&& call) {
  try {
    call();
  } catch (const StoreError& e) {
    return e.what();
  }
  return "";
}

// The line of `text` that holds `part` ("" when none).
std::string line_with(const std::string& text, const std::string& part) {
  auto at = text.find(part);
  if (at == std::string::npos) return "";
  auto begin = text.rfind('\n', at);
  begin = begin == std::string::npos ? 0 : begin + 1;
  return text.substr(begin, text.find('\n', at) - begin);
}

}  // namespace

TEST_CASE(
    "agent: c10d with a secret - strangers and another secret are refused, a client with the "
    "secret cannot stop the job, a frozen host is named once") {
  TempDir dir;
  const std::string marker = new_marker(), stop = (dir / "stop").string();
  const int port = free_tcp_port();
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  const std::string secret = "s3cret of the hostile job";
  const auto secret_file = dir.write("secret", secret + "\n");
  const std::string prefix = "/ductile/agent/hostile/";
  std::vector<std::string> argv = {DUCTILE_CLI,
                                   "agent",
                                   "--nnodes",
                                   "2:3",
                                   "--nproc-per-node",
                                   "1",
                                   "--rdzv-backend",
                                   "c10d",
                                   "--rdzv-endpoint",
                                   endpoint,
                                   "--rdzv-id",
                                   "hostile",
                                   "--local-addr",
                                   "127.0.0.1",
                                   "--monitor-interval",
                                   "0.05",
                                   "--rdzv-conf",
                                   "keep_alive_interval=1,keep_alive_max_attempt=2",
                                   "--no-python",
                                   "/bin/sh",
                                   "-c",
                                   "echo \"up rank $RANK of $WORLD_SIZE round $DUCTILE_ROUND\"; "
                                   "while [ ! -e " +
                                       stop + " ]; do sleep 0.05; done"};
  std::vector<std::unique_ptr<Child>> agents;
  auto start = [&](const std::string& name, const std::string& secret_variable) {
    agents.push_back(std::make_unique<Child>(
        argv, std::vector<std::string>{marker, "TMPDIR=" + dir.path().string(), secret_variable},
        dir / (name + ".log")));
    return agents.back().get();
  };
  auto all_output = [&] {
    std::string out;
    for (auto& a : agents) out += a->output();
    return out;
  };
  auto dump = [&] { std::cout << all_output(); };

  // A secret the agent cannot take: exit 2, naming the variable, before
  // anything starts (a FIFO is refused without waiting for a writer).
  const std::string fifo = (dir / "fifo").string();
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  for (const auto& [variables, message] :
       std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"DUCTILE_RDZV_SECRET_FILE=" + fifo},
            "DUCTILE_RDZV_SECRET_FILE=" + fifo +
                ": not a regular file; give a regular file of 1 to 4096 bytes that holds the "
                "job's secret"},
           {{"DUCTILE_RDZV_SECRET_FILE=" + secret_file.string(), "DUCTILE_RDZV_SECRET=x"},
            "DUCTILE_RDZV_SECRET and DUCTILE_RDZV_SECRET_FILE are both set: set one of them"}}) {
    std::vector<std::string> env = {marker, "TMPDIR=" + dir.path().string()};
    env.insert(env.end(), variables.begin(), variables.end());
    Child bad(argv, env, dir / "bad.log");
    auto code = bad.wait(30s);
    if (code != std::optional<int>(2)) std::cout << bad.output();
    CHECK(code == std::optional<int>(2));
    CHECK(bad.output().find("ductile: error: " + message) != std::string::npos);
  }

  // The host takes its secret from a file, the other from the variable.
  Child* host = start("host", "DUCTILE_RDZV_SECRET_FILE=" + secret_file.string());
  REQUIRE(host->wait_for_output("hosting the c10d rendezvous at port", 60s));
  Child* other = start("other", "DUCTILE_RDZV_SECRET=" + secret);
  bool formed = wait_until([&] { return count_of(all_output(), " of 2 round ") == 2; }, 120s);
  if (!formed) dump();
  REQUIRE(formed);

  // A stranger: refused, nothing written; a raw request is answered
  // "unauthorized" and the connection closed.
  RendezvousClient stranger("127.0.0.1", port, 5000ms, "the c10d rendezvous");
  CHECK_THROWS_AS(stranger.put(prefix + "nodes/stranger", "{}"), StoreRefused);
  RendezvousClient insider("127.0.0.1", port, 10000ms, "the c10d rendezvous", secret);
  CHECK_FALSE(insider.get(prefix + "nodes/stranger").has_value());

  // An agent with another secret: exit 2, naming the variable.
  Child* wrong = start("wrong", "DUCTILE_RDZV_SECRET=another secret");
  auto status = wrong->wait(60s);
  if (status != std::optional<int>(2)) dump();
  CHECK(status == std::optional<int>(2));
  const std::string wrong_line = line_with(wrong->output(), "error:");
  CHECK(wrong_line.find("the secrets differ") != std::string::npos);
  CHECK(wrong_line.find("(this agent's secret: from DUCTILE_RDZV_SECRET)") != std::string::npos);

  const double idle_cpu = cpu_share_of(host->pid(), 3s);

  // A lease of TTL 2^63-1: refused, not born expired.
  CHECK(refusal_of([&] {
          insider.grant_lease(std::numeric_limits<std::int64_t>::max());
        }).find("refused a lease of TTL 9223372036854775807 s: the maximum is 9000000000 s") !=
        std::string::npos);

  // Records of 5 MiB under nodes/: refused; 1 MiB ones until the store is
  // full: every read answer still fits a frame.
  CHECK(refusal_of([&] {
          insider.put(prefix + "nodes/big", std::string(5u << 20, 'x'));
        }).find("its value of 5242880 bytes is over the 1048576 bytes a value may have") !=
        std::string::npos);
  std::string full;
  for (int i = 0; i < 16 && full.empty(); ++i)
    full = refusal_of(
        [&] { insider.put(prefix + "nodes/big" + std::to_string(i), std::string(1u << 20, 'x')); });
  CHECK(full.find("over its maximum of 6291456") != std::string::npos);
  CHECK(host->wait_for_output("ignoring " + prefix + "nodes/big4", 60s));
  CHECK(other->wait_for_output("ignoring " + prefix + "nodes/big", 60s));
  insider.erase_prefix(prefix + "nodes/big");

  // Junk keys on a lease under nodes/ until the store refuses one.
  const auto lease = insider.grant_lease(600);
  std::string refused;
  int junk = 0;
  for (; junk < 20000 && refused.empty(); ++junk)
    refused =
        refusal_of([&] { insider.put(prefix + "nodes/junk" + std::to_string(junk), "x", lease); });
  CHECK(refused.find("keys, its maximum") != std::string::npos);
  CHECK(junk <= 10001);
  // Logged a few lines and a count, not one line per key.
  bool counted = host->wait_for_output("more record(s) under " + prefix + "nodes/", 60s);
  if (!counted) dump();
  CHECK(counted);
  const double host_cpu = cpu_share_of(host->pid(), 3s);
  MESSAGE("the host agent with " << junk << " junk keys: " << host_cpu * 100
                                 << " % of a core; without: " << idle_cpu * 100 << " %");
  CHECK(host_cpu < 0.9);  // not spinning on them (wide: the machine is shared)
  CHECK(count_of(host->output(), "ignoring ") < 40);
  CHECK(count_of(other->output(), "ignoring ") < 40);

  // While the store is full, a new agent cannot register: it says so and
  // exits 2; the job goes on. Once the keys are gone, a later joiner joins.
  Child* refused_joiner = start("refused", "DUCTILE_RDZV_SECRET=" + secret);
  status = refused_joiner->wait(60s);
  if (status != std::optional<int>(2)) dump();
  CHECK(status == std::optional<int>(2));
  CHECK(line_with(refused_joiner->output(), "error:")
            .find("cannot register this node in job 'hostile': ") != std::string::npos);
  CHECK(refused_joiner->output().find("the store holds 10000 keys, its maximum") !=
        std::string::npos);
  insider.revoke_lease(lease);
  Child* joiner = start("joiner", "DUCTILE_RDZV_SECRET=" + secret);
  bool three = wait_until([&] { return count_of(all_output(), " of 3 round ") == 3; }, 120s);
  if (!three) dump();
  CHECK(three);
  for (Child* a : {host, other, joiner}) CHECK_FALSE(a->poll().has_value());

  // The host frozen past the fence: the others are fenced, say what became
  // of their workers, and once back, name the store that came back, once.
  host->signal(SIGSTOP);
  bool fenced = wait_until(
      [&] {
        return (other->output().find("fenced: ") != std::string::npos || other->poll()) &&
               (joiner->output().find("fenced: ") != std::string::npos || joiner->poll());
      },
      20s);
  host->signal(SIGCONT);
  if (!fenced) dump();
  CHECK(fenced);
  const std::string back = "the c10d rendezvous at " + endpoint +
                           " (hosted by the agent on 127.0.0.1) reachable again after the fence: "
                           "left the old lease, registering anew";
  for (Child* a : {other, joiner}) {
    bool rejoined = a->wait_for_output(back, 60s);
    if (!rejoined) dump();
    CHECK(rejoined);
    const std::string out = a->output();
    CHECK(count_of(out, "reachable again after the fence") == 1);
    CHECK(out.find("etcd reachable") == std::string::npos);
    // The outage's line, when the fence came first, says it stopped them.
    const auto fence_at = out.find("fenced: ");
    const auto outage_at = out.find(", giving up after ");
    if (outage_at != std::string::npos && fence_at < outage_at)
      CHECK(line_with(out.substr(outage_at - std::min<std::size_t>(outage_at, 2000)),
                      ", giving up after ")
                .find("the fence stopped this node's workers") != std::string::npos);
  }
  bool reformed = wait_until([&] { return count_of(all_output(), " of 3 round ") >= 6; }, 120s);
  if (!reformed) dump();
  CHECK(reformed);

  std::ofstream(stop) << "stop";
  for (Child* a : {host, other, joiner}) {
    auto code = a->wait(60s);
    if (code != std::optional<int>(0)) dump();
    CHECK(code == std::optional<int>(0));
  }
  CHECK(no_marked_processes(marker));
}
