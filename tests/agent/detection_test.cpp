// A lost node is known from its link to the leader, not from its lease:
// a killed node's link closes at once, a stopped node's falls silent for
// --heartbeat; either way its lease is revoked and the round re-forms
// without it long before the lease (30 s here) could expire.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "agent_job.hpp"
#include "ductile/agent/etcd_store.hpp"

using namespace ductile::test;

namespace {

// `pid` and every process below it (the agent's guards and workers).
std::vector<int> process_tree(int pid) {
  std::vector<std::pair<int, int>> parents;  // (pid, its parent)
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_text(entry.path() / "stat");
    // pid (comm) state ppid ...: comm may hold spaces, the last ')' ends it.
    const auto close = stat.rfind(')');
    char state = 0;
    int parent = 0;
    if (close != std::string::npos &&
        std::sscanf(stat.c_str() + close + 1, " %c %d", &state, &parent) == 2)
      parents.emplace_back(std::stoi(name), parent);
  }
  std::vector<int> tree = {pid};
  for (std::size_t i = 0; i < tree.size(); ++i)
    for (const auto& [child, parent] : parents)
      if (parent == tree[i]) tree.push_back(child);
  return tree;
}

int connect_to(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  at.sin_port = htons(static_cast<std::uint16_t>(port));
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&at), sizeof at) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

void send_bytes(int fd, const std::string& bytes) {
  CHECK(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size()));
}

// The tree of an agent whose worker runs: the agent, the worker's guard
// and the worker (a tree read before the guard forked the worker would
// leave the worker out).
std::vector<int> node_tree(int agent) {
  std::vector<int> tree;
  REQUIRE(wait_until(
      [&] {
        tree = process_tree(agent);
        return tree.size() >= 3;
      },
      30s));
  return tree;
}

void signal_tree(const std::vector<int>& tree, int sig) {
  for (int pid : tree) ::kill(pid, sig);
}

// The age index of job "job" holds one entry per registration: ages/<its
// create revision, 20 digits>/<id>, on its lease, with its record.
void check_age_index(const Job& job) {
  ductile::agent::EtcdStore store(job.etcd.endpoint());
  const std::string prefix = "/ductile/agent/job/";
  const auto nodes = store.get_prefix(prefix + "nodes/");
  const auto ages = store.get_prefix(prefix + "ages/");
  CHECK(ages.size() == nodes.size());
  for (const auto& node : nodes) {
    char revision[32];
    std::snprintf(revision, sizeof revision, "%020lld",
                  static_cast<long long>(node.create_revision));
    const std::string key =
        prefix + "ages/" + revision + "/" + node.key.substr(node.key.rfind('/') + 1);
    const auto entry =
        std::find_if(ages.begin(), ages.end(),
                     [&](const ductile::agent::KeyValue& kv) { return kv.key == key; });
    INFO(key);
    REQUIRE(entry != ages.end());
    CHECK(entry->lease == node.lease);
    CHECK(entry->value == node.value);
  }
}

