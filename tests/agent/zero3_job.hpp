// A zero3 job of the agent tests: its workers' command (ductile.torch.zero3
// on the cpu backend, tests/agent/workers/zero3_resume.py, under the
// Python environment DUCTILE_ZERO3_WORKER_ENV gives), and plain torch's
// losses of the same steps to hold their losses to.
#pragma once

#ifdef DUCTILE_ZERO3_WORKER_ENV
#include <cmath>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent_job.hpp"
#include "process.hpp"

namespace ductile::test {

// A worker script of tests/agent/workers run by the Python of the zero3
// workers: `env` with the package's environment.
inline std::vector<std::string> package_python(const std::string& script) {
  std::vector<std::string> python = {"/usr/bin/env"};
  std::string env_text = DUCTILE_ZERO3_WORKER_ENV;
  for (std::size_t from = 0, bar; from <= env_text.size(); from = bar + 1) {
    bar = std::min(env_text.find('|', from), env_text.size());
    python.push_back(env_text.substr(from, bar - from));
  }
  python.push_back(DUCTILE_PYTHON);
  python.push_back(std::string(DUCTILE_AGENT_WORKERS) + "/" + script);
  return python;
}

inline std::vector<std::string> zero3_python() {
  return package_python("zero3_resume.py");
}

// Plain torch's losses of `steps` steps at global batch 24 (every valid
// world size's plan in kJobToml), written to dir/plain.json.
inline nlohmann::json plain_losses(const std::filesystem::path& dir, int steps) {
  auto plain = zero3_python();
  for (std::string arg :
       {dir.string(), std::to_string(steps), std::string("--plain"), std::string("24")})
    plain.push_back(arg);
  ProcessResult ref = run_process(plain);
  INFO(ref.out << ref.err);
  REQUIRE(ref.exit_code == 0);
  return nlohmann::json::parse(read_text(dir / "plain.json"));
}

// A zero3 test job's folders (train: the workers' checkpoints and
// losses.jsonl; reference: plain torch's run), plain torch's losses of its
// `steps` steps at global batch 24 (the plan of every valid world size of
// kJobToml), and its workers' command.
struct Zero3Run {
  std::filesystem::path train, reference;
  int steps;
  nlohmann::json expected;

  Zero3Run(const Job& job, int steps_)
      : train(job.dir / "train"), reference(job.dir / "reference"), steps(steps_) {
    std::filesystem::create_directories(train);
    std::filesystem::create_directories(reference);
    expected = plain_losses(reference, steps);
    REQUIRE(expected.size() == static_cast<std::size_t>(steps));
  }

  // zero3_resume.py OUT STEPS ARGS..., `pause` seconds between steps.
  std::vector<std::string> worker(const std::string& pause,
                                  const std::vector<std::string>& args = {}) const {
    auto command = zero3_python();
    command.insert(command.begin() + 1, "ZERO3_STEP_PAUSE=" + pause);
    command.push_back(train.string());
    command.push_back(std::to_string(steps));
    command.insert(command.end(), args.begin(), args.end());
    return command;
  }

  // Each line of losses.jsonl in order, its loss checked against plain
  // torch's first (fp32, 1e-5): f(entry, step, world).
  template <class F>
  void each_line(F f) const {
    std::istringstream log(read_text(train / "losses.jsonl"));
    for (std::string line; std::getline(log, line);) {
      auto entry = nlohmann::json::parse(line);
      const int step = entry["step"].get<int>(), world = entry["world"].get<int>();
      REQUIRE(step < steps);
      const double loss = entry["loss"].get<double>(), want = expected[step].get<double>();
      INFO("step " << step << " world " << world << ": " << loss << " vs " << want);
      CHECK(std::abs(loss - want) <= 1e-5 * std::abs(want));
      f(entry, step, world);
    }
  }
};

}  // namespace ductile::test
#endif
