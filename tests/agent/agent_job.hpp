// A job of `ductile agent` processes for the agent tests: its own etcd,
// configuration and marker, agents started by name, their output; and
// helpers to read the agents' logs.
#pragma once

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "agent_support.hpp"
#include "temp_dir.hpp"

namespace ductile::test {

// Valid GPU counts [1, 2, 3, 4, 6]: with 2 workers per node 1, 2 or 3 nodes
// (4 nodes = 8 GPUs is not valid).
inline constexpr const char* kJobToml = R"([elasticity]
policy = "v0.1"
max_train_batch_size = 24
micro_batch_sizes = [1, 2, 3]
min_gpus = 1
max_gpus = 6
)";

struct Job {
  TempDir dir;
  std::string marker = new_marker();
  EtcdServer etcd{dir.path()};
  std::filesystem::path config = dir.write("job.toml", kJobToml);
  // The agents' $TMPDIR: an agent a test kills (SIGKILL, a lost node)
  // leaves its run directory (and ompi-server's) behind; here it goes with
  // the test's directory instead of piling up in /tmp.
  std::filesystem::path tmp = [this] {
    auto made = dir / "tmp";
    std::filesystem::create_directories(made);
    return made;
  }();
  std::vector<std::unique_ptr<Child>> agents;

  // `env`: variables set in the agent's environment (and so its workers').
  Child& start(const std::string& name, std::vector<std::string> options,
               const std::vector<std::string>& command, const std::string& job_id = "job",
               const std::vector<std::string>& env = {}) {
    std::vector<std::string> argv = {DUCTILE_CLI,   "agent",     "--config",  config.string(),
                                     "--rdzv",      etcd.url(),  "--job-id",  job_id,
                                     "--node-addr", "127.0.0.1", "--node-id", name};
    argv.insert(argv.end(), options.begin(), options.end());
    argv.push_back("--");
    argv.insert(argv.end(), command.begin(), command.end());
    // A second agent of the same name (a restart) logs to a file of its own.
    std::filesystem::path log = dir / (name + ".log");
    for (int n = 2; std::filesystem::exists(log); ++n)
      log = dir / (name + "-" + std::to_string(n) + ".log");
    std::vector<std::string> variables = {marker, "TMPDIR=" + tmp.string()};
    variables.insert(variables.end(), env.begin(), env.end());
    agents.push_back(std::make_unique<Child>(argv, variables, log));
    return *agents.back();
  }
  std::string all_output() const {
    std::string out;
    for (const auto& a : agents) out += a->output();
    return out;
  }
  void dump() const {
    for (const auto& a : agents) std::cout << "---- agent " << a->pid() << "\n" << a->output();
  }
};

inline std::vector<std::string> sh(const std::string& script) {
  return {"/bin/sh", "-c", script};
}

// The text after `key` up to the next space or end of line, in the first
// line of `text` that contains `line_part` (and `key` after it); "" if none.
// (Plain string search: <regex> trips GCC 12's -Wmaybe-uninitialized in the
// sanitizer build.)
inline std::string field_after(const std::string& text, const std::string& line_part,
                               const std::string& key) {
  for (std::size_t at = text.find(line_part); at != std::string::npos;
       at = text.find(line_part, at + 1)) {
    const std::size_t eol = text.find('\n', at);
    const std::size_t k = text.find(key, at);
    if (k == std::string::npos || (eol != std::string::npos && k > eol)) continue;
    const std::size_t from = k + key.size();
    return text.substr(from, text.find_first_of(" \n", from) - from);
  }
  return "";
}

inline std::int64_t started_ms(const std::string& log, int round) {
  std::string ms = field_after(log, "round " + std::to_string(round) + " started: ", "started_ms=");
  return ms.empty() ? -1 : std::stoll(ms);
}

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace ductile::test