// 3 agents with trivial workers and a lease (`ttl` seconds: by default
// far longer than the test waits); returns once round 1 formed, with the
// leader's index.
struct ThreeNodes {
  Job job;
  std::vector<Child*> agents;
  std::size_t leader = 0;
  explicit ThreeNodes(std::vector<std::string> more = {}, const std::string& ttl = "30") {
    std::vector<std::string> options = {"--nproc-per-node", "1",   "--lease-ttl",     ttl,
                                        "--settle",         "0.5", "--poll-interval", "0.1",
                                        "--min-time",       "0",   "--stop-grace",    "1"};
    options.insert(options.end(), more.begin(), more.end());
    for (const char* name : {"a", "b", "c"}) {
      // `exec`: the worker is the sleep itself, so a tree of three holds
      // every process (dash forks a plain command; that sleep, forked
      // after the tree was read, would outlive a SIGKILL of the tree).
      agents.push_back(&job.start(name, options, sh("exec sleep 300")));
      // Registered in this order: a leads, b is next in line.
      REQUIRE(agents.back()->wait_for_output("joined job", 60s));
    }
    bool formed = wait_until(
        [&] { return count_of(job.all_output(), "round 1 started: world size 3") == 3; }, 60s);
    if (!formed) job.dump();
    REQUIRE(formed);
    for (std::size_t i = 0; i < agents.size(); ++i)
      if (agents[i]->output().find("leader: round 1 formed") != std::string::npos) leader = i;
  }
  // Every agent but `gone` leaves with SIGTERM: no loss is reported for it.
  void end(std::size_t gone) {
    for (std::size_t i = 0; i < agents.size(); ++i)
      if (i != gone) agents[i]->signal(SIGTERM);
    for (std::size_t i = 0; i < agents.size(); ++i)
      if (i != gone) CHECK(agents[i]->wait(30s) == std::optional<int>(128 + SIGTERM));
    const bool none_left = no_marked_processes(job.marker);
    if (!none_left) {
      for (int pid : marked_processes(job.marker))
        std::printf("left: %d %s\n", pid,
                    read_text("/proc/" + std::to_string(pid) + "/cmdline").c_str());
      job.dump();
    }
    CHECK(none_left);
  }
};

}  // namespace

TEST_CASE(
    "agent: a killed node's link closes and the round re-forms without waiting for its "
    "lease") {
  ThreeNodes nodes;
  REQUIRE(nodes.leader == 0);
  Child& victim = *nodes.agents[2];
  const auto tree = node_tree(victim.pid());
  const auto killed = Clock::now();
  signal_tree(tree, SIGKILL);
  victim.wait(10s);
  Child& leader = *nodes.agents[0];
  // Far below the 30 s TTL; a bound only so that a failure ends the test.
  bool reformed = leader.wait_for_output("leader: round 2 formed: node(s) c left", 15s);
  if (!reformed) nodes.job.dump();
  REQUIRE(reformed);
  std::printf("round re-formed %.2f s after SIGKILL (lease TTL 30 s)\n", seconds_since(killed));
  CHECK(leader.output().find("node c lost: its link closed; its lease revoked") !=
        std::string::npos);
  // Both survivors in round 2 before they are stopped.
  for (std::size_t i : {0, 1})
    CHECK(nodes.agents[i]->wait_for_output("round 2 started: world size 2", 30s));
  nodes.end(2);
  // Leaving on purpose is no loss: b's goodbye, and a's own.
  const std::string out = nodes.job.all_output();
  CHECK(count_of(out, " lost: ") == 1);
  CHECK(count_of(out, "error:") == 0);
}

// A silent node may be alive beyond a cut: its lease goes only once its own
// fence must have stopped its workers (its leader's link silent for
// --heartbeat and no renewal within a quarter of it; here 1.6 s after its
// last byte heard, where 3/4 of the 6 s TTL would be 4.5 s), by the
// leader's revocation or by its expiry, whichever comes first.
TEST_CASE("agent: a stopped node falls silent, is revoked, and after SIGCONT is fenced") {
  ThreeNodes nodes({"--heartbeat", "1"}, "6");
  REQUIRE(nodes.leader == 0);
  Child& victim = *nodes.agents[2];
  const auto tree = node_tree(victim.pid());
  signal_tree(tree, SIGSTOP);
  Child& leader = *nodes.agents[0];
  bool reformed = leader.wait_for_output("leader: round 2 formed: node(s) c left", 15s);
  if (!reformed) nodes.job.dump();
  signal_tree(tree, SIGCONT);
  REQUIRE(reformed);
  CHECK(leader.output().find("node c silent for ") != std::string::npos);
  CHECK(leader.output().find("(--heartbeat 1 s): its lease is revoked once its fence has "
                             "stopped its workers (1.6 s after the last byte heard)") !=
        std::string::npos);
  // Resumed, it finds its lease gone: its round 1 workers are killed
  // before anything else (they never train beside round 2), and it joins
  // again as a new node.
  bool fenced = victim.wait_for_output("fenced: ", 30s);
  if (!fenced) nodes.job.dump();
  REQUIRE(fenced);
  const std::string own = victim.output();
  CHECK(own.find("round 2 started") == std::string::npos);
  bool rejoined = wait_until(
      [&] { return count_of(nodes.job.all_output(), "started: world size 3") == 6; }, 60s);
  if (!rejoined) nodes.job.dump();
  CHECK(rejoined);
  // Its new registration (another lease, another revision) is in the age
  // index, its old one is not.
  check_age_index(nodes.job);
  // Its own silence was not taken for the leader's.
  CHECK(count_of(nodes.job.all_output(), " lost: ") == 0);
  for (Child* agent : nodes.agents) agent->signal(SIGTERM);
  for (Child* agent : nodes.agents) CHECK(agent->wait(30s) == std::optional<int>(128 + SIGTERM));
  CHECK(no_marked_processes(nodes.job.marker));
}

