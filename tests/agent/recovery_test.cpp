// How agents recover from lost nodes, as the survivors see it: a round
// formed with a member that died before it published its snapshot holdings
// is given up for the next one at once; a survivor left with too few nodes
// says what it waits for and gives up at --rdzv-conf join_timeout; the
// survivors' workers, whose collectives fail as a peer dies, end with one
// line saying why the round ended. Real agents on a real etcd (started
// by the test).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "agent_job.hpp"
#include "ductile/agent/etcd_store.hpp"
#include "process.hpp"
#include "zero3_job.hpp"

using namespace ductile::test;

// Not an anonymous namespace: a unity build puts this file beside other
// tests, whose helpers' names would clash.
namespace recovery_test {

// Nodes a (the leader: it joins first), b and c, once all three run round 1.
std::tuple<Child&, Child&, Child&> start_three(Job& job, const std::vector<std::string>& options,
                                               const std::vector<std::string>& worker) {
  Child& a = job.start("a", options, worker);
  REQUIRE(a.wait_for_output("joined job", 60s));
  Child& b = job.start("b", options, worker);
  Child& c = job.start("c", options, worker);
  const bool formed = wait_until(
      [&] { return count_of(job.all_output(), "round 1 started: world size 3") == 3; }, 120s);
  if (!formed) job.dump();
  REQUIRE(formed);
  return {a, b, c};
}

}  // namespace recovery_test

using namespace recovery_test;

