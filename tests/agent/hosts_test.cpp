// `ductile agent` across hosts: agents in network
// namespaces of their own (an address each, veth pairs on a bridge, made and
// removed by the test), one host's link cut and restored; and a job on a
// 3-member etcd cluster that loses one member, then two, then gets them back.
// The namespace test exits 77 (ctest: skipped) with the kernel's reason
// where namespaces cannot be made.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "agent_job.hpp"
#include "process.hpp"

using namespace ductile::test;

namespace {

// `ip` with arguments; throws with its output when it fails.
void ip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {DUCTILE_IP};
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = run_process(argv);
  if (r.exit_code != 0) {
    std::string line;
    for (const auto& a : argv) line += a + " ";
    throw std::runtime_error(line + "failed: " + r.out + r.err);
  }
}

// Hosts as network namespaces on one bridge: host h has the address
// 10.213.N.(10 + h)/24 on its end of a veth pair whose other end is on the
// bridge; the bridge (in the test's namespace) is 10.213.N.1, where the
// test's etcd listens. Everything is removed by the destructor.
class Hosts {
 public:
  explicit Hosts(int count) {
    // Short names (interface names have at most 15 characters), unique to
    // this process; a subnet no interface of this machine uses.
    tag_ = "dk" + std::to_string(getpid() % 100000);
    auto used = run_process({DUCTILE_IP, "-o", "addr"}).out;
    for (int n = getpid() % 250;; n = (n + 1) % 250)
      if (used.find("10.213." + std::to_string(n) + ".") == std::string::npos) {
        subnet_ = "10.213." + std::to_string(n) + ".";
        break;
      }
    auto r = run_process({DUCTILE_IP, "netns", "add", ns(0)});
    if (r.exit_code != 0) {
      refused_ = "the kernel refused a network namespace (ip netns add: " + r.err +
                 "); run as root on a kernel with CONFIG_NET_NS";
      return;
    }
    made_ = 1;
    try {
      ip({"link", "add", bridge(), "type", "bridge"});
      bridge_made_ = true;
      ip({"addr", "add", gateway() + "/24", "dev", bridge()});
      ip({"link", "set", bridge(), "up"});
      for (int h = 0; h < count; ++h) {
        if (h > 0) {
          ip({"netns", "add", ns(h)});
          made_ = h + 1;
        }
        ip({"link", "add", outer(h), "type", "veth", "peer", "name", inner(h)});
        ip({"link", "set", inner(h), "netns", ns(h)});
        ip({"link", "set", outer(h), "master", bridge()});
        ip({"link", "set", outer(h), "up"});
        ip({"-n", ns(h), "addr", "add", addr(h) + "/24", "dev", inner(h)});
        ip({"-n", ns(h), "link", "set", inner(h), "up"});
        ip({"-n", ns(h), "link", "set", "lo", "up"});
      }
    } catch (const std::exception& e) {
      refused_ = std::string("the kernel refused the hosts' network: ") + e.what();
    }
  }
  ~Hosts() {
    for (int h = 0; h < made_; ++h) run_process({DUCTILE_IP, "netns", "del", ns(h)});
    if (bridge_made_) run_process({DUCTILE_IP, "link", "del", bridge()});
  }
  Hosts(const Hosts&) = delete;
  Hosts& operator=(const Hosts&) = delete;

  const std::string& refused() const { return refused_; }
  std::string addr(int h) const { return subnet_ + std::to_string(10 + h); }
  std::string gateway() const { return subnet_ + "1"; }
  // argv run inside host h's namespace.
  std::vector<std::string> on(int h, std::vector<std::string> argv) const {
    argv.insert(argv.begin(), {DUCTILE_IP, "netns", "exec", ns(h)});
    return argv;
  }
  void cut(int h) { ip({"link", "set", outer(h), "down"}); }
  void restore(int h) { ip({"link", "set", outer(h), "up"}); }

 private:
  std::string ns(int h) const { return tag_ + "h" + std::to_string(h); }
  std::string bridge() const { return tag_ + "br"; }
  std::string outer(int h) const { return tag_ + "h" + std::to_string(h) + "o"; }
  std::string inner(int h) const { return tag_ + "h" + std::to_string(h) + "i"; }

  std::string tag_, subnet_, refused_;
  int made_ = 0;
  bool bridge_made_ = false;
};

