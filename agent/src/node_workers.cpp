// This node's workers: started for their round, stopped, their exits and
// error files reported; and their directory. See node_workers.hpp.
#include "node_workers.hpp"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <system_error>

#include <fmt/format.h>

#include "ductile/core/text.hpp"
#include "ductile/error.hpp"
#include "snapshot_area.hpp"

namespace ductile::agent {

namespace {

// `text` into `file`, whole or not at all (written aside, then renamed);
// "" when written, else why not.
std::string write_whole(const std::filesystem::path& file, const std::string& text) {
  auto part = file;
  part += ".part";
  std::FILE* out = std::fopen(part.c_str(), "w");
  if (!out) return std::strerror(errno);
  bool written = std::fwrite(text.data(), 1, text.size(), out) == text.size();
  const int error = errno;
  if (std::fclose(out) != 0) written = false;
  if (!written) return std::strerror(error);
  std::error_code ec;
  std::filesystem::rename(part, file, ec);
  return ec ? ec.message() : "";
}

// A worker's small file (its word on a notice); "" when there is none.
std::string read_small(const std::filesystem::path& file) {
  return read_small_file(file, kMaxSidecarBytes).value_or("");
}

std::filesystem::path beside(const std::filesystem::path& file, const char* suffix) {
  auto path = file;
  path += suffix;
  return path;
}

// ", global batch G = micro M x accumulation A x W" when the policy plans
// batches, else "".
std::string plan_text(const JobPolicy& policy, std::int64_t world_size) {
  if (!policy.has_config()) return {};
  const BatchPlan plan = policy.plan(world_size);
  return fmt::format(", global batch {} = micro {} x accumulation {} x {}", plan.global_batch,
                     plan.micro_batch, plan.gradient_accumulation_steps, world_size);
}

}  // namespace

RunDir::RunDir(const std::string& job_id, const WorkerOutput& output) : kept_(output.any_file()) {
  std::filesystem::path base = output.log_dir;
  if (base.empty()) {
    std::error_code ec;
    base = std::filesystem::temp_directory_path(ec);
    if (ec) {
      const char* tmpdir = std::getenv("TMPDIR");
      throw Error(ErrorKind::io,
                  fmt::format("TMPDIR '{}' is not a directory for the workers' error files: {}; "
                              "set TMPDIR to a writable directory",
                              tmpdir ? tmpdir : "/tmp", ec.message()));
    }
  }
  if (!output.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(base, ec);
    if (ec)
      throw Error(ErrorKind::io, fmt::format("--log-dir '{}' cannot be made: {}; give a "
                                             "writable directory",
                                             base.string(), ec.message()));
  }
  std::string pattern =
      (base / (kept_ ? job_id + "_XXXXXX" : "ductile-agent-" + job_id + "-XXXXXX")).string();
  if (!mkdtemp(pattern.data()))
    throw Error(ErrorKind::io,
                fmt::format("cannot make a directory {} for the workers' error and log files: {}; "
                            "{}",
                            pattern, strerror(errno),
                            output.log_dir.empty() ? "set TMPDIR to a writable directory"
                                                   : "give --log-dir a writable directory"));
  path_ = pattern;
}

RunDir::~RunDir() {
  if (kept_) return;  // the workers' log files, as torchrun keeps them
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

void NodeWorkers::enter_round(std::int64_t round, bool member) {
  current_round_ = round;
  member_ = member;
  reported_ = false;
  local_failure_.reset();
  local_error_.reset();
}

void NodeWorkers::notice_fence() {
  if (fenced_ || !conn_.keep_alive().fenced()) return;
  // The fence killed the workers (keep_alive.cpp): they are not a failure
  // of the round, and this node rejoins once etcd answers.
  fenced_ = true;
  stop(std::chrono::milliseconds(0));
}

void NodeWorkers::start(const RoundRecord& round, std::size_t group_rank, const JobPolicy& policy,
                        const std::filesystem::path& restore,
                        std::chrono::milliseconds restore_wait) {
  // As torchrun: the attempt's directory afresh; each worker's own
  // directory in it is made as that worker starts (WorkerSpec::directory).
  std::error_code ignored;
  std::filesystem::remove_all(attempt_dir_of(run_dir(), round.restarts), ignored);
  attempt_ = round.restarts;
  members_ = round.members;
  restarts_ = round.restarts;
  joining_round_ = 0;
  joining_.reset();
  // The last workers' notices and their word that they take them: a new
  // worker says so again once its engine is built.
  std::filesystem::remove_all(round_notice_of(run_dir(), 0).parent_path(), ignored);
  if (o_.agent_store)
    std::filesystem::create_directories(round_notice_of(run_dir(), 0).parent_path(), ignored);
  if (o_.checkpoint_timeout.count() > 0)
    std::filesystem::create_directories(checkpoint_request_of(run_dir(), round.round).parent_path(),
                                        ignored);
  auto specs = worker_specs(
      {o_, policy, round, group_rank, self_.id, run_dir(), snapshot_dir_, restore, restore_wait});
  self_.log(fmt::format(
      "round {} started: world size {} ({} nodes x {}), group rank {}, master {}:{}{}{}, "
      "restarts {}, started_ms={} ({})",
      round.round, round.world_size, round.members.size(), o_.nproc_per_node, group_rank,
      round.master_addr, round.master_port,
      round.mpi_join_port ? fmt::format(", MPI world joined at port {}", round.mpi_join_port) : "",
      plan_text(policy, round.world_size), round.restarts, round.started_ms, round.reason));
  try {
    if (!group_.start(specs, o_.stop_grace, o_.stop_signal))
      self_.log(
          fmt::format("a stop signal came while the workers of round {} started: {} of {} "
                      "were started",
                      round.round, group_.size(), specs.size()));
  } catch (const std::system_error& e) {
    // Out of processes (fork: EAGAIN, the process limit), memory or disk:
    // the machine's limits, not a bug; the workers started are stopped.
    const std::size_t started = group_.size();
    stop(std::chrono::milliseconds(0));
    struct rlimit processes{};
    getrlimit(RLIMIT_NPROC, &processes);
    throw Error(
        ErrorKind::io,
        fmt::format("cannot start worker local rank {} of {} (--nproc-per-node {}): {}; this "
                    "machine ran out of processes, memory or disk (process limit, ulimit -u: "
                    "{}): give a smaller --nproc-per-node or raise the limit",
                    started, specs.size(), o_.nproc_per_node, e.what(),
                    processes.rlim_cur == RLIM_INFINITY ? std::string("unlimited")
                                                        : std::to_string(processes.rlim_cur)));
  }
  conn_.fence_workers(group_.guard_pids());
  joined_ = true;
  if (!group_.start_log().empty())
    self_.log(fmt::format("round {}: {}", round.round, core::join(group_.start_log(), "; ")));
  // The next round's spares import while this round's workers run.
  start_spares(specs);
}

void NodeWorkers::start_spares(const std::vector<WorkerSpec>& specs) {
  if (o_.warm_imports.empty()) return;
  start_spares(specs, spare_setup(o_.warm_imports, o_.warm_program_imports));
}

SpareSetup NodeWorkers::spare_setup(std::vector<std::string> imports, bool program_imports) const {
  return {interpreter_words(o_.command, !o_.interpreter_choice.empty()), std::move(imports),
          is_round_variable, program_imports};
}

void NodeWorkers::start_spares(const std::vector<WorkerSpec>& specs, const SpareSetup& setup) {
  if (o_.stop_signal && o_.stop_signal->load() != 0) return;
  try {
    group_.start_spares(specs, setup, o_.stop_grace);
  } catch (const std::system_error& e) {
    // Without spares the next round's workers start cold: not a failure.
    self_.log(
        fmt::format("cannot start the spare workers ({}): the next round's workers start "
                    "cold",
                    e.what()));
  }
}

void NodeWorkers::start_first_spares(const JobPolicy& policy, bool joins_running_job) {
  const bool warm = !o_.warm_imports.empty();
  if (!warm && !joins_running_job) return;
  // Without --warm-workers a newcomer warms its first round's workers only,
  // with torch's imports alone: a script's own modules are not imported
  // ahead unless asked (a Python worker command: the caller checked).
  const SpareSetup setup = warm ? spare_setup(o_.warm_imports, o_.warm_program_imports)
                                : spare_setup(split(kDefaultWarmImports, ','), false);
  // A spare holds only what every round's workers share: a round of this
  // node alone at a valid size stands in for the first one it will join.
  RoundRecord any;
  any.members = {self_.id};
  const auto& sizes = policy.valid_gpus();
  any.world_size = sizes.empty() ? o_.nproc_per_node : sizes.front();
  std::vector<WorkerSpec> specs;
  try {
    specs = worker_specs({o_, policy, any, 0, self_.id, run_dir(), snapshot_dir_, {}});
  } catch (const std::exception& e) {
    self_.log(
        fmt::format("cannot prepare the spare workers ({}): the first round's workers "
                    "start cold",
                    e.what()));
    return;
  }
  start_spares(specs, setup);
  if (group_.spares() == 0) return;
  const auto started = now_ms();
  const auto ended = group_.await_spares(o_.stop_signal);
  if (o_.stop_signal && o_.stop_signal->load() != 0) return;  // the agent leaves
  if (!ended.empty())
    self_.log(fmt::format("a spare worker was not ready ({}): that worker starts cold",
                          core::join(ended, "; ")));
  else if (group_.spares() > 0 && !warm)
    self_.log(fmt::format(
        "the job runs and keeps snapshots: this node's workers imported {} ahead ({} ms), "
        "so that the running workers do not wait for it; this node joins",
        core::join(setup.imports, ", "), (now_ms() - started).count()));
  else if (group_.spares() > 0)
    self_.log(fmt::format("the spare workers are ready ({} ms): this node joins",
                          (now_ms() - started).count()));
}

bool NodeWorkers::growing(const RoundRecord& next) const {
  return std::all_of(members_.begin(), members_.end(), [&](const std::string& node) {
    return std::find(next.members.begin(), next.members.end(), node) != next.members.end();
  });
}

std::string NodeWorkers::in_place_refusal(const RoundRecord& next) const {
  if (!o_.agent_store)
    return "rank 0's worker serves the workers' store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), "
           "not the leading agent";
  if (o_.checkpoint_timeout.count() > 0)
    return "--checkpoint-timeout asks the workers to save through files of their round";
  if (fenced_) return "the lease's fence stopped them";
  if (next.restarts != restarts_)
    return fmt::format("round {} ended in a failure (restarts {})", current_round_, next.restarts);
  if (joining_round_ != 0) return fmt::format("they have not joined round {} yet", joining_round_);
  if (!group_.all_running()) return "not all of them run";
  const bool pause = growing(next);
  for (std::int64_t local = 0; local < o_.nproc_per_node; ++local) {
    const std::string ready = read_small(round_notice_ready_of(run_dir(), local));
    if (ready.empty())
      return fmt::format(
          "local rank {} did not say it takes round notices (its engine is not "
          "ductile.torch.zero3's, or cannot rejoin a round in place)",
          local);
    if (pause && ready.find("\nhold\n") == std::string::npos)
      return fmt::format(
          "no node of their round was lost, and local rank {} cannot pause at an optimizer "
          "update (its snapshots are copied to no other node: snapshot_replicas 0)",
          local);
  }
  return {};
}

std::optional<std::string> NodeWorkers::join_overdue() {
  if (joining_round_ == 0) return std::nullopt;
  bool joined = true;
  for (std::int64_t local = 0; local < o_.nproc_per_node && joined; ++local)
    joined = read_small(beside(round_notice_of(run_dir(), local), ".joined")) ==
             fmt::format("{}\n", joining_round_);
  if (joined) {
    // Their word that they waited is of this round's change: gone with it.
    for (std::int64_t local = 0; local < o_.nproc_per_node; ++local) {
      std::error_code ignored;
      std::filesystem::remove(beside(round_notice_of(run_dir(), local), ".waiting"), ignored);
    }
    joining_round_ = 0;
    joining_.reset();
    return std::nullopt;
  }
  if (!group_.running()) return std::nullopt;
  // A worker that waits for the notice joins once every rank of the round
  // does (newcomers start meanwhile); one that does not wait soon after the
  // notice is held in a collective of the last round (a silent peer).
  bool waiting = true;
  for (std::int64_t local = 0; local < o_.nproc_per_node && waiting; ++local) {
    const auto notice = round_notice_of(run_dir(), local);
    const std::string said = read_small(beside(notice, ".waiting"));
    waiting = !said.empty() || !read_small(beside(notice, ".joined")).empty();
  }
  // A worker freed from the collective (its engine shuts the connections
  // 50 ms after the notice) says so within milliseconds on an idle host,
  // but the failure travels through Python's stack and its recovery: on a
  // host whose cores are all busy that took over a second.
  const auto held = std::max<std::chrono::milliseconds>(std::chrono::seconds(3), o_.heartbeat);
  const auto wait = std::max<std::chrono::milliseconds>(std::chrono::seconds(30), 4 * o_.lease_ttl);
  const auto since = now_ms() - joining_since_;
  if (since <= (waiting ? wait : held)) return std::nullopt;
  joining_round_ = 0;
  return waiting ? fmt::format(
                       "round {}: this node's workers did not join it in place within {} ms; "
                       "they are started again in it",
                       current_round_, wait.count())
                 : fmt::format(
                       "round {}: this node's workers are still in a collective of the last "
                       "round {} ms after the notice (a silent peer holds it); they are "
                       "started again in it",
                       current_round_, held.count());
}

void NodeWorkers::restart_in_round(const JobPolicy& policy) {
  if (!joining_) return;
  const Joining joining = *joining_;
  joining_.reset();
  end_round(fmt::format("round {}: not joined in place in time", joining.round.round),
            o_.stop_grace);
  start(joining.round, joining.group_rank, policy, joining.restore);
}

NodeWorkers::Hold NodeWorkers::hold(const RoundRecord& next) {
  const auto wait = std::max<std::chrono::milliseconds>(std::chrono::seconds(5), 2 * o_.lease_ttl);
  if (hold_round_ != next.round) {
    for (std::int64_t local = 0; local < o_.nproc_per_node; ++local) {
      const auto notice = round_notice_of(run_dir(), local);
      // A .held file is a pause since the last notice: kept (a round that
      // replaces the one asked for finds the workers paused already).
      const std::string why = write_whole(beside(notice, ".hold"), fmt::format("{}\n", next.round));
      if (!why.empty()) {
        hold_refusal_ = fmt::format("cannot ask local rank {} to pause ({}.hold: {})", local,
                                    notice.string(), why);
        return Hold::late;
      }
    }
    hold_round_ = next.round;
    hold_asked_at_ = now_ms();
    self_.log(fmt::format(
        "round {}: asking the workers of round {} to pause at their next optimizer update (at "
        "most {} ms): {}",
        next.round, current_round_, wait.count(), next.reason));
  }
  std::string steps;
  for (std::int64_t local = 0; local < o_.nproc_per_node; ++local) {
    const std::string held = read_small(beside(round_notice_of(run_dir(), local), ".held"));
    if (held.empty() || held.back() != '\n') {
      if (now_ms() - hold_asked_at_ <= wait) return Hold::waiting;
      hold_refusal_ = fmt::format("local rank {} did not pause at an optimizer update within {} ms",
                                  local, wait.count());
      return Hold::late;
    }
    const std::string step = held.substr(0, held.size() - 1);
    if (step == "-1") {
      hold_refusal_ = fmt::format(
          "local rank {} cannot pause: a step of theirs cannot run again (its loss is not the "
          "forward's output, nor the output's loss or first element)",
          local);
      return Hold::late;
    }
    if (steps.find(step) == std::string::npos) steps += (steps.empty() ? "" : ", ") + step;
  }
  self_.log(fmt::format("round {}: the workers paused after step {}, {} ms after asked", next.round,
                        steps, (now_ms() - hold_asked_at_).count()));
  return Hold::held;
}

void NodeWorkers::continue_in_place(const RoundRecord& round, std::size_t group_rank,
                                    const JobPolicy& policy, const std::filesystem::path& restore) {
  std::vector<std::int64_t> ranks;
  for (std::int64_t local = 0; local < o_.nproc_per_node; ++local) {
    const std::int64_t rank = static_cast<std::int64_t>(group_rank) * o_.nproc_per_node + local;
    ranks.push_back(rank);
    // Whole: the worker reads the old notice or the new one.
    const auto file = round_notice_of(run_dir(), local);
    const std::string why = write_whole(
        file, round_notice_json(round, rank, local, o_.nproc_per_node, restore, policy));
    if (!why.empty())
      throw Error(ErrorKind::io,
                  fmt::format("cannot write the round notice {} of local rank {}: {}",
                              file.string(), local, why));
    std::error_code ignored;
    std::filesystem::remove(beside(file, ".hold"), ignored);
    std::filesystem::remove(beside(file, ".held"), ignored);
  }
  group_.renumber(ranks);
  members_ = round.members;
  restarts_ = round.restarts;
  joining_round_ = round.round;
  joining_since_ = now_ms();
  joining_.emplace(Joining{round, group_rank, restore});
  self_.log(fmt::format(
      "round {} continued in place: world size {} ({} nodes x {}), group rank {}, master {}:{}{}, "
      "restore {}, restarts {}, started_ms={} ({})",
      round.round, round.world_size, round.members.size(), o_.nproc_per_node, group_rank,
      round.master_addr, round.master_port, plan_text(policy, round.world_size), restore.string(),
      round.restarts, round.started_ms, round.reason));
}

std::optional<WorkerError> NodeWorkers::read_error(std::int64_t local_rank) {
  const auto file = error_file_of(run_dir(), attempt_, local_rank);
  // The worker's file: not followed if it is a link, never read past the
  // cap, never blocked on (a FIFO).
  int fd = ::open(file.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  struct stat info{};
  std::string text;
  if (fstat(fd, &info) == 0 && S_ISREG(info.st_mode)) {
    char buffer[65536];
    ssize_t n;
    while (text.size() <= kMaxErrorFileBytes && (n = ::read(fd, buffer, sizeof buffer)) > 0)
      text.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(fd);
  try {
    return worker_error_from_json(text);
  } catch (const MalformedRecord& e) {
    self_.log(fmt::format("the error file {} of local rank {} is not torch's: {}", file.string(),
                          local_rank, e.what()));
    return std::nullopt;
  }
}

bool NodeWorkers::all_saved() const {
  for (std::int64_t local = 0; local < o_.nproc_per_node; ++local) {
    std::error_code ec;
    if (!std::filesystem::exists(checkpoint_saved_of(run_dir(), current_round_, local), ec))
      return false;
  }
  return true;
}

void NodeWorkers::report_exit() {
  if (reported_ || group_.empty()) return;
  if (auto failure = group_.first_failure()) {
    if (!local_failure_) {
      local_failure_ = failure;
      local_error_ = read_error(failure->local_rank);
      self_.log(fmt::format("worker rank {} exited with status {}{}; stopping this node's workers",
                            failure->rank, failure->status,
                            local_error_ ? ": " + local_error_->message : ""));
      end_round(fmt::format("worker rank {} on node {} exited with status {}", failure->rank,
                            self_.id, failure->status),
                o_.stop_grace);
    }
    FailureReport report{self_.id,
                         local_failure_->rank,
                         local_failure_->local_rank,
                         std::clamp(local_failure_->status, 1, 255),
                         {},
                         local_error_ ? local_error_->message : "",
                         local_error_ ? local_error_->traceback : ""};
    for (const auto& line : local_failure_->last_lines)
      report.last_lines.push_back(excerpt(line, kMaxTextChars - 3));
    if (report.last_lines.size() > kMaxReportLines)
      report.last_lines.erase(report.last_lines.begin(), report.last_lines.end() - kMaxReportLines);
    const std::string k = self_.key("failure/" + std::to_string(current_round_));
    if (conn_.store().compare_and_swap(k, 0, to_json(report))) {
      reported_ = true;
    } else if (auto existing = conn_.store().get(k)) {
      try {
        failure_from_json(existing->value);
        reported_ = true;  // another worker's failure came first
      } catch (const MalformedRecord& e) {
        conn_.ignore_record(*existing, e.what(), "replaced by this node's failure report");
        reported_ = conn_.store().compare_and_swap(k, existing->mod_revision, to_json(report));
      }
    }
  } else if (group_.all_succeeded()) {
    conn_.store().put(self_.key("done/" + std::to_string(current_round_) + "/" + self_.id),
                      mark_json(self_.id, current_round_), conn_.lease());
    self_.log(fmt::format("round {}: this node's workers finished", current_round_));
    reported_ = true;
  }
}

void NodeWorkers::end_round(const std::string& why, std::chrono::milliseconds grace) {
  if (!group_.empty()) {
    // Best effort: a worker that cannot read why says less.
    write_whole(round_end_of(run_dir()), fmt::format("{}\n{}\n", current_round_, why));
  }
  stop(grace);
}

void NodeWorkers::stop(std::chrono::milliseconds grace) {
  group_.stop(grace);
  conn_.fence_workers({});
}

}  // namespace ductile::agent