// Two nodes of three lost at once: b SIGKILLed, c's agent stopped
// (SIGSTOP). The leader knows b from its closed link and forms round 2
// with itself and c, which never publishes its snapshot holdings; c's
// silent link has its lease revoked after --heartbeat (1 s), before the
// holdings' patience (max(10 s, 4 x --lease-ttl) = 16 s) would end: the
// survivor gives round 2 up at once and the leader forms round 3 without
// it. Each worker commits a snapshot first: a round formed while no node
// holds one has no holdings to wait for. The survivor's workers, started
// ahead of round 2's restore, are stopped with it.
TEST_CASE("agent: a member that died before the round's holdings ends the wait for them") {
  Job job;
  const std::vector<std::string> worker = sh(R"SH(d="$DUCTILE_SNAPSHOT_DIR"
t="$d/step1"; mkdir -p "$t"
printf 'rank%s' "$RANK" > "$t/rank$RANK-of-3.bin"
printf '{"shards":[{"file":"rank0-of-3.bin","bytes":5},{"file":"rank1-of-3.bin","bytes":5},{"file":"rank2-of-3.bin","bytes":5}],"step":1}' > "$t/manifest.json"
sum=$(sha256sum "$t/manifest.json" | cut -c1-64)
printf '%s  manifest.json
' "$sum" > "$t/manifest.json.sha256"
printf 'step1
sha256 %s
' "$sum" > "$d/latest.new" && mv "$d/latest.new" "$d/latest"
exec sleep 600)SH");
  const std::string shm = (job.dir / "shm").string();
  std::filesystem::create_directories(shm);
  const std::vector<std::string> options = {"--nproc-per-node", "1", "--min-nodes",    "1",
                                            "--settle",         "1", "--stop-grace",   "2",
                                            "--lease-ttl",      "4", "--snapshot-dir", shm};
  auto [a, b, c] = start_three(job, options, worker);
  REQUIRE(a.output().find("leader: round 1 formed") != std::string::npos);
  // Every node published its snapshot (the leader reads the records).
  ductile::agent::EtcdStore store(job.etcd.endpoint());
  const bool published = wait_until(
      [&] {
        for (const char* node : {"a", "b", "c"}) {
          const auto record = store.get(std::string("/ductile/agent/job/snapshots/") + node);
          if (!record || record->value.find(R"("tag":"step1")") == std::string::npos) return false;
        }
        return true;
      },
      60s);
  if (!published) job.dump();
  REQUIRE(published);

  b.signal(SIGKILL);
  c.signal(SIGSTOP);
  const auto killed = Clock::now();
  const bool recovered = a.wait_for_output("started: world size 1 (1 nodes x 1)", 60s);
  const double seconds = seconds_since(killed);
  if (!recovered) job.dump();
  REQUIRE(recovered);
  MESSAGE("the survivor's workers started " << seconds << " s after the nodes were lost");
  const std::string out = a.output();
  INFO(out);
  // Round 2 was formed with c (else this test tests nothing).
  REQUIRE(out.find("leader: round 2 formed: node(s) b left") != std::string::npos);
  CHECK(out.find("round 2: member(s) c left before they published their snapshot holdings") !=
        std::string::npos);
  CHECK(out.find("no snapshot holdings from member(s)") == std::string::npos);
  CHECK(out.find("round 2: the workers started ahead of the restore load it") == std::string::npos);
  CHECK(out.find("leader: round 3 formed: node(s) c left") != std::string::npos);
  CHECK(out.find("round 3 started: world size 1") != std::string::npos);

  a.signal(SIGTERM);
  CHECK(a.wait(30s).has_value());
  b.wait(10s);
  c.signal(SIGKILL);
  c.wait(10s);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

// --nnodes 2:3 and two of three nodes SIGKILLed: the survivor says what it
// waits for (how many nodes it has and needs) and until when, repeats it
// every 15 s, and gives up at --rdzv-conf join_timeout with exit status 1.
TEST_CASE("agent: a survivor short of nodes says what it waits for and ends at join_timeout") {
  Job job;
  const std::vector<std::string> worker = sh("sleep 600");
  const std::vector<std::string> options = {
      "--nproc-per-node", "1", "--nnodes",    "2:3", "--settle",    "1",
      "--stop-grace",     "2", "--lease-ttl", "2",   "--rdzv-conf", "join_timeout=17"};
  auto [a, b, c] = start_three(job, options, worker);
  b.signal(SIGKILL);
  c.signal(SIGKILL);
  const auto status = a.wait(90s);
  const std::string out = a.output();
  INFO(out);
  CHECK(status == std::optional<int>(1));
  CHECK(out.find("too few nodes, waiting); 1 node(s) present of the 2 needed (--nnodes 2:3") !=
        std::string::npos);
  CHECK(out.find("--rdzv-conf join_timeout=17) with exit status 1") != std::string::npos);
  CHECK(count_of(out, "still waiting: 1 node(s) present of the 2 needed") == 1);
  CHECK(out.find("error: too few nodes for ") != std::string::npos);
  CHECK(out.find("(--rdzv-conf join_timeout): 1 node(s) present; giving up with exit status 1") !=
        std::string::npos);
  b.wait(10s);
  c.wait(10s);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

#ifdef DUCTILE_ZERO3_WORKER_ENV
namespace recovery_test {

// `root` and every process below it (by /proc's parent links) of those
// that carry `marker`.
std::vector<int> process_tree(int root, const std::string& marker) {
  std::vector<int> tree = {root};
  for (std::size_t i = 0; i < tree.size(); ++i)
    for (const int pid : marked_processes(marker)) {
      const std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
      const std::size_t paren = stat.rfind(')');
      if (paren == std::string::npos) continue;
      std::istringstream fields(stat.substr(paren + 2));
      std::string state;
      int parent = 0;
      fields >> state >> parent;
      if (parent == tree[i] && std::find(tree.begin(), tree.end(), pid) == tree.end())
        tree.push_back(pid);
    }
  return tree;
}

}  // namespace recovery_test

// Three nodes' workers all-reduce (gloo) and raise ductile.CommunicationError
// when a peer is gone, as ductile's collectives do; one node's process tree
// is lost: its agent stopped (SIGSTOP), the rest SIGKILLed. The survivors'
// workers see their peer die before the agents know (the stopped agent's
// link is revoked after --heartbeat): each ends with one line saying which
// round ended and why (the agent's reason: the node that left), not a
// traceback; the job then finishes at world size 2.
TEST_CASE("agent: a lost peer ends the survivors' workers with one line, not a traceback") {
  Job job;
  const auto worker = package_python("peer_lost.py");
  const std::vector<std::string> options = {"--nproc-per-node", "1", "--min-nodes",  "2",
                                            "--settle",         "1", "--stop-grace", "2",
                                            "--lease-ttl",      "2"};
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  Child& c = job.start("c", options, worker);
  const bool started =
      wait_until([&] { return count_of(job.all_output(), "peer_lost round=1 rank=") == 3; }, 240s);
  if (!started) job.dump();
  REQUIRE(started);
  // The node's whole process tree at once, as a machine is lost.
  c.signal(SIGSTOP);
  for (const int pid : recovery_test::process_tree(c.pid(), job.marker))
    if (pid != c.pid()) kill(pid, SIGKILL);
  for (Child* survivor : {&a, &b}) {
    const auto status = survivor->wait(120s);
    if (status != std::optional<int>(0)) job.dump();
    CHECK(status == std::optional<int>(0));
  }
  c.signal(SIGKILL);
  c.wait(10s);
  const std::string out = a.output() + b.output();
  INFO(out);
  CHECK(count_of(out, "peer_lost round=2 rank=") == 2);
  CHECK(out.find("Traceback") == std::string::npos);
  CHECK(out.find("CommunicationError") == std::string::npos);
  // A worker still inside a collective when the agent stops it says
  // nothing; one whose collective failed says this.
  const std::size_t said = count_of(out, "ductile: rank ");
  CHECK(said >= 1);
  CHECK(count_of(out, ": round 1 ended: round 2 formed: node(s) c left; this worker stops") ==
        said);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}
#endif

#ifdef DUCTILE_ZERO3_WORKER_ENV
namespace recovery_test {

// "a,b,c" -> {"a", "b", "c"}.
std::vector<std::string> node_list(const std::string& list) {
  std::vector<std::string> out;
  std::istringstream in(list);
  for (std::string node; std::getline(in, node, ',');) out.push_back(node);
  return out;
}

// A job of tests/agent/workers/zero3_in_place.py (the documented zero3
// loop over gloo, a snapshot a step copied to one other node; with `loop`
// {"--deepspeed", "ACC"} a DeepSpeed script's loop on ductile.deepspeed):
// its workers' command, their losses folder and the agents' options.
struct InPlaceRun {
  static constexpr int kSteps = 12;
  std::filesystem::path train;
  std::vector<std::string> loop, worker, options;

  explicit InPlaceRun(const Job& job, std::vector<std::string> loop_options = {})
      : train(job.dir / "train"), loop(std::move(loop_options)) {
    std::filesystem::create_directories(train);
    worker = package_python("zero3_in_place.py");
    worker.insert(worker.begin() + 1, "ZERO3_STEP_PAUSE=0.3");
    worker.push_back(train.string());
    worker.push_back(std::to_string(kSteps));
    worker.insert(worker.end(), loop.begin(), loop.end());
    const auto shm = job.dir / "shm";
    std::filesystem::create_directories(shm);
    options = {"--nproc-per-node", "1",         "--min-nodes", "2", "--settle",   "1",
               "--stop-grace",     "2",         "--lease-ttl", "2", "--min-time", "0",
               "--snapshot-dir",   shm.string()};
  }

  // Checks each node's log (one process throughout, no step skipped, at
  // most `repeats` trained twice; every step of the `kept` nodes logged)
  // and every step's mean loss over its round's nodes against plain
  // torch's: the nodes `before` (comma-separated) to the step `change`,
  // `after` past it. Returns the first step each node logged at the world
  // size of `after`.
  std::map<std::string, int> check(const Job& job, const std::string& before, int change,
                                   const std::string& after, const std::vector<std::string>& kept,
                                   int repeats) const {
    const auto nodes_of = node_list;
    const auto world_after = static_cast<int>(nodes_of(after).size());
    std::map<int, std::map<std::string, double>> last;  // step -> node -> loss
    std::map<std::string, int> first_after;
    std::set<std::string> all;
    for (const auto& n : nodes_of(before)) all.insert(n);
    for (const auto& n : nodes_of(after)) all.insert(n);
    for (const std::string& node : all) {
      std::istringstream log(read_text(train / ("losses-" + node + ".jsonl")));
      std::set<int> pids;
      int previous = -1, repeated = 0;
      for (std::string line; std::getline(log, line);) {
        const auto entry = nlohmann::json::parse(line);
        const int step = entry["step"].get<int>(), world = entry["world"].get<int>();
        pids.insert(entry["pid"].get<int>());
        INFO("node " << node << ": " << line);
        CHECK((previous < 0 || step <= previous + 1));  // none skipped
        if (previous >= 0 && step <= previous) ++repeated;
        previous = step;
        if (world == world_after && !first_after.count(node)) first_after[node] = step;
        last[step][node] = entry["loss"].get<double>();
      }
      INFO("node " << node);
      CHECK(pids.size() == 1);
      if (std::find(kept.begin(), kept.end(), node) == kept.end()) continue;
      CHECK(previous == kSteps);
      CHECK(repeated <= repeats);
    }
    auto plain = package_python("zero3_in_place.py");
    plain.push_back(job.dir.path().string());
    plain.push_back(std::to_string(kSteps));
    plain.insert(plain.end(), loop.begin(), loop.end());
    for (std::string arg : {std::string("--plain"), before, std::to_string(change), after})
      plain.push_back(arg);
    const ProcessResult ref = run_process(plain);
    INFO(ref.out << ref.err);
    REQUIRE(ref.exit_code == 0);
    const auto expected = nlohmann::json::parse(read_text(job.dir / "plain.json"));
    for (int step = 1; step <= kSteps; ++step) {
      INFO("step " << step);
      const auto members = nodes_of(step <= change ? before : after);
      double mean = 0;
      std::size_t logged = 0;
      for (const auto& node : members)
        if (last[step].count(node)) {
          mean += last[step][node] / static_cast<double>(members.size());
          ++logged;
        }
      if (logged < members.size()) {
        // Only a lost node's log ends early.
        CHECK(step > change);
        continue;
      }
      const double want = expected[std::to_string(step)].get<double>();
      CHECK(std::abs(mean - want) <= 1e-5 * std::abs(want));
    }
    return first_after;
  }
};

}  // namespace recovery_test

// Three nodes train; one node's process tree is SIGKILLed at a random step.
// The survivors' agents form round 2 and, their workers having said they
// take round notices, write each one its notice instead of stopping it: the
// same worker processes rejoin at world size 2 from the snapshot in memory
// and train to the end. Every step's loss is plain torch's over the nodes of
// its round, at most one step is trained twice and none is skipped.
namespace recovery_test {

// Whether another node's agent holds a whole copy of `origin`'s snapshot
// of `step` (its replicas/<origin>/step<N> folder: a copy is staged beside
// it and renamed into place once whole).
bool replicated(const Job& job, const std::string& origin, int step) {
  std::error_code ec;
  for (const auto& area : std::filesystem::directory_iterator(job.dir / "shm", ec))
    if (std::filesystem::is_directory(
            area.path() / "replicas" / origin / ("step" + std::to_string(step)), ec))
      return true;
  return false;
}

// Three nodes train `run`'s loop; one node's process tree is SIGKILLed after
// a random step, once that step's snapshot of it is copied to another node
// (killed before, the step is lost: the survivors restore the one before
// and go on with the micro-batches of the step they were in, which a
// reference run cannot repeat). The survivors' workers go on in place (see
// below).
void lose_a_node_in_place(Job& job, const InPlaceRun& run) {
  std::random_device random;
  const int kill_after = 2 + static_cast<int>(random() % 4);  // a step of 2..5
  INFO("node c killed after step " << kill_after);
  auto [a, b, c] = start_three(job, run.options, run.worker);
  const bool trained = wait_until(
      [&] {
        return count_of(job.all_output(), "in_place round=1 world=3 node=c step=" +
                                              std::to_string(kill_after) + "\n") == 1 &&
               replicated(job, "c", kill_after);
      },
      240s);
  if (!trained) job.dump();
  REQUIRE(trained);
  for (const int pid : recovery_test::process_tree(c.pid(), job.marker)) kill(pid, SIGKILL);
  c.wait(10s);
  for (Child* survivor : {&a, &b}) {
    const auto status = survivor->wait(240s);
    if (status != std::optional<int>(0)) job.dump();
    CHECK(status == std::optional<int>(0));
  }
  const std::string out = a.output() + b.output();
  INFO(out);
  CHECK(count_of(out, "round 2 continued in place: world size 2 (2 nodes x 1)") == 2);
  CHECK(out.find("round 2 started") == std::string::npos);
  CHECK(out.find("Traceback") == std::string::npos);
  CHECK(count_of(out, "in_place done node=") == 2);
  // The snapshot of the step c logged last, whose copy c's death left.
  const std::string said = field_after(out, "round 2: restored step ", "restored step ");
  REQUIRE(!said.empty());
  const int change = std::stoi(said);
  CHECK(change == kill_after);
  const auto first = run.check(job, "a,b,c", change, "a,b", {"a", "b"}, 1);
  CHECK(first.at("a") == change + 1);
  CHECK(first.at("b") == change + 1);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

}  // namespace recovery_test

TEST_CASE("agent: the survivors of a lost node go on in place, in the same processes") {
  Job job;
  recovery_test::lose_a_node_in_place(job, recovery_test::InPlaceRun(job));
}

// The same with a DeepSpeed script's loop on ductile.deepspeed (two
// micro-batches a step, each loss divided by engine.backward): the
// micro-batches of the step in progress run again in the new round.
TEST_CASE("agent: a DeepSpeed loop's survivors of a lost node go on in place") {
  Job job;
  recovery_test::lose_a_node_in_place(job, recovery_test::InPlaceRun(job, {"--deepspeed", "2"}));
}

// Two nodes train; a third joins. The leader forms round 2 with three; the
// two nodes' agents ask their workers to pause at the next optimizer update
// (they agree on it in the all-reduce that waits for the snapshot's
// copies), and once they paused, with that step's snapshot committed and
// copied, write their notices: the same processes rejoin at world size 3
// from it and complete the step they paused in, while the newcomer's worker
// starts from the same snapshot. No step is lost or trained twice, and every
// step's loss is plain torch's over the nodes of its round.
namespace recovery_test {

// Waits until a's and b's agents asked their workers to pause for round 2,
// then lets the workers go on past the step they wait after (`go`).
void release_when_asked(Job& job, Child& a, Child& b, const std::string& go) {
  const bool asked = wait_until(
      [&] {
        return count_of(a.output() + b.output(),
                        "round 2: asking the workers of round 1 to pause") == 2;
      },
      240s);
  if (!asked) job.dump();
  REQUIRE(asked);
  std::ofstream(go).put('\n');
}

// Two nodes train `run`'s loop; a third joins (see below). The two wait
// after step 3 until the newcomer's agent joined and theirs asked them to
// pause: the newcomer's worker imports ahead first, for as long as that
// takes on a loaded machine.
void join_in_place(Job& job, const InPlaceRun& run) {
  const auto go = (job.dir / "go").string();
  auto worker = run.worker;
  worker.insert(worker.begin() + 1, "ZERO3_WAIT=3:" + go);
  Child& a = job.start("a", run.options, worker);
  REQUIRE(a.wait_for_output("joined job", 60s));
  Child& b = job.start("b", run.options, worker);
  const bool trained = wait_until(
      [&] { return count_of(job.all_output(), "in_place round=1 world=2 node=b step=3\n") == 1; },
      240s);
  if (!trained) job.dump();
  REQUIRE(trained);
  // The newcomer's command starts with its Python (as `ductile agent
  // train.py` does), the variables `env` set for the others in its agent's
  // environment: a newcomer starts only such a worker ahead.
  const auto env_end = std::find(worker.begin(), worker.end(), DUCTILE_PYTHON);
  REQUIRE(env_end != worker.end());
  Child& c =
      job.start("c", run.options, {env_end, worker.end()}, "job", {worker.begin() + 1, env_end});
  release_when_asked(job, a, b, go);
  for (Child* agent : {&a, &b, &c}) {
    const auto status = agent->wait(240s);
    if (status != std::optional<int>(0)) job.dump();
    CHECK(status == std::optional<int>(0));
  }
  const std::string kept = a.output() + b.output();
  INFO(job.all_output());
  CHECK(count_of(kept,
                 "round 2: asking the workers of round 1 to pause at their next optimizer "
                 "update") == 2);
  CHECK(count_of(kept, "round 2: the workers paused after step ") == 2);
  CHECK(count_of(kept, "round 2 continued in place: world size 3 (3 nodes x 1)") == 2);
  CHECK(kept.find("round 2 started") == std::string::npos);
  CHECK(c.output().find("round 2 started: world size 3") != std::string::npos);
  // The newcomer's worker imported torch before its agent joined: the
  // running workers did not pause for those imports.
  const auto warmed = c.output().find(
      "the job runs and keeps snapshots: this node's workers imported torch, torch._dynamo "
      "ahead (");
  CHECK(warmed != std::string::npos);
  CHECK(warmed < c.output().find("joined job"));
  CHECK(job.all_output().find("Traceback") == std::string::npos);
  const std::string said = field_after(kept, "round 2: the workers paused after step ", "step ");
  REQUIRE(!said.empty());
  const int change = std::stoi(said);
  CHECK(change >= 3);
  const auto first = run.check(job, "a,b", change, "a,b,c", {"a", "b", "c"}, 0);
  for (const std::string node : {"a", "b", "c"}) CHECK(first.at(node) == change + 1);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

}  // namespace recovery_test

TEST_CASE("agent: a node that joins is admitted at an optimizer update, the others in place") {
  Job job;
  recovery_test::join_in_place(job, recovery_test::InPlaceRun(job));
}

// The same with a DeepSpeed script's loop on ductile.deepspeed: the paused
// step's two micro-batches run again at the new size.
TEST_CASE("agent: a node that joins a DeepSpeed loop is admitted in place") {
  Job job;
  recovery_test::join_in_place(job, recovery_test::InPlaceRun(job, {"--deepspeed", "2"}));
}

namespace recovery_test {

// A job of tests/agent/workers/hf_in_place.py (a Hugging Face Trainer
// script: DuctileTrainer on ZeRO-3 through ductile.deepspeed, its model made
// by from_config under zero.Init, a snapshot a step copied to one other
// node, a checkpoint on disk every step).
struct HfRun {
  static constexpr int kSteps = 6;
  std::filesystem::path train, reference;
  std::vector<std::string> script, worker, options;

  // `script_options`: the script's own (the reference runs with them too);
  // `control`: where the test stops the job (--stall, --wait).
  HfRun(const Job& job, std::vector<std::string> script_options,
        const std::vector<std::string>& control)
      : train(job.dir / "train"),
        reference(job.dir / "reference"),
        script(std::move(script_options)) {
    std::filesystem::create_directories(train);
    std::filesystem::create_directories(reference);
    worker = package_python("hf_in_place.py");
    worker.insert(worker.begin() + 1, "DS_ACCELERATOR=cpu");
    worker.push_back(train.string());
    worker.push_back(std::to_string(kSteps));
    worker.insert(worker.end(), script.begin(), script.end());
    worker.insert(worker.end(), control.begin(), control.end());
    options = InPlaceRun(job).options;
  }

  // Checks the logs of the nodes `logged` (one process each, their steps
  // from `first` to the end, at world size `before` to the step `change`
  // and `after` past it) and that every step past `change` logged the loss,
  // gradient norm and learning rate of the same script at world size
  // `after` resumed (under torchrun) from the checkpoint of step `change`.
  void check(const std::map<std::string, int>& logged, int change, int before, int after) const {
    auto torchrun = package_python("hf_in_place.py");
    const std::string file = torchrun.back();
    torchrun.pop_back();
    torchrun.insert(torchrun.begin() + 1, "DS_ACCELERATOR=cpu");
    for (std::string arg :
         {std::string("-m"), std::string("torch.distributed.run"), std::string("--standalone"),
          std::string("--nproc-per-node"), std::to_string(after), file, reference.string(),
          std::to_string(kSteps), std::string("--resume"),
          (train / "trainer" / ("checkpoint-" + std::to_string(change))).string()})
      torchrun.push_back(arg);
    torchrun.insert(torchrun.end(), script.begin(), script.end());
    const ProcessResult resumed = run_process(torchrun);
    INFO(resumed.out << resumed.err);
    REQUIRE(resumed.exit_code == 0);
    std::map<int, nlohmann::json> expected;
    std::istringstream reference_log(read_text(reference / "losses-rank0.jsonl"));
    for (std::string line; std::getline(reference_log, line);) {
      const auto entry = nlohmann::json::parse(line);
      expected[entry["step"].get<int>()] = entry;
    }
    REQUIRE(expected.size() == static_cast<std::size_t>(kSteps - change));
    for (const auto& [node, first] : logged) {
      std::istringstream log(read_text(train / ("losses-" + node + ".jsonl")));
      std::set<int> pids;
      std::vector<int> steps;
      for (std::string line; std::getline(log, line);) {
        const auto entry = nlohmann::json::parse(line);
        INFO("node " << node << ": " << line);
        pids.insert(entry["pid"].get<int>());
        const int step = entry["step"].get<int>();
        steps.push_back(step);
        CHECK(entry["world"].get<int>() == (step <= change ? before : after));
        if (step <= change) continue;
        const auto& want = expected.at(step);
        for (const char* key : {"loss", "grad_norm", "learning_rate"}) {
          INFO(key);
          const double got = entry[key].get<double>(), wanted = want[key].get<double>();
          CHECK(std::abs(got - wanted) <= 1e-6 * std::max(1.0, std::abs(wanted)));
        }
      }
      INFO("node " << node);
      CHECK(pids.size() == 1);
      std::vector<int> all;
      for (int step = first; step <= kSteps; ++step) all.push_back(step);
      CHECK(steps == all);
    }
  }
};

}  // namespace recovery_test

namespace recovery_test {

// Starts `run` on three nodes, kills node c's whole tree once its worker
// stopped after its checkpoint of step 3 (--stall c 3), and waits for the
// agents of a and b to finish (each with status 0); returns them.
std::pair<Child&, Child&> lose_c_after_step_3(Job& job, const HfRun& run) {
  auto [a, b, c] = start_three(job, run.options, run.worker);
  const bool stalled = wait_until(
      [&] {
        return job.all_output().find("hf_in_place stalled node=c step=3") != std::string::npos;
      },
      240s);
  if (!stalled) job.dump();
  REQUIRE(stalled);
  for (const int pid : process_tree(c.pid(), job.marker)) kill(pid, SIGKILL);
  c.wait(10s);
  for (Child* survivor : {&a, &b}) {
    const auto status = survivor->wait(240s);
    if (status != std::optional<int>(0)) job.dump();
    CHECK(status == std::optional<int>(0));
  }
  return {a, b};
}

// A Hugging Face Trainer script (`run`) on three nodes. Node c stops after
// its checkpoint of step 3, so that no later step completes, and is killed.
// The survivors go on in place: their engines rejoin round 2 from the
// snapshot of step 3, and their Trainers leave the training loop and enter
// it again at step 3 over the new world, in the same processes. Every step
// they log after it equals the same script at world size 2 resumed from the
// checkpoint of step 3 on disk.
void lose_a_node_hf(Job& job, const HfRun& run) {
  const auto [a, b] = lose_c_after_step_3(job, run);
  const std::string out = a.output() + b.output();
  INFO(out);
  CHECK(count_of(out, "round 2 continued in place: world size 2 (2 nodes x 1)") == 2);
  CHECK(out.find("round 2 started") == std::string::npos);
  CHECK(out.find("Traceback") == std::string::npos);
  CHECK(count_of(out, "round 2: restored step 3 from memory") == 2);
  CHECK(count_of(out, "enters its training loop again at step 3, the snapshot restored") == 2);
  CHECK(count_of(out, "hf_in_place done node=") == 2);
  run.check({{"a", 1}, {"b", 1}}, 3, 3, 2);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

}  // namespace recovery_test

TEST_CASE("agent: a Hugging Face Trainer's survivors of a lost node go on in place") {
  Job job;
  lose_a_node_hf(job, recovery_test::HfRun(job, {}, {"--stall", "c", "3"}));
}

// The same with DuctileTrainer's token-budget packs: each snapshot keeps
// where the data stood after its step, and the survivors' sampler packs
// the rest of the epoch again at world size 2, as a resume from disk does.
TEST_CASE("agent: a Hugging Face Trainer on token-budget packs goes on in place") {
  Job job;
  lose_a_node_hf(job, recovery_test::HfRun(job, {"--max-tokens", "48"}, {"--stall", "c", "3"}));
}

// The same with a TRL supervised fine-tuning script (ductile.trl's
// SFTTrainer, which multiplies its loss in place as the Trainer does).
TEST_CASE("agent: a TRL SFTTrainer's survivors of a lost node go on in place") {
  Job job;
  lose_a_node_hf(job, recovery_test::HfRun(job, {"--trl"}, {"--stall", "c", "3"}));
}

// The Trainer script (its own optimizer and scheduler, which it steps
// itself: each snapshot keeps the scheduler's state) on three nodes; c is
// lost after step 3 while b's worker sleeps (it answers no notice): b's
// agent starts its worker again in round 2, whose Trainer enters its loop
// at step 3 beside a's, which goes on in place. The two train as one: the
// same losses as the script resumed at world size 2 from the checkpoint of
// step 3, and every snapshot after the restore commits (a new worker's
// manifest is the same as one in place).
TEST_CASE("agent: a Trainer restarted beside one in place trains as one") {
  Job job;
  const recovery_test::HfRun run(job, {"--trainer-optimizer"},
                                 {"--stall", "c", "3", "--sleep", "b", "3", "5"});
  const auto [a, b] = recovery_test::lose_c_after_step_3(job, run);
  const std::string out = a.output() + b.output();
  INFO(out);
  CHECK(b.output().find("round 2 started") != std::string::npos);
  CHECK(count_of(out, "enters its training loop again at step 3, the snapshot restored") == 2);
  CHECK(out.find("failed, training goes on") == std::string::npos);
  CHECK(out.find("Traceback") == std::string::npos);
  run.check({{"a", 1}}, 3, 3, 2);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

// The same script (its own optimizer and scheduler) on two nodes; c joins
// after step 3 (the workers wait there until the survivors' agents ask
// them to pause). a's and b's workers pause at the next optimizer update,
// rejoin round 2's world from the snapshot of step 3 and enter their
// training loops again at step 3; c's worker starts from the same snapshot
// and enters its loop at step 3. Every step after it equals the script at
// world size 3 resumed from the checkpoint of step 3.
TEST_CASE("agent: a node that joins a Hugging Face Trainer is admitted in place") {
  Job job;
  const auto go = (job.dir / "go").string();
  const recovery_test::HfRun run(job, {"--trainer-optimizer"}, {"--wait", "3", go});
  Child& a = job.start("a", run.options, run.worker);
  REQUIRE(a.wait_for_output("joined job", 60s));
  Child& b = job.start("b", run.options, run.worker);
  const bool trained = wait_until(
      [&] {
        return count_of(job.all_output(), "hf_in_place round=1 world=2 node=b step=3\n") == 1;
      },
      240s);
  if (!trained) job.dump();
  REQUIRE(trained);
  Child& c = job.start("c", run.options, run.worker);
  recovery_test::release_when_asked(job, a, b, go);
  for (Child* agent : {&a, &b, &c}) {
    const auto status = agent->wait(240s);
    if (status != std::optional<int>(0)) job.dump();
    CHECK(status == std::optional<int>(0));
  }
  const std::string kept = a.output() + b.output();
  INFO(job.all_output());
  CHECK(count_of(kept, "round 2: the workers paused after step 3") == 2);
  CHECK(count_of(kept, "round 2 continued in place: world size 3 (3 nodes x 1)") == 2);
  CHECK(kept.find("round 2 started") == std::string::npos);
  CHECK(c.output().find("round 2 started: world size 3") != std::string::npos);
  CHECK(job.all_output().find("Traceback") == std::string::npos);
  CHECK(count_of(job.all_output(),
                 "enters its training loop again at step 3, the snapshot restored") == 3);
  run.check({{"a", 1}, {"b", 1}, {"c", 4}}, 3, 2, 3);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}
#endif
