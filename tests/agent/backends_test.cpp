// `ductile agent` with torchrun's rendezvous backends and no etcd: --standalone and one node with
// the agent's own store, c10d hosted by the agent on the endpoint's host, static with node ranks
// and the master's port; torchrun's log options; the interpreter of a
// Python script. Real agent processes on loopback; every test ends with no
// process of its job left.
#include <doctest/doctest.h>

#include <dirent.h>
#include <unistd.h>

#include <iostream>
#include <set>
#include <sstream>
#include <string>

#include "launchers.hpp"
#include "process.hpp"
#include "temp_dir.hpp"

using namespace ductile::test;

namespace {

// The processes whose parent is `pid`.
std::vector<int> children_of(int pid) {
  std::vector<int> out;
  DIR* proc = opendir("/proc");
  while (dirent* entry = readdir(proc)) {
    std::string name = entry->d_name;
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string stat = read_text("/proc/" + name + "/stat");
    auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(stat.substr(close + 2));
    std::string state;
    int parent = 0;
    fields >> state >> parent;
    if (parent == pid && state != "Z") out.push_back(std::stoi(name));
  }
  closedir(proc);
  return out;
}

std::string command_of(int pid) {
  std::string cmdline = read_text("/proc/" + std::to_string(pid) + "/cmdline");
  std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
  return cmdline;
}

// The TCP ports process `pid` listens on (its sockets matched against
// /proc/<pid>/net/tcp and tcp6 by inode).
std::set<int> listening_ports_of(int pid) {
  const std::string base = "/proc/" + std::to_string(pid);
  std::set<std::string> inodes;
  DIR* fds = opendir((base + "/fd").c_str());
  REQUIRE(fds != nullptr);
  while (dirent* entry = readdir(fds)) {
    char target[256] = {};
    const std::string link = base + "/fd/" + entry->d_name;
    const ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
    const std::string text(target, n > 0 ? static_cast<std::size_t>(n) : 0);
    if (text.starts_with("socket:[")) inodes.insert(text.substr(8, text.size() - 9));
  }
  closedir(fds);
  std::set<int> ports;
  for (const char* table : {"/net/tcp", "/net/tcp6"}) {
    std::istringstream lines(read_text(base + table));
    std::string line;
    std::getline(lines, line);  // the header
    while (std::getline(lines, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state == "0A" && inodes.count(inode))  // LISTEN
        ports.insert(std::stoi(local.substr(local.rfind(':') + 1), nullptr, 16));
    }
  }
  return ports;
}

// `ductile agent` with torchrun's arguments.
std::vector<std::string> agent_argv(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {DUCTILE_CLI, "agent"};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

// A worker that says where it runs, then waits for `stop` to exist.
std::vector<std::string> waiting_worker(const std::string& stop) {
  return {"--no-python", "/bin/sh", "-c",
          "echo \"up group $GROUP_RANK rank $RANK of $WORLD_SIZE round $DUCTILE_ROUND master "
          "$MASTER_ADDR:$MASTER_PORT store $TORCHELASTIC_USE_AGENT_STORE run "
          "$TORCHELASTIC_RUN_ID\"; while [ ! -e " +
              stop + " ]; do sleep 0.05; done"};
}

}  // namespace

TEST_CASE("agent: --standalone runs one node on its own rendezvous - nothing else started") {
  TempDir dir;
  const std::string marker = new_marker(), stop = (dir / "stop").string();
  std::vector<std::string> args = {"--standalone", "--nproc-per-node", "2", "--monitor-interval",
                                   "0.05"};
  auto worker = waiting_worker(stop);
  args.insert(args.end(), worker.begin(), worker.end());
  Child agent(agent_argv(args), {marker}, dir / "agent.log");
  bool up = agent.wait_for_output("\nup group 0 rank", 60s, 2);
  if (!up) std::cout << agent.output();
  REQUIRE(up);
  // The agent's children are its workers' guards, each with its worker:
  // no store process, no etcd.
  auto guards = children_of(agent.pid());
  CHECK(guards.size() == 2);
  for (int guard : guards) {
    CHECK(command_of(guard) == command_of(agent.pid()));  // a fork of the agent
    auto workers = children_of(guard);
    CHECK(workers.size() == 1);
    for (int w : workers) CHECK(command_of(w).find("/bin/sh -c echo") == 0);
  }
  std::string out = agent.output();
  // torchrun's standalone: a uuid run id, the agent's store, one node.
  const auto run = out.find(" run ", out.find("\nup group 0 rank 0"));
  REQUIRE(run != std::string::npos);
  CHECK(is_uuid4(out.substr(run + 5, 36)));
  CHECK(out.find("of 2 round 1 master ") != std::string::npos);
  // The agent listens on the workers' store's port alone: no snapshot
  // server, which another user of the host could read its snapshots from.
  const auto master = out.find(" master ", out.find("\nup group 0 rank 0"));
  const auto colon = out.find(':', master);
  REQUIRE(colon != std::string::npos);
  const int master_port = std::stoi(out.substr(colon + 1));
  CHECK(listening_ports_of(agent.pid()) == std::set<int>{master_port});
  CHECK(out.find("store True") != std::string::npos);
  CHECK(out.find("on this agent's own rendezvous (one node)") != std::string::npos);
  std::ofstream(stop) << "stop";
  auto status = agent.wait(60s);
  if (status != std::optional<int>(0)) std::cout << out;
  CHECK(status == std::optional<int>(0));
  CHECK(no_marked_processes(marker));
}

TEST_CASE(
    "agent: c10d - the endpoint's host serves the rendezvous, a lost node re-forms, the host's "
    "loss ends the job") {
  TempDir dir;
  const std::string marker = new_marker(), stop = (dir / "stop").string();
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_tcp_port());
  std::vector<std::string> args = {
      "--nnodes",           "2:3",
      "--nproc-per-node",   "1",
      "--rdzv-backend",     "c10d",
      "--rdzv-endpoint",    endpoint,
      "--rdzv-id",          "c10d-job",
      "--local-addr",       "127.0.0.1",
      "--monitor-interval", "0.05",
      "--rdzv-conf",        "keep_alive_interval=1,keep_alive_max_attempt=2"};
  auto worker = waiting_worker(stop);
  args.insert(args.end(), worker.begin(), worker.end());
  std::vector<std::unique_ptr<Child>> agents;
  for (int i = 0; i < 3; ++i)
    // $TMPDIR in the test's directory: the agent killed below leaves its
    // run directory behind.
    agents.push_back(std::make_unique<Child>(
        agent_argv(args), std::vector<std::string>{marker, "TMPDIR=" + dir.path().string()},
        dir / ("agent" + std::to_string(i) + ".log")));
  auto all_output = [&] {
    std::string out;
    for (auto& a : agents) out += a->output();
    return out;
  };
  // All three in one round (the first, unless one registered more than
  // --settle after the others).
  bool formed = wait_until(
      [&] {
        return std::all_of(agents.begin(), agents.end(), [](auto& a) {
          return a->output().find(" of 3 round ") != std::string::npos;
        });
      },
      120s);
  if (!formed) std::cout << all_output();
  REQUIRE(formed);
  // One agent hosts: the first of this host's to bind the port.
  Child* host = nullptr;
  std::vector<Child*> joined;
  for (auto& a : agents)
    if (a->output().find("hosting the c10d rendezvous at port") != std::string::npos)
      host = a.get();
    else
      joined.push_back(a.get());
  REQUIRE(host);
  REQUIRE(joined.size() == 2);
  CHECK(count_of(all_output(), "store True") == 3);  // torchrun's c10d: the agent's store
  CHECK(count_of(all_output(), "run c10d-job") == 3);
  for (Child* a : joined)
    CHECK(a->output().find("joined job 'c10d-job' on the c10d rendezvous at " + endpoint +
                           " (hosted by the agent on 127.0.0.1)") != std::string::npos);

