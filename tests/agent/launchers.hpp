// torchrun and `ductile agent` side by side, for the agent tests: the same
// command line (but for the program, and what each launcher needs of its
// own: a port, a log directory) run under both at once, and what their
// workers (workers/torchrun_contract.py) got from them, compared.
#pragma once

#include <doctest/doctest.h>

#include <cctype>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent_support.hpp"
#include "process.hpp"

namespace ductile::test {

using Env = std::map<std::string, std::string>;

inline Env environment_with(const std::vector<std::string>& extra) {
  Env env;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    env[entry.substr(0, entry.find('='))] = entry.substr(entry.find('=') + 1);
  }
  for (const auto& entry : extra)
    env[entry.substr(0, entry.find('='))] = entry.substr(entry.find('=') + 1);
  return env;
}

// The variables a worker got from its launcher: those not in the
// launcher's own environment, or with another value there (and the
// worker's "_executable" and "_argv").
inline Env added_by_launcher(const std::filesystem::path& file, const Env& parent) {
  Env added;
  auto worker = nlohmann::json::parse(read_text(file));
  for (auto it = worker.begin(); it != worker.end(); ++it) {
    auto p = parent.find(it.key());
    std::string value = it.value().get<std::string>();
    if (it.key() != "_" && (p == parent.end() || p->second != value)) added[it.key()] = value;
  }
  return added;
}

inline std::set<std::string> keys_of(const Env& env) {
  std::set<std::string> keys;
  for (const auto& [k, v] : env) keys.insert(k);
  return keys;
}

// Ranks and sizes of a worker.
using Layout = std::tuple<std::string, std::string, std::string, std::string, std::string,
                          std::string, std::string, std::string, std::string>;
inline Layout layout_of(const Env& e) {
  auto at = [&](const char* k) { return e.count(k) ? e.at(k) : std::string("<unset>"); };
  return {at("RANK"),       at("LOCAL_RANK"),       at("WORLD_SIZE"),
          at("GROUP_RANK"), at("GROUP_WORLD_SIZE"), at("LOCAL_WORLD_SIZE"),
          at("ROLE_RANK"),  at("ROLE_WORLD_SIZE"),  at("ROLE_NAME")};
}

// A version 4 uuid, as torchrun makes the run id of --standalone. (Plain
// code: <regex> trips GCC 12's -Wmaybe-uninitialized in the sanitizer
// build.)
inline bool is_uuid4(const std::string& s) {
  if (s.size() != 36) return false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash != (s[i] == '-')) return false;
    if (!dash && !std::isxdigit(static_cast<unsigned char>(s[i]))) return false;
  }
  return s[14] == '4' && std::string("89ab").find(s[19]) != std::string::npos;
}

struct SideBySide {
  std::vector<Env> torchrun, ductile;  // by rank
  std::string torchrun_output, ductile_output;
  std::filesystem::path torchrun_out, ductile_out;  // the workers' files
};

