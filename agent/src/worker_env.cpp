// The environment of a round's workers: torchrun's worker contract (every
// variable torchrun 2.13's LocalElasticAgent and its process context set,
// with the same meaning) plus ductile's batch plan. See agent_common.hpp.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iterator>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "agent_common.hpp"

extern char** environ;

namespace ductile::agent {

namespace {

// Set for each worker (a value of the agent's own environment is
// replaced), differently from round to round: the ranks and sizes, the
// master, the attempt and its files, the batch plan.
constexpr const char* kRoundVariables[] = {"RANK",
                                           "WORLD_SIZE",
                                           "GROUP_RANK",
                                           "GROUP_WORLD_SIZE",
                                           "ROLE_RANK",
                                           "ROLE_WORLD_SIZE",
                                           "MASTER_ADDR",
                                           "MASTER_PORT",
                                           "TORCHELASTIC_RESTART_COUNT",
                                           "TORCHELASTIC_ERROR_FILE",
                                           "DUCTILE_GLOBAL_BATCH",
                                           "DUCTILE_MICRO_BATCH",
                                           "DUCTILE_GRADIENT_ACCUMULATION_STEPS",
                                           "DUCTILE_ROUND",
                                           "DUCTILE_MPI_JOIN",
                                           "DUCTILE_CHECKPOINT_REQUEST",
                                           "DUCTILE_CHECKPOINT_SAVED",
                                           "DUCTILE_SNAPSHOT_RESTORE",
                                           "DUCTILE_SNAPSHOT_RESTORE_WAIT",
                                           "OMPI_MCA_pmix_server_uri"};
// Set for each worker the same in every round (LOCAL_RANK, OMP_NUM_THREADS,
// which a library reads as it is imported, ...).
constexpr const char* kSteadyVariables[] = {
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "DEEPSPEED_ELASTICITY_CONFIG",
    "DUCTILE_AGENT_NODE_ID", "DUCTILE_SNAPSHOT_DIR", "DUCTILE_ROUND_END", "DUCTILE_ROUND_END_WAIT",
    "DUCTILE_ROUND_NOTICE",
    // Set by the `ductile` console script for the agent alone (worker_command in the CLI).
    "DUCTILE_CONSOLE_PYTHON"};

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value ? std::string(value) : fallback;
}

}  // namespace

bool is_round_variable(const std::string& name) {
  return std::any_of(std::begin(kRoundVariables), std::end(kRoundVariables),
                     [&](const char* v) { return name == v; });
}

std::filesystem::path attempt_dir_of(const std::filesystem::path& run_dir, std::int64_t restarts) {
  return run_dir / ("attempt_" + std::to_string(restarts));
}

std::filesystem::path error_file_of(const std::filesystem::path& run_dir, std::int64_t restarts,
                                    std::int64_t local_rank) {
  return attempt_dir_of(run_dir, restarts) / std::to_string(local_rank) / "error.json";
}

// Per round, not per attempt: a planned re-form keeps the attempt, and a
// mark of the last round's must not count for the next.
std::filesystem::path checkpoint_request_of(const std::filesystem::path& run_dir,
                                            std::int64_t round) {
  return run_dir / "checkpoints" / ("round_" + std::to_string(round)) / "checkpoint_request";
}

std::filesystem::path checkpoint_saved_of(const std::filesystem::path& run_dir, std::int64_t round,
                                          std::int64_t local_rank) {
  return run_dir / "checkpoints" / ("round_" + std::to_string(round)) /
         ("checkpoint_saved_" + std::to_string(local_rank));
}

std::filesystem::path round_end_of(const std::filesystem::path& run_dir) {
  return run_dir / "round_end";
}

std::filesystem::path round_notice_of(const std::filesystem::path& run_dir,
                                      std::int64_t local_rank) {
  return run_dir / "notices" / (std::to_string(local_rank) + ".json");
}