  // A node that is not the host is lost: the others re-form without it.
  joined[0]->signal(SIGKILL);
  joined[0]->wait(10s);
  bool reformed = wait_until(
      [&] {
        return host->output().find(" of 2 round ") != std::string::npos &&
               joined[1]->output().find(" of 2 round ") != std::string::npos;
      },
      60s);
  if (!reformed) std::cout << all_output();
  CHECK(reformed);

  // The host is lost: the rendezvous with it, and the job ends, as
  // torchrun's c10d job does.
  host->signal(SIGKILL);
  host->wait(10s);
  auto status = joined[1]->wait(60s);
  std::string last = joined[1]->output();
  if (status != std::optional<int>(1)) std::cout << last;
  CHECK(status == std::optional<int>(1));
  CHECK(last.find("(its agent is gone); the job ends with its rendezvous' host, as under "
                  "torchrun (an etcd rendezvous, --rdzv-backend etcd, survives the loss of any "
                  "node)") != std::string::npos);
  CHECK(no_marked_processes(marker));
}

TEST_CASE("agent: static - node ranks, the store at --master-port, one agent per rank") {
  TempDir dir;
  const std::string marker = new_marker(), stop = (dir / "stop").string();
  const std::string port = std::to_string(free_tcp_port());
  auto args_of = [&](const std::string& rank, const std::vector<std::string>& worker) {
    std::vector<std::string> args = {"--nnodes",           "2",   "--nproc-per-node", "2",
                                     "--node-rank",        rank,  "--master-addr",    "127.0.0.1",
                                     "--master-port",      port,  "--local-addr",     "127.0.0.1",
                                     "--monitor-interval", "0.05"};
    args.insert(args.end(), worker.begin(), worker.end());
    return agent_argv(args);
  };
  // Node rank 1 first: it waits for node rank 0's store.
  const std::string tmpdir = "TMPDIR=" + dir.path().string();  // what a killed agent leaves
  Child one(args_of("1", waiting_worker(stop)), {marker, tmpdir}, dir / "rank1.log");
  CHECK(one.wait_for_output("waiting for the static rendezvous at 127.0.0.1:" + port, 30s));
  Child zero(args_of("0", waiting_worker(stop)), {marker, tmpdir}, dir / "rank0.log");
  bool formed = wait_until(
      [&] { return count_of(zero.output() + one.output(), " of 4 round 1 ") == 4; }, 60s);
  if (!formed) std::cout << zero.output() << one.output();
  REQUIRE(formed);
  // The group rank is the node rank; MASTER_* the master's, its store.
  CHECK(count_of(one.output(), "up group 1 rank ") == 2);
  CHECK(count_of(zero.output(), "up group 0 rank ") == 2);
  // Unprefixed: the workers write the agent's own streams.
  CHECK(one.output().find("\nup group 1 rank 3 of 4") != std::string::npos);
  CHECK(count_of(zero.output() + one.output(), "master 127.0.0.1:" + port +
                                                   " store True run "
                                                   "none") == 4);
  CHECK(zero.output().find("hosting the static rendezvous at port " + port) != std::string::npos);

  // A second agent with a node rank in use, and a node rank the job has
  // not: refused, exit 2.
  auto r = run_process(args_of("1", waiting_worker(stop)), {marker});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--node-rank 1 is in use: the agent '") != std::string::npos);
  CHECK(r.err.find("give every node its own --node-rank from 0 to 1") != std::string::npos);
  r = run_process(args_of("2", waiting_worker(stop)), {marker});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--node-rank 2 is invalid for --nnodes 2: give 0 to 1") != std::string::npos);
  // Node rank 0 again: its port is in use.
  r = run_process(args_of("0", waiting_worker(stop)), {marker});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("cannot serve the static rendezvous at port " + port) != std::string::npos);
  CHECK(r.err.find("give another --master-port") != std::string::npos);

  std::ofstream(stop) << "stop";
  for (Child* a : {&zero, &one}) {
    auto status = a->wait(60s);
    if (status != std::optional<int>(0)) std::cout << a->output();
    CHECK(status == std::optional<int>(0));
  }
  CHECK(no_marked_processes(marker));
}