// The leader and etcd stop at once, as when a node's links and its store
// are cut: b and c hear nothing from the leader for --heartbeat and cannot
// renew their leases; either may be the one cut off, and the leader's
// judge (b) counts on their fence, so each kills its workers a quarter
// heartbeat later, long before 3/4 of the 30 s TTL. Resumed, the job
// forms again with all three.
TEST_CASE("agent: nodes cut off from the leader and from etcd fence their workers at once") {
  ThreeNodes nodes({"--heartbeat", "1"});
  REQUIRE(nodes.leader == 0);
  const auto leader_tree = node_tree(nodes.agents[0]->pid());
  std::vector<int> workers;
  for (std::size_t i : {1, 2}) workers.push_back(node_tree(nodes.agents[i]->pid()).back());
  const auto cut = Clock::now();
  ::kill(nodes.job.etcd.pid(), SIGSTOP);
  signal_tree(leader_tree, SIGSTOP);
  const std::string fenced =
      "fenced: the link to the leader, node a, fell silent and no lease renewal succeeded "
      "within 250 ms";
  const bool both = wait_until([&] { return count_of(nodes.job.all_output(), fenced) == 2; }, 15s);
  const double after = seconds_since(cut);
  ::kill(nodes.job.etcd.pid(), SIGCONT);
  signal_tree(leader_tree, SIGCONT);
  if (!both) nodes.job.dump();
  REQUIRE(both);
  std::printf("both fenced %.2f s after the cut (--heartbeat 1, lease TTL 30 s)\n", after);
  CHECK(after < 10.0);  // 3/4 of the TTL would be 22.5 s
  for (int worker : workers) {
    const bool gone = wait_until([&] { return ::kill(worker, 0) != 0; }, 10s);
    CHECK(gone);
  }
  const bool formed = wait_until(
      [&] { return count_of(nodes.job.all_output(), "started: world size 3") >= 5; }, 90s);
  if (!formed) nodes.job.dump();
  CHECK(formed);
  for (Child* agent : nodes.agents) agent->signal(SIGTERM);
  for (Child* agent : nodes.agents) CHECK(agent->wait(30s) == std::optional<int>(128 + SIGTERM));
  CHECK(no_marked_processes(nodes.job.marker));
}

TEST_CASE("agent: a killed leader's link closes, the next oldest revokes its lease and leads") {
  ThreeNodes nodes;
  REQUIRE(nodes.leader == 0);
  Child& leader = *nodes.agents[0];
  signal_tree(node_tree(leader.pid()), SIGKILL);
  leader.wait(10s);
  Child& next = *nodes.agents[1];
  bool reformed = next.wait_for_output("leader: round 2 formed: node(s) a left", 15s);
  if (!reformed) nodes.job.dump();
  REQUIRE(reformed);
  CHECK(next.output().find("node a lost: its link closed; its lease revoked") != std::string::npos);
  // Only the next oldest acts on the leader's link.
  CHECK(nodes.agents[2]->output().find(" lost: ") == std::string::npos);
  for (std::size_t i : {1, 2})
    CHECK(nodes.agents[i]->wait_for_output("round 2 started: world size 2", 30s));
  nodes.end(0);
}