std::filesystem::path round_notice_ready_of(const std::filesystem::path& run_dir,
                                            std::int64_t local_rank) {
  auto ready = round_notice_of(run_dir, local_rank);
  ready += ".ready";
  return ready;
}

std::string round_notice_json(const RoundRecord& round, std::int64_t rank, std::int64_t local_rank,
                              std::int64_t local_world_size, const std::filesystem::path& restore,
                              const JobPolicy& policy) {
  // No store_prefix: the worker joins the round's store as torch's env://
  // does, where the workers started afresh in this round meet it.
  nlohmann::json notice = {{"round", round.round},
                           {"rank", rank},
                           {"world_size", round.world_size},
                           {"local_rank", local_rank},
                           {"local_world_size", local_world_size},
                           {"master_addr", round.master_addr},
                           {"master_port", round.master_port},
                           {"restore", restore.string()}};
  if (policy.has_config()) {
    const BatchPlan plan = policy.plan(round.world_size);
    notice["plan"] = {{"global_batch", plan.global_batch},
                      {"micro_batch", plan.micro_batch},
                      {"gradient_accumulation_steps", plan.gradient_accumulation_steps}};
  }
  return notice.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::vector<WorkerSpec> worker_specs(const WorkerSetup& s) {
  const AgentOptions& o = s.options;
  const RoundRecord& round = s.round;
  BatchPlan plan = s.policy.plan(round.world_size);
  auto nodes = static_cast<std::int64_t>(round.members.size());
  auto group_rank = static_cast<std::int64_t>(s.group_rank);

  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    std::string name = entry.substr(0, entry.find('='));
    if (!is_round_variable(name) &&
        std::none_of(std::begin(kSteadyVariables), std::end(kSteadyVariables),
                     [&](const char* v) { return name == v; }))
      base.push_back(std::move(entry));
  }
  // Values torchrun takes from its own environment (or sets there for its
  // workers to inherit).
  const std::string nccl_async = env_or("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
  const std::string signals =
      !o.signals_to_handle.empty()
          ? o.signals_to_handle
          : env_or("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
  // torchrun sets OMP_NUM_THREADS=1 for more than one worker a node unless
  // it is set.
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const std::string omp_threads = omp ? omp : (o.nproc_per_node > 1 ? "1" : "");

  std::vector<WorkerSpec> specs;
  for (std::int64_t local = 0; local < o.nproc_per_node; ++local) {
    std::int64_t rank = group_rank * o.nproc_per_node + local;
    WorkerSpec spec;
    spec.rank = rank;
    spec.local_rank = local;
    spec.argv = o.command;
    spec.env = base;
    auto set = [&](const char* name, const std::string& value) {
      spec.env.push_back(std::string(name) + "=" + value);
    };
    set("RANK", std::to_string(rank));
    set("LOCAL_RANK", std::to_string(local));
    set("WORLD_SIZE", std::to_string(round.world_size));
    set("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node));
    set("GROUP_RANK", std::to_string(group_rank));
    set("GROUP_WORLD_SIZE", std::to_string(nodes));
    set("ROLE_RANK", std::to_string(rank));  // one role: its ranks are the global ranks
    set("ROLE_WORLD_SIZE", std::to_string(round.world_size));
    set("ROLE_NAME", o.role);
    set("MASTER_ADDR", round.master_addr);
    set("MASTER_PORT", std::to_string(round.master_port));
    set("TORCHELASTIC_RESTART_COUNT", std::to_string(round.restarts));
    set("TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts));
    set("TORCHELASTIC_RUN_ID", o.job_id);
    // True: the leading agent serves the workers' TCPStore at MASTER_ADDR:
    // MASTER_PORT (torchrun's c10d, static, standalone); False: rank 0's
    // worker creates it there (torchrun's etcd rendezvous).
    set("TORCHELASTIC_USE_AGENT_STORE", o.agent_store ? "True" : "False");
    const auto error_file = error_file_of(s.run_dir, round.restarts, local);
    set("TORCHELASTIC_ERROR_FILE", error_file.string());
    // Made as this worker starts (torchrun makes one for each local rank):
    // a stop signal while a node's workers start leaves no directory of a
    // worker that never ran.
    spec.directory = error_file.parent_path();
    // torchrun's log files: <run dir>/attempt_<restarts>/<local rank>/std*.log
    // (TORCHELASTIC_RESTART_COUNT names the attempt, as torchrun's).
    const int redirect = o.output.redirects.of(local), tee = o.output.tee.of(local);
    const bool shown = !o.output.console_ranks || o.output.console_ranks->count(local) > 0;
    if ((redirect | tee) & kStdout) spec.stdout_file = error_file.parent_path() / "stdout.log";
    if ((redirect | tee) & kStderr) spec.stderr_file = error_file.parent_path() / "stderr.log";
    spec.stdout_console = shown && (!(redirect & kStdout) || (tee & kStdout));
    spec.stderr_console = shown && (!(redirect & kStderr) || (tee & kStderr));
    spec.line_prefix = "[" + o.role + std::to_string(local) + "]:";
    set("TORCHELASTIC_SIGNALS_TO_HANDLE", signals);
    set("TORCH_NCCL_ASYNC_ERROR_HANDLING", nccl_async);
    if (!omp_threads.empty()) set("OMP_NUM_THREADS", omp_threads);
    if (s.policy.has_config()) {
      set("DEEPSPEED_ELASTICITY_CONFIG", s.policy.scheduler_config_json());
      set("DUCTILE_GLOBAL_BATCH", std::to_string(plan.global_batch));
      set("DUCTILE_MICRO_BATCH", std::to_string(plan.micro_batch));
      set("DUCTILE_GRADIENT_ACCUMULATION_STEPS", std::to_string(plan.gradient_accumulation_steps));
    }
    if (o.checkpoint_timeout.count() > 0) {
      set("DUCTILE_CHECKPOINT_REQUEST", checkpoint_request_of(s.run_dir, round.round).string());
      set("DUCTILE_CHECKPOINT_SAVED", checkpoint_saved_of(s.run_dir, round.round, local).string());
    }
    if (!s.snapshot_dir.empty()) set("DUCTILE_SNAPSHOT_DIR", s.snapshot_dir.string());
    if (!s.snapshot_restore.empty()) set("DUCTILE_SNAPSHOT_RESTORE", s.snapshot_restore.string());
    if (s.restore_wait.count() > 0)
      set("DUCTILE_SNAPSHOT_RESTORE_WAIT",
          fmt::format("{:g}", std::chrono::duration<double>(s.restore_wait).count()));
    set("DUCTILE_ROUND", std::to_string(round.round));
    set("DUCTILE_AGENT_NODE_ID", s.node_id);
    set("DUCTILE_ROUND_END", round_end_of(s.run_dir).string());
    // A worker started with the agent's store may go on in place at the next
    // round (its rank 0 creates no store the survivors would have to reach).
    if (o.agent_store) set("DUCTILE_ROUND_NOTICE", round_notice_of(s.run_dir, local).string());
    // How long a worker whose peer is gone waits for the agent to end its
    // round: the lost lease noticed, a failure's grace, a pass or two.
    set("DUCTILE_ROUND_END_WAIT",
        fmt::format("{:g}", std::chrono::duration<double>(
                                o.lease_ttl + o.failure_grace.value_or(o.lease_ttl) +
                                2 * o.poll_interval + std::chrono::seconds(5))
                                .count()));
    if (round.mpi_join_port != 0) {
      set("DUCTILE_MPI_JOIN", round.master_addr + ":" + std::to_string(round.mpi_join_port));
      set("OMPI_MCA_pmix_server_uri", round.mpi_server_uri);
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

}  // namespace ductile::agent