// The heartbeats (ns since the epoch) in the files of `dir` whose names
// start with `prefix`.
std::vector<std::int64_t> beats(const std::filesystem::path& dir, const std::string& prefix) {
  std::vector<std::int64_t> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.path().filename().string().starts_with(prefix)) continue;
    std::istringstream in(read_text(entry.path()));
    for (std::int64_t t; in >> t;) out.push_back(t);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("agent: hosts in network namespaces - a cut host fences its workers and rejoins") {
  Hosts hosts(3);
  if (!hosts.refused().empty()) {
    std::printf("SKIPPED: %s\n", hosts.refused().c_str());
    std::fflush(stdout);
    std::_Exit(77);
  }
  TempDir dir;
  const std::string marker = new_marker();
  EtcdServer etcd(dir.path(), std::nullopt, hosts.gateway());
  auto config = dir.write("job.toml", kJobToml);
  const std::string stop = (dir / "stop").string();
  std::filesystem::create_directories(dir / "beats");
  std::vector<std::unique_ptr<Child>> agents;
  for (int h = 0; h < 3; ++h) {
    std::string name = "host" + std::to_string(h);
    agents.push_back(std::make_unique<Child>(hosts.on(h, {DUCTILE_CLI,
                                                          "agent",
                                                          "--config",
                                                          config.string(),
                                                          "--rdzv",
                                                          etcd.url(),
                                                          "--job-id",
                                                          "hosts",
                                                          "--node-id",
                                                          name,
                                                          "--node-addr",
                                                          hosts.addr(h),
                                                          "--nproc-per-node",
                                                          "1",
                                                          "--lease-ttl",
                                                          "4",
                                                          "--settle",
                                                          "1",
                                                          "--stop-grace",
                                                          "1",
                                                          "--store-timeout",
                                                          "300",
                                                          "--",
                                                          DUCTILE_PYTHON,
                                                          DUCTILE_AGENT_WORKERS "/beat.py",
                                                          (dir / "beats").string(),
                                                          stop}),
                                             std::vector<std::string>{marker},
                                             dir / (name + ".log")));
  }
  auto output = [&] {
    std::string out;
    for (auto& a : agents) out += a->output();
    return out;
  };
  auto dump = [&] {
    for (auto& a : agents) std::cout << "---- agent\n" << a->output();
  };
  bool met = wait_until([&] { return count_of(output(), "met round=1 world=3") == 1; }, 120s);
  if (!met) dump();
  REQUIRE(met);
  // Rank 0 met the others at its host's address, across namespaces.
  CHECK(output().find("ranks=[0, 1, 2] at 10.213.") != std::string::npos);

  // Cut the leader's host (the others must also find a new leader).
  int cut = -1;
  for (int h = 0; h < 3; ++h)
    if (agents[h]->output().find("leader: round 1 formed") != std::string::npos) cut = h;
  REQUIRE(cut >= 0);
  const std::string cut_name = "host" + std::to_string(cut);
  std::vector<Child*> others;
  for (int h = 0; h < 3; ++h)
    if (h != cut) others.push_back(agents[h].get());
  auto cut_at = Clock::now();
  hosts.cut(cut);
  // Its judge's link (the next oldest's) silent and etcd out of reach: it
  // fences a quarter heartbeat after --heartbeat, not at 3/4 of the TTL.
  bool fenced = agents[cut]->wait_for_output(
      "fell silent and no lease renewal succeeded within 250 ms, so this node may be the one "
      "cut off",
      60s);
  double fenced_s = seconds_since(cut_at);
  bool reformed = wait_until(
      [&] {
        return std::all_of(others.begin(), others.end(), [](Child* a) {
          return a->output().find("round 2 started: world size 2") != std::string::npos;
        });
      },
      60s);
  double reformed_s = seconds_since(cut_at);
  if (!fenced || !reformed) dump();
  REQUIRE(fenced);
  REQUIRE(reformed);
  // The fencing: the cut host's last heartbeat came before the first of the
  // re-formed group, so two groups never trained at once.
  bool round2_beats = wait_until(
      [&] {
        for (int h = 0; h < 3; ++h)
          if (h != cut && beats(dir / "beats", "beat.host" + std::to_string(h) + ".2.").empty())
            return false;
        return true;
      },
      60s);
  REQUIRE(round2_beats);
  auto cut_beats = beats(dir / "beats", "beat." + cut_name + ".1.");
  std::vector<std::int64_t> new_group;
  for (int h = 0; h < 3; ++h)
    if (h != cut)
      for (auto t : beats(dir / "beats", "beat.host" + std::to_string(h) + ".2."))
        new_group.push_back(t);
  std::sort(new_group.begin(), new_group.end());
  REQUIRE_FALSE(cut_beats.empty());
  CHECK(cut_beats.back() < new_group.front());
  std::printf(
      "cut host (lease TTL 4 s): fenced %.2f s after the cut; the others' round 2 started "
      "%.2f s after it; %.3f s between the cut host's last heartbeat and the new group's first\n",
      fenced_s, reformed_s, (new_group.front() - cut_beats.back()) / 1e9);
  // The workers' lines reach the agents' output through their pipes, after
  // the beats reach the files: wait for the line, then count it.
  wait_until([&] { return count_of(output(), "met round=2 world=2") >= 1; }, 30s);
  CHECK(count_of(output(), "met round=2 world=2") == 1);

  // Restore the link: the host registers anew and is admitted again.
  hosts.restore(cut);
  bool back = wait_until(
      [&] {
        return std::all_of(agents.begin(), agents.end(), [](const std::unique_ptr<Child>& a) {
          return a->output().find("round 3 started: world size 3") != std::string::npos;
        });
      },
      120s);
  if (!back) dump();
  CHECK(back);
  CHECK(agents[cut]->output().find(" reachable again after the fence: left the old lease") !=
        std::string::npos);
  CHECK(wait_until([&] { return count_of(output(), "met round=3 world=3") == 1; }, 120s));

  std::ofstream(stop) << "stop";
  for (auto& a : agents) {
    auto status = a->wait(60s);
    if (status != std::optional<int>(0)) dump();
    CHECK(status == std::optional<int>(0));
  }
  CHECK(no_marked_processes(marker));
}

