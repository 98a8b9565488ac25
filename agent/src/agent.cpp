// The agent's loop: register, read the rendezvous, lead when oldest, run this
// node's workers for the current round. See agent.hpp and rendezvous.hpp.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <thread>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "agent_impl.hpp"
#include "ductile/error.hpp"

extern char** environ;

namespace ductile::agent {

using std::chrono::milliseconds;

void Agent::ignore_record(const KeyValue& kv, const std::string& problem,
                          const std::string& outcome) {
  auto [it, inserted] = ignored_.try_emplace(kv.key, kv.mod_revision);
  if (!inserted && it->second == kv.mod_revision) return;
  it->second = kv.mod_revision;
  log(fmt::format("ignoring {} (revision {}): {}; {}", kv.key, kv.mod_revision, problem, outcome));
}

std::vector<NodeInfo> Agent::live_nodes(const std::vector<KeyValue>& kvs, bool* own_ok,
                                        bool every_key) {
  std::vector<NodeInfo> alive;
  std::map<std::string, NodeInfo> known;
  const std::string nodes = key("nodes/");
  *own_ok = false;
  for (const auto& kv : kvs) {
    std::string id = kv.key.substr(nodes.size());
    if (kv.lease == 0) {
      ignore_record(kv, "it has no lease, so no agent keeps it alive",
                    "not counted as a node (a stale or hand-written key?)");
      continue;
    }
    try {
      alive.push_back(node_from_json(kv.value, id, kv.create_revision));
      alive.back().lease = kv.lease;
      known[kv.key] = alive.back();
      if (id == id_) *own_ok = kv.lease == lease_ && alive.back().addr == addr_;
    } catch (const MalformedRecord& e) {
      // A key that held a node's valid record was overwritten (its create
      // revision is the same): the node stays as it was; else it is not one.
      auto it = known_nodes_.find(kv.key);
      bool was_valid = it != known_nodes_.end() && it->second.create_revision == kv.create_revision;
      ignore_record(kv, e.what(),
                    was_valid ? "the node's last valid record stands" : "not counted as a node");
      if (was_valid) {
        alive.push_back(it->second);
        alive.back().lease = kv.lease;
        known[kv.key] = it->second;
      }
    }
  }
  if (every_key) {
    known_nodes_ = std::move(known);
  } else {
    // Some of the keys: what is known of the others stays.
    for (auto& [k, node] : known) known_nodes_[k] = std::move(node);
  }
  // By age; a static job's nodes by their node rank.
  std::sort(alive.begin(), alive.end(),
            [ranked = o_.node_rank >= 0](const NodeInfo& a, const NodeInfo& b) {
              if (ranked && a.rank != b.rank) return a.rank < b.rank;
              return a.create_revision < b.create_revision;
            });
  return alive;
}

bool Agent::own_registration_ok(const std::vector<KeyValue>& own) {
  if (own.size() != 1 || own.front().lease != lease_) return false;
  try {
    own_revision_ = own.front().create_revision;
    return node_from_json(own.front().value, id_, own.front().create_revision).addr == addr_;
  } catch (const MalformedRecord& e) {
    ignore_record(own.front(), e.what(), "this agent writes its registration again");
    return false;
  }
}

bool Agent::previous_run(const RoundRecord& round, const KeyValue& kv) const {
  return round.state != RoundState::running && kv.mod_revision < first_revision_;
}

std::optional<RoundRecord> Agent::read_round(const std::optional<KeyValue>& kv) {
  if (!kv) return std::nullopt;
  try {
    RoundRecord round = round_from_json(kv->value);
    check_round_fits(round, o_.nproc_per_node, settings_.valid_gpus);
    highest_round_ = std::max(highest_round_, round.round);
    ignored_.erase(kv->key);
    if (previous_run(round, *kv)) {
      // Whatever order this run's agents registered in, none of them takes
      // the old run's end for its own: the leader starts a new run.
      if (previous_run_logged_ != kv->mod_revision)
        log(
            fmt::format("round {} of job '{}' {} before this agent registered: a previous run; "
                        "this is a new run",
                        round.round, o_.job_id, to_string(round.state)));
      previous_run_logged_ = kv->mod_revision;
      return std::nullopt;
    }
    last_good_round_ = round;
    return round;
  } catch (const MalformedRecord& e) {
    ignore_record(*kv, e.what(),
                  "this node keeps its round; the leader replaces the record with the last valid "
                  "one");
    return std::nullopt;
  }
}

void Agent::start_workers(const RoundRecord& round, std::size_t group_rank) {
  for (std::int64_t local = 0; local < o_.nproc_per_node; ++local) {
    auto file = error_file_of(run_dir_->path(), round.round, local);
    std::error_code ignored;
    std::filesystem::create_directories(file.parent_path(), ignored);
    std::filesystem::remove(file, ignored);
  }
  auto specs = worker_specs({o_, *policy_, round, group_rank, id_, run_dir_->path()});
  BatchPlan plan = policy_->plan(round.world_size);
  log(fmt::format(
      "round {} started: world size {} ({} nodes x {}), group rank {}, master {}:{}{}{}, "
      "restarts {}, started_ms={} ({})",
      round.round, round.world_size, round.members.size(), o_.nproc_per_node, group_rank,
      round.master_addr, round.master_port,
      round.mpi_join_port ? fmt::format(", MPI world joined at port {}", round.mpi_join_port) : "",
      policy_->has_config()
          ? fmt::format(", global batch {} = micro {} x accumulation {} x {}", plan.global_batch,
                        plan.micro_batch, plan.gradient_accumulation_steps, round.world_size)
          : "",
      round.restarts, round.started_ms, round.reason));
  workers_.start(specs);
  keep_alive_->fence_workers(workers_.guard_pids());
  joined_ = true;
}

std::optional<WorkerError> Agent::read_worker_error(std::int64_t local_rank) {
  const auto file = error_file_of(run_dir_->path(), current_round_, local_rank);
  // The worker's file: not followed if it is a link, never read past the
  // cap, never blocked on (a FIFO).
  int fd = ::open(file.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  struct stat info {};
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
    log(fmt::format("the error file {} of local rank {} is not torch's: {}", file.string(),
                    local_rank, e.what()));
    return std::nullopt;
  }
}

// Applies the round record; returns an exit code when the agent is done.
std::optional<int> Agent::apply(const RoundRecord& round) {
  if (round.state == RoundState::failed) {
    stop_workers(o_.stop_grace);
    const auto& f = round.failure;
    int status = f && f->exit_status != 0 ? f->exit_status : 1;
    if (f && f->node == id_) {
      std::string lines;
      for (const auto& l : f->last_lines) lines += "\n  | " + l;
      std::string error;
      if (!f->error_message.empty()) {
        // torchrun's "Root Cause": the worker's exception, from its
        // TORCHELASTIC_ERROR_FILE.
        error = "\n  its error (TORCHELASTIC_ERROR_FILE): " + f->error_message;
        std::size_t from = 0;
        while (from < f->error_traceback.size()) {
          auto eol = f->error_traceback.find('\n', from);
          if (eol == std::string::npos) eol = f->error_traceback.size();
          error += "\n  ! " + f->error_traceback.substr(from, eol - from);
          from = eol + 1;
        }
      }
      log(fmt::format(
          "job failed: worker rank {} (local rank {}) exited with status {} after {} "
          "restart(s) (max-restarts {}); its last lines:{}{}",
          f->rank, f->local_rank, f->exit_status, round.restarts, o_.max_restarts, lines, error));
    } else {
      log(fmt::format("job failed: {}", round.reason));
    }
    return status;
  }
  if (round.state == RoundState::succeeded) {
    if (workers_.running() && round.round == current_round_) return std::nullopt;
    if (local_failure_) return local_failure_->status;
    log("job finished");
    return kAgentOk;
  }
  if (round.round == current_round_) return std::nullopt;
  // A store this agent served for an earlier round's workers serves no one
  // now (another leader placed this round's).
  if (worker_store_ && o_.master_port == 0 &&
      (round.master_addr != addr_ || round.master_port != worker_store_->port()))
    worker_store_.reset();
  if (!workers_.empty()) {
    log(fmt::format("stopping the workers of round {} for round {}", current_round_, round.round));
    stop_workers(o_.stop_grace);
  }
  current_round_ = round.round;
  reported_ = false;
  local_failure_.reset();
  local_error_.reset();
  checkpoint_asked_ = false;
  saved_reported_ = false;
  auto it = std::find(round.members.begin(), round.members.end(), id_);
  const auto index = static_cast<std::size_t>(it - round.members.begin());
  // A round formed before this agent registered (a previous run of this
  // node, whose registration had not expired yet) lists this id with that
  // run's revision: its other members are gone or about to re-form.
  const bool earlier_run = it != round.members.end() && !round.member_revisions.empty() &&
                           round.member_revisions[index] != own_revision_;
  member_ = it != round.members.end() && !earlier_run;
  if (member_) {
    start_workers(round, index);
  } else if (earlier_run) {
    log(
        fmt::format("round {} was formed with an earlier registration of this node: waiting for "
                    "the next round",
                    round.round));
  } else if (round.members.empty()) {
    log(fmt::format("round {}: waiting for nodes ({})", round.round, round.reason));
  } else {
    log(
        fmt::format("round {}: standby; world size {} uses {} node(s), a larger valid size is "
                    "not reachable yet",
                    round.round, round.world_size, round.members.size()));
  }
  return std::nullopt;
}

bool Agent::workers_saved() const {
  for (std::int64_t local = 0; local < o_.nproc_per_node; ++local) {
    std::error_code ec;
    if (!std::filesystem::exists(checkpoint_saved_of(run_dir_->path(), current_round_, local), ec))
      return false;
  }
  return true;
}

void Agent::follow_checkpoint() {
  if (settings_.checkpoint_timeout.count() == 0 || !member_ || workers_.empty()) return;
  const std::string r = std::to_string(current_round_);
  if (!checkpoint_asked_) {
    auto kv = store_->get(key("checkpoint/" + r));
    if (!kv) return;
    CheckpointRequest request;
    try {
      request = checkpoint_from_json(kv->value, current_round_);
    } catch (const MalformedRecord& e) {
      ignore_record(*kv, e.what(), "no checkpoint asked");
      return;
    }
    // The workers' signal: the file appears, whole (written aside, renamed).
    auto file = checkpoint_request_of(run_dir_->path(), current_round_);
    auto part = file;
    part += ".part";
    std::ofstream(part) << nlohmann::json{{"round", current_round_}, {"reason", request.reason}}
                               .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                        << "\n";
    std::error_code ec;
    std::filesystem::rename(part, file, ec);
    checkpoint_asked_ = true;
    log(fmt::format("round {}: the workers are asked to checkpoint ({}; asked by {})",
                    current_round_, request.reason, request.by));
  }
  if (!saved_reported_ && workers_saved()) {
    store_->put(key("saved/" + r + "/" + id_), mark_json(id_, current_round_), lease_);
    saved_reported_ = true;
    log(fmt::format("round {}: this node's workers saved their checkpoint", current_round_));
  }
}

void Agent::report_worker_exit() {
  if (reported_ || workers_.empty()) return;
  // Workers that saved when asked may exit: neither a failure nor the end
  // of the job.
  if (checkpoint_asked_ && workers_saved()) return;
  if (auto failure = workers_.first_failure()) {
    if (!local_failure_) {
      local_failure_ = failure;
      local_error_ = read_worker_error(failure->local_rank);
      log(fmt::format("worker rank {} exited with status {}{}; stopping this node's workers",
                      failure->rank, failure->status,
                      local_error_ ? ": " + local_error_->message : ""));
      stop_workers(o_.stop_grace);
    }
    FailureReport report{id_,
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
    const std::string k = key("failure/" + std::to_string(current_round_));
    if (store_->compare_and_swap(k, 0, to_json(report))) {
      reported_ = true;
    } else if (auto existing = store_->get(k)) {
      try {
        failure_from_json(existing->value);
        reported_ = true;  // another worker's failure came first
      } catch (const MalformedRecord& e) {
        ignore_record(*existing, e.what(), "replaced by this node's failure report");
        reported_ = store_->compare_and_swap(k, existing->mod_revision, to_json(report));
      }
    }
  } else if (workers_.all_succeeded()) {
    store_->put(key("done/" + std::to_string(current_round_) + "/" + id_),
                mark_json(id_, current_round_), lease_);
    log(fmt::format("round {}: this node's workers finished", current_round_));
    reported_ = true;
  }
}

void Agent::stop_workers(std::chrono::milliseconds grace) {
  workers_.stop(grace);
  if (keep_alive_) keep_alive_->fence_workers({});
}

void Agent::rejoin_after_fence() {
  // The lease may still be alive (the others then still count this node in
  // its round): revoking it removes this node's key, and registering anew
  // makes it a new node (another create revision) for the others, who
  // re-form with it.
  log("etcd reachable again after the fence: leaving with the old lease and registering anew");
  store_->revoke_lease(lease_);
  auto sent = KeepAlive::Clock::now();
  lease_ = store_->grant_lease(o_.lease_ttl.count());
  keep_alive_->set_lease(lease_, sent);
  reclaim_node_key("was revoked after the fence");
  fenced_ = false;
  if (drain_) mark_draining();
}

void Agent::mark_draining() {
  // On the lease of this node's registration: a mark on a lease that
  // expired went with it, and the node would count as a new arrival.
  store_->put(key("draining/" + id_), mark_json(id_, 0), lease_);
}

std::optional<int> Agent::on_stop_signal(int sig) {
  if (drain_) {
    if (current_round_ == drain_->round && std::chrono::steady_clock::now() < drain_->deadline)
      return std::nullopt;
    log(fmt::format("signal {}: {}; leaving the job", sig,
                    current_round_ != drain_->round ? "the round re-formed without this node"
                                                    : "the checkpoint timeout passed"));
    return 128 + sig;
  }
  if (settings_.checkpoint_timeout.count() > 0 && member_ && workers_.running()) {
    // A drain: the round's workers save first (every rank: a save is
    // collective), then the leader re-forms without this node.
    try {
      mark_draining();
      CheckpointRequest request{current_round_, id_,
                                fmt::format("node {} drains (signal {})", id_, sig),
                                now_ms().count()};
      store_->compare_and_swap(key("checkpoint/" + std::to_string(current_round_)), 0,
                               to_json(request), lease_);
      drain_ = Drain{current_round_, std::chrono::steady_clock::now() +
                                         settings_.checkpoint_timeout + o_.lease_ttl};
      log(fmt::format(
          "signal {}: asking the workers of round {} to checkpoint before this node leaves "
          "(up to {} ms)",
          sig, current_round_, settings_.checkpoint_timeout.count()));
      return std::nullopt;
    } catch (const StoreError& e) {
      log(fmt::format("signal {}: cannot ask for a checkpoint ({}); leaving now", sig, e.what()));
      return 128 + sig;
    }
  }
  log(fmt::format("signal {}: stopping the workers and leaving the job", sig));
  return 128 + sig;
}

int Agent::leave(int code) {
  stop_workers(o_.stop_grace);
  mpi_server_.reset();
  keep_alive_.reset();
  try {
    store_->revoke_lease(lease_);
  } catch (const StoreError&) {
    // etcd is gone: the lease expires on its own.
  }
  return code;
}

void Agent::linger_as_host() {
  if (!rdzv_server_) return;
  // The others leave once they read the end (their keys go with their
  // leases); a killed one's key expires within the TTL.
  const auto deadline = std::chrono::steady_clock::now() + o_.lease_ttl + o_.poll_interval * 2;
  while (std::chrono::steady_clock::now() < deadline) {
    auto nodes = store_->get_prefix(key("nodes/"));
    if (std::none_of(nodes.begin(), nodes.end(),
                     [&](const KeyValue& kv) { return kv.key != key("nodes/" + id_); }))
      return;
    std::this_thread::sleep_for(o_.poll_interval / 2);
  }
}

int Agent::run() {
  setup();
  // The lease is kept alive from now on: registering may wait for a
  // previous run's registration to expire.
  keep_alive_ = std::make_unique<KeepAlive>(make_store_, lease_, o_.lease_ttl, granted_at_,
                                            [this](const std::string& line) { log(line); });
  register_node();
  {
    auto own = store_->get(key("nodes/" + id_));
    own_revision_ = first_revision_ = own ? own->create_revision : 0;
    bool own_ok = false;
    auto others = live_nodes(store_->get_prefix(key("nodes/")), &own_ok, true);
    std::erase_if(others, [&](const NodeInfo& n) { return n.id == id_; });
    check_settings(others);
  }
  log(fmt::format(
      "joined job '{}' on {} (address {}, {} worker(s), nodes {}..{}, valid GPU "
      "counts [{}], min_time {} ms{})",
      o_.job_id, store_->describe(), addr_, o_.nproc_per_node, settings_.min_nodes,
      settings_.max_nodes, fmt::join(settings_.valid_gpus, ", "), settings_.min_time.count(),
      o_.node_rank >= 0 ? fmt::format(", node rank {}", o_.node_rank) : ""));
  last_membership_change_ = joined_job_at_ = now_ms();
  const bool ranked = o_.node_rank >= 0;
  for (;;) {
    if (o_.stop_signal && o_.stop_signal->load() != 0)
      if (auto code = on_stop_signal(o_.stop_signal->load())) return leave(*code);
    workers_.pump(o_.poll_interval);
    if (o_.join_timeout && !joined_ && now_ms() - joined_job_at_ >= *o_.join_timeout) {
      log(fmt::format("error: no round took this node within the join timeout ({} ms); giving up",
                      o_.join_timeout->count()));
      return leave(kAgentJoinTimeout);
    }
    if (!fenced_ && keep_alive_->fenced()) {
      // The fence killed the workers (keep_alive.cpp): they are not a
      // failure of the round, and this node rejoins once etcd answers.
      fenced_ = true;
      workers_.stop(milliseconds(0));
      keep_alive_->fence_workers({});
    }
    try {
      if (fenced_) rejoin_after_fence();
      report_worker_exit();
      follow_checkpoint();
      if (keep_alive_->lost()) {
        log("lease expired (etcd was unreachable too long?); registering again");
        auto sent = KeepAlive::Clock::now();
        lease_ = store_->grant_lease(o_.lease_ttl.count());
        keep_alive_->set_lease(lease_, sent);
        reclaim_node_key("expired with its lease");
        if (drain_) mark_draining();
      }
      // One request a pass for most agents: the round, the oldest
      // registrations (the leader is the oldest live one) and this node's
      // own. Only the leader reads every registration. A static job's
      // leader is its lowest node rank: every registration is read.
      auto reads = store_->read({RangeRead{key("round")},
                                 RangeRead{key("nodes/"), true, ranked ? 0 : kLeaderWindow, true},
                                 RangeRead{key("nodes/" + id_)}});
      std::optional<KeyValue> round_kv;
      if (!reads[0].empty()) round_kv = reads[0].front();
      if (outage_since_) {
        log(fmt::format("{} reachable again after {} ms", store_->describe(),
                        (now_ms() - *outage_since_).count()));
        outage_since_.reset();
      }
      bool ignored = false;
      std::vector<NodeInfo> oldest = live_nodes(reads[1], &ignored, ranked);
      if (!own_registration_ok(reads[2])) {
        reclaim_node_key(fmt::format("{} is gone or is not this agent's", key("nodes/" + id_)));
        continue;
      }
      std::vector<NodeInfo> alive;
      if (oldest.empty() || oldest.front().id == id_) {
        // Leading (or no live registration among the oldest keys): all of
        // them; the leader tracks when the membership last changed.
        alive = ranked ? oldest : live_nodes(store_->get_prefix(key("nodes/")), &ignored, true);
        std::vector<std::string> ids;
        for (const auto& n : alive) ids.push_back(n.id);
        if (ids != last_alive_) {
          last_alive_ = ids;
          last_membership_change_ = now_ms();
        }
      } else {
        // Not leading: when this agent leads again (the leader gone), that
        // is a change of membership, seen then.
        last_alive_.clear();
      }
      std::optional<RoundRecord> round = read_round(round_kv);
      if (!alive.empty() && alive.front().id == id_) lead(alive, round_kv, round);
      if (round)
        if (auto code = apply(*round)) {
          linger_as_host();
          return leave(*code);
        }
    } catch (const StoreGone& e) {
      // The agent that held a c10d or static rendezvous is gone, and the
      // rendezvous with it: as torchrun's agents, these end the job.
      log(
          fmt::format("error: {}; the job ends with its rendezvous' host, as under torchrun "
                      "(an etcd rendezvous, --rdzv-backend etcd, survives the loss of any node)",
                      e.what()));
      return leave(kAgentStoreLost);
    } catch (const StoreError& e) {
      // Unreachable, or an answer that is an error: the workers keep
      // running while the store may come back.
      auto now = now_ms();
      if (!outage_since_) {
        outage_since_ = now;
        log(fmt::format("{}; the workers keep running, giving up after {} ms", e.what(),
                        o_.store_timeout.count()));
      }
      if (now - *outage_since_ >= o_.store_timeout) {
        log(fmt::format("error: {} unreachable for {} ms (last error: {}); stopping the workers",
                        store_->describe(), (now - *outage_since_).count(), e.what()));
        return leave(kAgentStoreLost);
      }
    } catch (const Error& e) {
      // Another agent took this node's id while it was away.
      log(fmt::format("error: {}", e.what()));
      return leave(2);
    }
  }
}

int run_agent(const AgentOptions& options) {
  Agent agent(options);
  return agent.run();
}

}  // namespace ductile::agent