TEST_CASE("agent: a bad --heartbeat is refused by name") {
  TempDir dir;
  const auto config = dir.write("job.toml", kJobToml);
  for (const auto& [given, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--heartbeat", "0.01"}, "--heartbeat 0.01 is invalid: give seconds from 0.1 to 60"},
           {{"--heartbeat", "-1"}, "--heartbeat -1 is invalid"},
           {{"--rdzv-conf", "heartbeat=soon"}, "--rdzv-conf heartbeat 'soon' is invalid"},
           {{"--rdzv-conf", "heartbeat=120"}, "--heartbeat 120 is invalid"},
           {{"--heartbeat", "1", "--rdzv-conf", "heartbeat=2"},
            "--rdzv-conf heartbeat=2 and --heartbeat 1 differ"}}) {
    std::vector<std::string> argv = {
        DUCTILE_CLI,          "agent",    "--config", config.string(),    "--rdzv",
        "etcd://127.0.0.1:1", "--job-id", "j",        "--nproc-per-node", "1"};
    argv.insert(argv.end(), given.begin(), given.end());
    argv.insert(argv.end(), {"--", "true"});
    auto r = run_process(argv);
    INFO(given.back() << ": " << r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(message) != std::string::npos);
  }
}

// Strangers on the leader's link port: idle connections past the bound,
// garbage, and a well-formed hello that names a member with a lease not
// its own, then closes. None of them costs a member its lease, and the
// leader still hears its members: a killed one is known at once.
TEST_CASE("agent: strangers on the link port neither stall the leader nor revoke a member") {
  ThreeNodes nodes({"--heartbeat", "1"});
  REQUIRE(nodes.leader == 0);
  ductile::agent::EtcdStore store(nodes.job.etcd.endpoint());
  const auto record = store.get("/ductile/agent/job/nodes/a");
  REQUIRE(record);
  const std::string port = field_after(record->value, "\"link_port\"", ":");
  REQUIRE_FALSE(port.empty());
  const int link_port = std::stoi(port.substr(0, port.find_first_not_of("0123456789")));
  std::vector<int> strangers;
  for (int i = 0; i < 200; ++i)
    if (int fd = connect_to(link_port); fd >= 0) strangers.push_back(fd);
  CHECK(strangers.size() == 200);
  // Cut or not by now (the oldest of too many): whatever they send is lost.
  for (const std::string& garbage : {std::string(4096, 'x'), "DLK2" + std::string(32, '\0')})
    for (int fd : {strangers.back(), strangers[strangers.size() - 2]})
      ::send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL);
  // A hello as an agent without a secret sends it, naming b with a lease
  // that is not b's, then gone.
  const auto b = store.get("/ductile/agent/job/nodes/b");
  REQUIRE(b);
  int forged = connect_to(link_port);
  REQUIRE(forged >= 0);
  send_bytes(forged, "DLK1" + std::string(32, 'n'));
  char answer[65];
  CHECK(::recv(forged, answer, sizeof answer, MSG_WAITALL) == 65);
  std::int64_t lease = b->lease + 1;
  std::string hello(1 + 32, '\0');
  hello += '\1';
  hello += 'b';
  hello.append(reinterpret_cast<const char*>(&lease), sizeof lease);
  send_bytes(forged, hello);
  send_bytes(forged, "HHH");
  ::close(forged);
  // Longer than --heartbeat: b and c stay linked and alive.
  std::this_thread::sleep_for(3s);
  for (int fd : strangers) ::close(fd);
  const auto still = store.get("/ductile/agent/job/nodes/b");
  REQUIRE(still);
  CHECK(still->lease == b->lease);
  CHECK(count_of(nodes.job.all_output(), " lost: ") == 0);
  CHECK(count_of(nodes.job.all_output(), " silent for ") == 0);
  CHECK(count_of(nodes.job.all_output(), "round 2") == 0);
  signal_tree(node_tree(nodes.agents[2]->pid()), SIGKILL);
  nodes.agents[2]->wait(10s);
  CHECK(nodes.agents[0]->wait_for_output("node c lost: its link closed; its lease revoked", 15s));
  for (std::size_t i : {0, 1})
    CHECK(nodes.agents[i]->wait_for_output("round 2 started: world size 2", 30s));
  nodes.end(2);
}