TEST_CASE("agent: a 3-member etcd cluster - one member lost, then two, then back") {
  TempDir dir;
  const std::string marker = new_marker();
  EtcdCluster etcd(dir.path(), 3);
  auto config = dir.write("job.toml", kJobToml);
  const std::string stop = (dir / "stop").string();
  auto start_agents = [&](const std::string& run) {
    std::vector<std::unique_ptr<Child>> agents;
    for (const char* name : {"a", "b"})
      agents.push_back(std::make_unique<Child>(
          std::vector<std::string>{DUCTILE_CLI,
                                   "agent",
                                   "--config",
                                   config.string(),
                                   "--rdzv",
                                   etcd.url(),
                                   "--job-id",
                                   "cluster",
                                   "--node-id",
                                   name,
                                   "--node-addr",
                                   "127.0.0.1",
                                   "--nproc-per-node",
                                   "1",
                                   "--min-nodes",
                                   "2",
                                   "--lease-ttl",
                                   "10",
                                   "--settle",
                                   "1",
                                   "--stop-grace",
                                   "1",
                                   "--store-timeout",
                                   "8",
                                   "--",
                                   DUCTILE_PYTHON,
                                   DUCTILE_AGENT_WORKERS "/steps.py",
                                   dir.path().string(),
                                   stop},
          std::vector<std::string>{marker}, dir / (std::string(name) + "-" + run + ".log")));
    return agents;
  };
  auto steps = [&] { return count_of(read_text(dir / "steps.log"), "\n"); };
  auto agents = start_agents("1");
  auto dump = [&] {
    for (auto& a : agents) std::cout << "---- agent\n" << a->output();
  };
  bool running = wait_until([&] { return steps() >= 5; }, 120s);
  if (!running) dump();
  REQUIRE(running);

  // One member lost (the first endpoint: the agents' first choice): the
  // job goes on in its round.
  etcd.kill(0);
  std::size_t at_kill = steps();
  bool on = wait_until([&] { return steps() >= at_kill + 30; }, 60s);
  CHECK(on);
  for (auto& a : agents) {
    CHECK_FALSE(a->poll().has_value());
    CHECK(a->output().find("round 2") == std::string::npos);
    CHECK(a->output().find("fenced") == std::string::npos);
  }

  // Two lost: no quorum. The fence stops the workers, then the agents stop
  // with exit 1 and a message once --store-timeout has passed.
  etcd.kill(1);
  auto killed_at = Clock::now();
  for (auto& a : agents) {
    auto status = a->wait(120s);
    if (status != std::optional<int>(1)) dump();
    CHECK(status == std::optional<int>(1));
    CHECK(a->output().find("fenced: no lease renewal") != std::string::npos);
    CHECK(a->output().find("error: etcd at " + etcd.endpoints() + " unreachable for") !=
          std::string::npos);
  }
  std::printf("2 of 3 etcd members killed: the agents stopped after %.2f s (--store-timeout 8)\n",
              seconds_since(killed_at));
  CHECK(no_marked_processes(marker));
  std::size_t saved = steps();

  // The members back: the job, started again, resumes from its checkpoint.
  etcd.start(0);
  etcd.start(1);
  etcd.wait_ready();
  agents = start_agents("2");
  bool resumed = wait_until([&] { return steps() >= saved + 5; }, 120s);
  if (!resumed) dump();
  CHECK(resumed);
  std::ofstream(stop) << "stop";
  for (auto& a : agents) {
    auto status = a->wait(60s);
    if (status != std::optional<int>(0)) dump();
    CHECK(status == std::optional<int>(0));
  }
  std::string out;
  for (auto& a : agents) {
    out += a->output();
    // Once: etcd extends every lease when a leader is elected again, so the
    // first run's round can still stand when the agents come back; a node
    // must not start workers in it (another registration of its id), only in
    // the round the two form then.
    CHECK_MESSAGE(count_of(a->output(), " started: world size") == 1, a->output());
  }
  CHECK(out.find(" world=2 at step " + std::to_string(saved)) != std::string::npos);
  // Every step once, in order, across the two runs.
  std::istringstream log(read_text(dir / "steps.log"));
  std::size_t expected = 0;
  for (std::size_t step; log >> step;) {
    std::string round;
    log >> round;
    CHECK(step == expected);
    ++expected;
  }
  CHECK(no_marked_processes(marker));
}