// Runs `nodes` torchrun launchers and `nodes` agents at once;
// `args(node, ductile)` is a node's command line after the program, its
// script included. Each launcher's workers write to <dir>/torchrun or
// <dir>/ductile; `world` workers are expected. Checks that every launcher
// exits 0, that the workers got the same variables (ductile's
// DUCTILE_ROUND, DUCTILE_AGENT_NODE_ID, DUCTILE_SNAPSHOT_DIR, DUCTILE_ROUND_END(_WAIT) and, with
// the agent's store, DUCTILE_ROUND_NOTICE besides),
// ranks, sizes, interpreter and arguments, and the same values of the variables that mean the same
// (but for those named in `differing`).
inline SideBySide run_side_by_side(const std::filesystem::path& dir, const std::string& marker,
                                   int nodes, int world,
                                   const std::function<std::vector<std::string>(int, bool)>& args,
                                   std::vector<std::string> env = {},
                                   const std::set<std::string>& differing = {}) {
  SideBySide s;
  s.torchrun_out = dir / "torchrun";
  s.ductile_out = dir / "ductile";
  std::filesystem::create_directories(s.torchrun_out);
  std::filesystem::create_directories(s.ductile_out);
  env.push_back(marker);
  // Both launchers run a script under $PYTHON_EXEC (torchrun's variable):
  // the environment with torch.
  env.push_back(std::string("PYTHON_EXEC=") + DUCTILE_PYTHON);
  env.push_back("CONTRACT_WORLD=" + std::to_string(world));
  env.push_back("PYTHONPATH=" DUCTILE_AGENT_WORKERS);
  Env parents[2];
  std::vector<std::unique_ptr<Child>> launchers;
  for (bool ductile : {false, true}) {
    auto launcher_env = env;
    launcher_env.push_back("CONTRACT_OUT=" + (ductile ? s.ductile_out : s.torchrun_out).string());
    parents[ductile] = environment_with(launcher_env);
    for (int node = 0; node < nodes; ++node) {
      std::vector<std::string> argv =
          ductile ? std::vector<std::string>{DUCTILE_CLI, "agent"}
                  : std::vector<std::string>{DUCTILE_PYTHON, "-m", "torch.distributed.run"};
      for (auto& a : args(node, ductile)) argv.push_back(a);
      launchers.push_back(std::make_unique<Child>(
          argv, launcher_env,
          dir / ((ductile ? "ductile-" : "torchrun-") + std::to_string(node) + ".log")));
    }
  }
  for (std::size_t i = 0; i < launchers.size(); ++i) {
    auto status = launchers[i]->wait(240s);
    const std::string out = launchers[i]->output();
    if (status != std::optional<int>(0)) std::cout << out;
    CHECK(status == std::optional<int>(0));
    (i < launchers.size() / 2 ? s.torchrun_output : s.ductile_output) += out;
  }
  std::vector<Layout> torchrun_layout, ductile_layout;
  for (int rank = 0; rank < world; ++rank) {
    INFO("rank " << rank);
    const std::string file = std::to_string(rank) + ".json";
    REQUIRE(std::filesystem::exists(s.torchrun_out / file));
    REQUIRE(std::filesystem::exists(s.ductile_out / file));
    Env t = added_by_launcher(s.torchrun_out / file, parents[false]);
    Env d = added_by_launcher(s.ductile_out / file, parents[true]);
    torchrun_layout.push_back(layout_of(t));
    ductile_layout.push_back(layout_of(d));
    std::set<std::string> ours = keys_of(d);
    CHECK(ours.erase("DUCTILE_ROUND") == 1);
    CHECK(ours.erase("DUCTILE_AGENT_NODE_ID") == 1);
    CHECK(ours.erase("DUCTILE_SNAPSHOT_DIR") == 1);
    CHECK(ours.erase("DUCTILE_ROUND_END") == 1);
    CHECK(ours.erase("DUCTILE_ROUND_END_WAIT") == 1);
    // The notice file of a worker that may go on in place: with the agent's
    // store only.
    CHECK(ours.erase("DUCTILE_ROUND_NOTICE") ==
          (d.count("TORCHELASTIC_USE_AGENT_STORE") && d.at("TORCHELASTIC_USE_AGENT_STORE") == "True"
               ? 1u
               : 0u));
    CHECK(ours == keys_of(t));
    for (const char* k :
         {"TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
          "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
          "ROLE_NAME", "_executable", "_argv"}) {
      INFO(k);
      if (!differing.count(k)) CHECK(d[k] == t[k]);
    }
    for (const Env* e : {&d, &t}) {
      auto at = [&](const char* k) { return e->count(k) ? e->at(k) : std::string(); };
      CHECK(at("TORCHELASTIC_ERROR_FILE").ends_with("/" + at("LOCAL_RANK") + "/error.json"));
      CHECK(!at("MASTER_ADDR").empty());
      CHECK(std::stoi(at("MASTER_PORT")) > 0);
    }
    s.torchrun.push_back(std::move(t));
    s.ductile.push_back(std::move(d));
  }
  std::sort(torchrun_layout.begin(), torchrun_layout.end());
  std::sort(ductile_layout.begin(), ductile_layout.end());
  CHECK(ductile_layout == torchrun_layout);
  CHECK(no_marked_processes(marker, 30s));
  return s;
}

}  // namespace ductile::test