TEST_CASE("agent: --log-dir, --redirects, --tee and --local-ranks-filter as torchrun's") {
  TempDir dir;
  const std::string marker = new_marker();
  const std::vector<std::string> worker = {
      "--no-python", "/bin/sh", "-c", "echo \"out $LOCAL_RANK\"; echo \"err $LOCAL_RANK\" >&2"};
  auto run = [&](std::vector<std::string> args) {
    std::vector<std::string> all = {"--standalone", "--nproc-per-node", "2", "--rdzv-id",
                                    "ignored-with-standalone"};
    all.insert(all.end(), args.begin(), args.end());
    all.insert(all.end(), worker.begin(), worker.end());
    return run_process(agent_argv(all), {marker});
  };
  // The files of local rank `local` under `logs`: <job>_XXXXXX/attempt_0/<local>/
  // (attempt: the restart count, as torchrun's).
  auto files_of = [](const std::filesystem::path& logs, int local) {
    std::filesystem::path found;
    for (const auto& job : std::filesystem::directory_iterator(logs))
      found = job.path() / "attempt_0" / std::to_string(local);
    return found;
  };

  // -r 3: both streams to the files only.
  auto logs = dir / "redirected";
  auto r = run({"--log-dir", logs.string(), "-r", "3"});
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("]: out") == std::string::npos);
  CHECK(r.err.find("]: err") == std::string::npos);
  for (int local : {0, 1}) {
    auto files = files_of(logs, local);
    CHECK(read_text(files / "stdout.log") == "out " + std::to_string(local) + "\n");
    CHECK(read_text(files / "stderr.log") == "err " + std::to_string(local) + "\n");
    CHECK(std::filesystem::exists(files.parent_path()));
  }

  // --tee 1 and --local-ranks-filter 1: stdout to the files and the
  // console, and only local rank 1 on the console.
  logs = dir / "teed";
  r = run({"--log-dir", logs.string(), "--tee", "1", "--local-ranks-filter", "1"});
  CHECK(r.exit_code == 0);
  // Teed: prefixed as torchrun's tail prefixes ("[<role><local rank>]:");
  // stderr, not teed, written by the worker itself.
  CHECK(r.out.find("[default1]:out 1\n") != std::string::npos);
  CHECK(r.err.find("\nerr 1\n") != std::string::npos);
  CHECK(r.err.find("]:err 1") == std::string::npos);
  CHECK(r.out.find("out 0") == std::string::npos);
  CHECK(r.err.find("err 0") == std::string::npos);
  for (int local : {0, 1}) {
    CHECK(read_text(files_of(logs, local) / "stdout.log") == "out " + std::to_string(local) + "\n");
    CHECK_FALSE(std::filesystem::exists(files_of(logs, local) / "stderr.log"));
  }

  // -r 0:1 without --log-dir: local rank 0's stdout to a kept directory of
  // $TMPDIR (the error files beside it); the rest on the console.
  const auto tmp = dir / "tmp";
  std::filesystem::create_directories(tmp);
  std::vector<std::string> all = {"--standalone", "--nproc-per-node", "2", "-r", "0:1"};
  all.insert(all.end(), worker.begin(), worker.end());
  r = run_process(agent_argv(all), {marker, "TMPDIR=" + tmp.string()});
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("out 0") == std::string::npos);
  CHECK(r.out.find("out 1\n") != std::string::npos);
  CHECK(r.err.find("\nerr 0\n") != std::string::npos);
  CHECK(r.out.find("]:") == std::string::npos);
  CHECK(read_text(files_of(tmp, 0) / "stdout.log") == "out 0\n");

  // Values torchrun refuses too.
  r = run({"-r", "4"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--redirects '4' is invalid: give 0 (none), 1 (stdout), 2 (stderr) or 3") !=
        std::string::npos);
  r = run({"--local-ranks-filter", "one"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--local-ranks-filter 'one' is invalid") != std::string::npos);
  r = run({"--start-method", "thread"});
  CHECK(r.exit_code == 2);
  CHECK(no_marked_processes(marker));
}

#ifdef DUCTILE_CONSOLE_SCRIPT
TEST_CASE(
    "agent: a Python script runs under the interpreter that ran ductile - PYTHON_EXEC and "
    "--no-python as torchrun") {
  TempDir dir;
  const std::string marker = new_marker();
  auto script = dir.write(
      "where.py", "import sys\nprint('interpreter', sys.executable, 'args', sys.argv[1:])\n");
  // The `ductile` console script is ductile/__main__.py of the package
  // (here the build tree's), run by the environment's interpreter. PATH has
  // no python3 of that environment.
  const std::string console = DUCTILE_BINARY_DIR "/python/ductile/__main__.py";
  const std::vector<std::string> env = {marker, "PATH=/usr/bin:/bin"};
  auto r = run_process({DUCTILE_PYTHON, console, "agent", "--standalone", "--nproc-per-node", "1",
                        script.string(), "--lr", "3e-4"},
                       env);
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("interpreter " + std::string(DUCTILE_PYTHON) + " args ['--lr', '3e-4']") !=
        std::string::npos);
  // The agent says which Python, and why, first.
  CHECK(r.err.starts_with("ductile agent: the workers run " + std::string(DUCTILE_PYTHON) +
                          " (the interpreter whose `ductile` console script ran the agent)\n"));
  // PYTHON_EXEC first, as torchrun.
  auto exec_env = env;
  exec_env.push_back("PYTHON_EXEC=/usr/bin/python3");
  r = run_process({DUCTILE_PYTHON, console, "agent", "--nproc-per-node", "1", script.string()},
                  exec_env);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("interpreter /usr/bin/python3 args []") != std::string::npos);
  // -m: a module of the script's directory (PYTHONPATH), run the same way.
  auto module_env = env;
  module_env.push_back("PYTHONPATH=" + dir.path().string());
  r = run_process({DUCTILE_PYTHON, console, "agent", "--nproc-per-node", "1", "-m", "where", "x"},
                  module_env);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("interpreter " + std::string(DUCTILE_PYTHON) + " args ['x']") !=
        std::string::npos);
  // --no-python: the command as it is.
  r = run_process({DUCTILE_PYTHON, console, "agent", "--nproc-per-node", "1", "--no-python",
                   "/bin/echo", "as", "is"},
                  env);
  CHECK(r.exit_code == 0);
  CHECK(r.out == "as is\n");
  // The console script's variable is the agent's, not the workers'.
  r = run_process({DUCTILE_PYTHON, console, "agent", "--nproc-per-node", "1", "--no-python",
                   "/bin/sh", "-c", "echo \"console=${DUCTILE_CONSOLE_PYTHON-unset}\""},
                  env);
  CHECK(r.out == "console=unset\n");
  CHECK(no_marked_processes(marker));
}
#endif

TEST_CASE(
    "agent: c10d - out of file descriptors, the round does not form and the agent says why, not "
    "as a bug") {
  // Open files limits from one too low to start the agent up to one that
  // runs the job: each further descriptor the agent needs fails in turn,
  // the round's workers' store among them.
  const std::string marker = new_marker();
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_tcp_port());
  bool round_refused = false, ran = false;
  for (int limit = 4; limit <= 64 && !ran; ++limit) {
    const std::string ulimit = "ulimit -n " + std::to_string(limit);
    auto r = run_process(
        {"/bin/sh", "-c", ulimit + " && exec \"$0\" \"$@\"", DUCTILE_CLI, "agent", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", endpoint, "--nnodes", "1", "--nproc-per-node", "1", "--settle",
         "0", "--local-addr", "127.0.0.1", "--no-python", "/bin/true"},
        {marker});
    INFO(ulimit, ": exit ", r.exit_code, "\n", r.out, r.err);
    // Below what the dynamic loader needs (the test's own descriptors are
    // inherited too), the program does not start at all.
    if (r.exit_code == 127 &&
        r.err.find("error while loading shared libraries") != std::string::npos)
      continue;
    CHECK((r.out + r.err).find("internal error") == std::string::npos);
    REQUIRE((r.exit_code == 0 || r.exit_code == 2));
    ran = r.exit_code == 0;
    if ((r.out + r.err).find("round 1 cannot form") != std::string::npos) {
      round_refused = true;
      CHECK(r.exit_code == 2);
      CHECK((r.out + r.err)
                .find("ran out of file descriptors (open files limit, ulimit -n: " +
                      std::to_string(limit) + "): raise the limit") != std::string::npos);
    }
  }
  CHECK(round_refused);
  CHECK(ran);
  CHECK(no_marked_processes(marker));
}
