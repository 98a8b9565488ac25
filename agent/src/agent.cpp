// The agent's loop: register, read the rendezvous, lead when oldest, run this
// node's workers for the current round (the parts: agent_impl.hpp). See
// agent.hpp and rendezvous.hpp.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <thread>

#include <fmt/ranges.h>

#include "agent_impl.hpp"
#include "ductile/error.hpp"

namespace ductile::agent {

using std::chrono::milliseconds;

namespace {

// The index of `round`'s oldest member (the lowest registration revision),
// its leader: rounds take the oldest nodes. None for a round without its
// members' revisions.
std::optional<std::size_t> oldest_member(const RoundRecord& round) {
  if (round.members.empty() || round.member_revisions.size() != round.members.size())
    return std::nullopt;
  return static_cast<std::size_t>(
      std::min_element(round.member_revisions.begin(), round.member_revisions.end()) -
      round.member_revisions.begin());
}

}  // namespace

// How often a node that waits for enough nodes says so again.
constexpr milliseconds kShortOfNodesReminder{15000};

void Agent::setup() {
  check_options(o_);
  // The most GPUs this job may use: a v0.2 policy plans for that one size.
  const std::int64_t largest_world = o_.max_nodes.value_or(o_.min_nodes) * o_.nproc_per_node;
  if (o_.config.empty()) {
    policy_ =
        JobPolicy::any_size(o_.nproc_per_node, o_.min_nodes, o_.max_nodes.value_or(o_.min_nodes));
  } else {
    try {
      policy_ = JobPolicy::load(o_.config, o_.runtime, largest_world);
    } catch (const Error& e) {
      // A world size the policy refuses: say where the agent's comes from.
      if (e.kind() != ErrorKind::incompatible) throw;
      throw Error(e.kind(),
                  fmt::format("{} (the agent's world size {} is --nnodes {} x --nproc-per-node "
                              "{}: give values whose product the configuration accepts)",
                              e.what(), largest_world, o_.max_nodes.value_or(o_.min_nodes),
                              o_.nproc_per_node));
    }
  }
  const auto& valid = policy_->valid_gpus();
  std::int64_t max_nodes = o_.max_nodes.value_or(
      std::max<std::int64_t>(o_.min_nodes, valid.empty() ? 0 : valid.back() / o_.nproc_per_node));
  if (admitted_nodes(valid, o_.nproc_per_node, o_.min_nodes, max_nodes, max_nodes) == 0) {
    std::vector<std::int64_t> usable;
    for (std::int64_t n = 1; n <= (valid.empty() ? 0 : valid.back()); ++n)
      if (admitted_nodes(valid, n, o_.min_nodes, max_nodes, max_nodes) > 0) usable.push_back(n);
    throw Error(ErrorKind::incompatible,
                fmt::format("--nproc-per-node {}: no world size of {} to {} nodes x {} is valid "
                            "for {} (policy '{}', valid GPU counts [{}]); nproc-per-node values "
                            "that fit: [{}]",
                            o_.nproc_per_node, o_.min_nodes, max_nodes, o_.nproc_per_node,
                            policy_->origin(), policy_->policy_name(), fmt::join(valid, ", "),
                            fmt::join(usable, ", ")));
  }
  settings_.valid_gpus = valid;
  settings_.nproc_per_node = o_.nproc_per_node;
  settings_.min_nodes = o_.min_nodes;
  settings_.max_nodes = max_nodes;
  settings_.max_restarts = o_.max_restarts;
  settings_.min_time = o_.min_time.value_or(policy_->min_time());
  settings_.settle = o_.settle;
  // The grace lets a lost node explain a failure; one node alone (the
  // embedded rendezvous: --standalone) has no other node, so it restarts
  // at once.
  settings_.failure_grace = o_.failure_grace.value_or(
      o_.rendezvous == RendezvousKind::embedded ? milliseconds(0) : milliseconds(o_.lease_ttl));
  settings_.checkpoint_timeout = o_.checkpoint_timeout;

  self_.prefix = "/ductile/agent/" + o_.job_id + "/";
  self_.addr = o_.node_addr.empty() ? fully_qualified_host_name() : o_.node_addr;
  self_.id = o_.node_id;
  if (self_.id.empty()) {
    std::random_device random;
    std::string id = fmt::format("{}-{}-{:04x}", host_name(), getpid(), random() & 0xffff);
    // A host name may hold characters a node id may not.
    for (char& c : id)
      if (!valid_node_id(std::string(1, c))) c = '_';
    self_.id = id.substr(id.size() - std::min(id.size(), kMaxNodeIdChars));  // its end
  }
  workers_.make_run_dir();
  snapshots_.make_area();
  // From here until the loop, the rendezvous may wait (for its host, for a
  // previous run's registration): a stop signal is seen meanwhile.
  stop_watch_.arm();
  conn_.open();
  snapshots_.serve();
  // Registered with the node: the others copy its snapshots from there.
  self_.snapshot_port = snapshots_.port();
  links_.serve();
  self_.link_port = links_.port();
  // One static node: its workers' store at the port asked.
  if (o_.rendezvous == RendezvousKind::embedded && o_.agent_store && o_.master_port != 0)
    leadership_.serve_fixed_worker_store();
  // Before the lease: waiting for the spares must not use up its TTL.
  workers_.start_first_spares(*policy_, o_.warm_imports.empty() && joins_running_job());
  conn_.grant_first_lease();
  leadership_.start_mpi_server();
}

std::optional<int> Agent::apply(const RoundRecord& round) {
  if (round.state == RoundState::failed) {
    workers_.end_round("the job failed: " + round.reason, o_.stop_grace);
    const auto& f = round.failure;
    int status = f && f->exit_status != 0 ? f->exit_status : 1;
    if (f && f->node == self_.id) {
      std::string lines;
      for (const auto& l : f->last_lines) lines += "\n  | " + l;
      if (lines.empty())
        lines =
            " <N/A> (its output went to the console: --tee 3 --log-dir DIR keeps it in log "
            "files)";
      std::string error;
      if (!f->error_message.empty()) {
        // torchrun's "Root Cause": the worker's exception, from its
        // TORCHELASTIC_ERROR_FILE.
        error = "\n  its error (TORCHELASTIC_ERROR_FILE): " + f->error_message;
        auto traceback = split(f->error_traceback, '\n');
        if (traceback.back().empty()) traceback.pop_back();  // the end of its last line
        for (const auto& line : traceback) error += "\n  ! " + line;
      } else {
        error =
            "\n  its error (TORCHELASTIC_ERROR_FILE): <N/A> (it wrote none; to enable traceback "
            "see: https://pytorch.org/docs/stable/elastic/errors.html)";
      }
      self_.log(fmt::format(
          "job failed: worker rank {} (local rank {}) exited with status {} after {} "
          "restart(s) (max-restarts {}); its last lines:{}{}",
          f->rank, f->local_rank, f->exit_status, round.restarts, o_.max_restarts, lines, error));
    } else {
      self_.log(fmt::format("job failed: {}", round.reason));
    }
    return status;
  }
  if (round.state == RoundState::succeeded) {
    if (workers_.running() && round.round == workers_.current_round()) return std::nullopt;
    if (workers_.local_failure()) return workers_.local_failure()->status;
    self_.log("job finished");
    return kAgentOk;
  }
  if (round.round == workers_.current_round()) {
    if (restore_pending_round_ == round.round) finish_pending_restore(round);
    return std::nullopt;
  }
  restore_pending_round_ = 0;  // a round started ahead of its restore is over
  leadership_.drop_stale_worker_store(round);
  auto it = std::find(round.members.begin(), round.members.end(), self_.id);
  const auto index = static_cast<std::size_t>(it - round.members.begin());
  // A round formed before this agent registered (a previous run of this
  // node, whose registration had not expired yet) lists this id with that
  // run's revision: its other members are gone or about to re-form.
  const bool earlier_run = it != round.members.end() && !round.member_revisions.empty() &&
                           round.member_revisions[index] != membership_.own_revision();
  const bool member = it != round.members.end() && !earlier_run;
  // A member whose workers run and take round notices keeps them: they
  // rejoin the round in place once the snapshot to load is known.
  std::string refusal = member ? workers_.in_place_refusal(round) : "not a member";
  if (refusal.empty() && workers_.growing(round)) {
    // Nodes join: the workers train on until they pause at an update, with
    // their last snapshot committed and copied; that one is restored.
    const auto hold = workers_.hold(round);
    if (hold == NodeWorkers::Hold::waiting) return std::nullopt;
    if (hold == NodeWorkers::Hold::late) {
      refusal = workers_.hold_refusal();
      self_.log(fmt::format("round {}: {}; the workers of round {} are restarted", round.round,
                            refusal, workers_.current_round()));
    }
  }
  const bool kept = refusal.empty();
  if (!workers_.empty() && !kept) {
    self_.log(fmt::format("stopping the workers of round {} for round {}", workers_.current_round(),
                          round.round));
    workers_.end_round(fmt::format("round {} formed: {}", round.round, round.reason),
                       o_.stop_grace);
  }
  // Before the round is entered: a store error, or a stop signal, while the
  // members agree on a snapshot leaves the round to apply again; a member
  // gone meanwhile leaves it unentered until the leader forms the next.
  std::filesystem::path restore;
  if (member && !kept && round.snapshots_held && start_ahead_of_restore(round, index)) {
    finish_pending_restore(round);
    return std::nullopt;
  }
  if (member) {
    std::optional<std::filesystem::path> prepared;
    try {
      prepared = snapshots_.prepare_round(round);
    } catch (const RestoreFailed& failed) {
      // Entered without workers: the round is not applied again, and fails.
      if (kept)
        workers_.end_round(fmt::format("round {} formed: {}", round.round, round.reason),
                           o_.stop_grace);
      workers_.enter_round(round.round, member);
      checkpoints_.enter_round();
      snapshots_.fail_round(round, failed.message);
      return std::nullopt;
    }
    if (!prepared) return std::nullopt;
    restore = std::move(*prepared);
  }
  if (refusal.empty() && restore.empty())
    refusal = "no snapshot in memory to load (--snapshot-dir, snapshot_interval)";
  if (refusal.empty()) {
    try {
      workers_.continue_in_place(round, index, *policy_, restore);
      workers_.enter_round(round.round, member);
      checkpoints_.enter_round();
      short_since_.reset();
      return std::nullopt;
    } catch (const Error& e) {
      refusal = e.what();
    }
  }
  if (kept) {
    self_.log(
        fmt::format("round {}: the workers of round {} do not go on in place: {}; "
                    "stopping them",
                    round.round, workers_.current_round(), refusal));
    workers_.end_round(fmt::format("round {} formed: {}", round.round, round.reason),
                       o_.stop_grace);
  }
  workers_.enter_round(round.round, member);
  checkpoints_.enter_round();
  short_since_.reset();
  if (member) {
    workers_.start(round, index, *policy_, restore);
  } else if (earlier_run) {
    self_.log(
        fmt::format("round {} was formed with an earlier registration of this node: waiting for "
                    "the next round",
                    round.round));
  } else if (round.members.empty()) {
    short_since_ = workers_.joined() ? now_ms() : joined_job_at_;
    short_said_ = now_ms();
    self_.log(fmt::format("round {}: waiting for nodes ({}); {}", round.round, round.reason,
                          short_of_nodes(true)));
  } else {
    self_.log(
        fmt::format("round {}: standby; world size {} uses {} node(s), a larger valid size is "
                    "not reachable yet",
                    round.round, round.world_size, round.members.size()));
  }
  return std::nullopt;
}

std::string Agent::short_of_nodes(bool now) const {
  // The fewest nodes of a valid world size.
  std::int64_t needed = 0;
  for (std::int64_t k = std::max<std::int64_t>(settings_.min_nodes, 1);
       k <= settings_.max_nodes && needed == 0; ++k)
    if (admitted_nodes(settings_.valid_gpus, settings_.nproc_per_node, k, k, k) == k) needed = k;
  const std::string present = fmt::format(
      "{}{} node(s) present of the {} needed (--nnodes {}:{}, {} worker(s) each, valid GPU "
      "counts [{}])",
      nodes_seen_ >= static_cast<std::size_t>(kLeaderWindow) ? "at least " : "", nodes_seen_,
      needed, settings_.min_nodes, settings_.max_nodes, settings_.nproc_per_node,
      fmt::join(settings_.valid_gpus, ", "));
  if (!o_.join_timeout)
    return fmt::format(
        "{}{}; waiting without end (--rdzv-conf join_timeout=SECONDS gives up after that "
        "long, exit status {})",
        now ? "" : "still waiting: ", present, kAgentJoinTimeout);
  const auto left =
      std::max(milliseconds(0), short_since_.value_or(now_ms()) + *o_.join_timeout - now_ms());
  return fmt::format(
      "{}{}; giving up in {:.1f} s (--rdzv-conf join_timeout={:g}) with exit status {}",
      now ? "" : "still waiting: ", present, left.count() / 1000.0,
      o_.join_timeout->count() / 1000.0, kAgentJoinTimeout);
}

void Agent::rejoin_after_fence() {
  // The lease may still be alive (the others then still count this node in
  // its round): revoking it removes this node's key, and registering anew
  // makes it a new node (another create revision) for the others, who
  // re-form with it.
  conn_.leave_fenced_lease();
  membership_.reclaim_node_key("was revoked after the fence");
  workers_.rejoined();
  signals_.renew_mark();
}

bool Agent::behind_the_oldest(const std::optional<KeyValue>& round_kv) {
  if (window_leader_.empty() || membership_.own_revision() <= 0) return false;
  const auto round = membership_.read_round(round_kv);
  const auto leader = round ? oldest_member(*round) : std::nullopt;
  // Its leader the one this agent links to (else the age index it read
  // lacked the leader's entry, written a moment after the registration).
  if (!leader || round->members[*leader] != window_leader_ ||
      round->member_revisions[*leader] != window_leader_revision_)
    return false;
  const auto older = std::count_if(
      round->member_revisions.begin(), round->member_revisions.end(),
      [this](std::int64_t revision) { return revision < membership_.own_revision(); });
  return older >= kLeaderWindow;
}

void Agent::wait_for_workers(const std::vector<std::string>& wake_on) {
  // A stop signal handled by another thread does not end the poll: it is
  // looked for in steps this short.
  constexpr milliseconds kStep(100);
  const auto until = std::chrono::steady_clock::now() + o_.poll_interval;
  const int changes = conn_.store().changes_fd(wake_on);
  for (;;) {
    const auto left =
        std::chrono::duration_cast<milliseconds>(until - std::chrono::steady_clock::now());
    if (workers_.pump(std::clamp(left, milliseconds(0), kStep), changes)) return;
    if (left <= kStep || (o_.stop_signal && o_.stop_signal->load() != 0)) return;
  }
}

void Agent::leave_outside_loop(int sig) {
  const std::string message =
      fmt::format("signal {}: no worker runs yet (or any longer); leaving the job", sig);
  if (self_.id.empty())
    write_line(true, "ductile agent: " + message);
  else
    self_.log(message);
  // Its lease expires on its own (the store may be what is waited for).
  workers_.discard_run_dir();
  snapshots_.discard();
  std::_Exit(128 + sig);
}

int Agent::leave(int code) {
  links_.close();  // a goodbye first: leaving is no loss
  workers_.stop(o_.stop_grace);
  snapshots_.close();
  leadership_.stop_mpi_server();
  conn_.close();
  return code;
}

std::optional<int> Agent::while_store_answers(const std::string& what,
                                              const std::function<void()>& step) {
  const auto started = now_ms();
  auto retry = milliseconds(100);
  for (bool said = false;;) {
    try {
      step();
      if (said) self_.log(fmt::format("{} answers again", conn_.store().describe()));
      return std::nullopt;
    } catch (const StoreGone& e) {
      self_.log(fmt::format("error: {} while {}; the job ends with its rendezvous' host", e.what(),
                            what));
      return kAgentStoreLost;
    } catch (const StoreUnavailable& e) {
      // A slow or briefly unreachable store is waited for within the
      // outage's budget, as in the loop; only its end gives up.
      const auto waited = now_ms() - started;
      if (waited >= o_.store_timeout) {
        self_.log(fmt::format("error: {} unreachable for {} ms while {} (last error: {})",
                              conn_.store().describe(), waited.count(), what, e.what()));
        return kAgentStoreLost;
      }
      if (!said)
        self_.log(fmt::format("{} while {}; trying again for up to {} ms", e.what(), what,
                              o_.store_timeout.count()));
      said = true;
      std::this_thread::sleep_for(retry);
      retry = std::min(retry * 2, milliseconds(2000));
    }
  }
}

bool Agent::joins_running_job() {
  // Spares run Python only: no request for another worker command.
  try {
    interpreter_words(o_.command, !o_.interpreter_choice.empty());
  } catch (const Error&) {
    return false;
  }
  try {
    const auto found = conn_.store().read(
        {RangeRead{.key = self_.key("round")},
         RangeRead{.key = self_.key("snapshots/"), .prefix = true, .limit = 1, .keys_only = true}});
    return found.size() == 2 && !found[0].empty() && !found[1].empty() &&
           round_from_json(found[0].front().value).state == RoundState::running;
  } catch (const StoreError&) {
    return false;  // registering waits for the store, and says so
  } catch (const MalformedRecord&) {
    return false;  // the loop's read says what is wrong with it
  }
}

int Agent::run() {
  // What a worker's children leave behind and outlives its guard comes to
  // the agent, which ends it with the worker group (workers.hpp).
  make_subreaper();
  setup();
  // The lease is kept alive from now on: registering may wait for a
  // previous run's registration to expire.
  conn_.start_keep_alive();
  if (auto code = while_store_answers("registering this node", [this] {
        membership_.register_node();
        membership_.join(*policy_);
      }))
    return leave(*code);
  stop_watch_.disarm();
  self_.log(fmt::format(
      "joined job '{}' on {} (address {}, {} worker(s), nodes {}..{}, valid GPU "
      "counts [{}], min_time {} ms{})",
      o_.job_id, conn_.store().describe(), self_.addr, o_.nproc_per_node, settings_.min_nodes,
      settings_.max_nodes, fmt::join(settings_.valid_gpus, ", "), settings_.min_time.count(),
      o_.node_rank >= 0 ? fmt::format(", node rank {}", o_.node_rank) : ""));
  joined_job_at_ = now_ms();
  leadership_.set_membership_change(joined_job_at_);
  const bool ranked = o_.node_rank >= 0;
  KeyValueStore& store = conn_.store();
  auto key = [this](const std::string& name) { return self_.key(name); };
  // The keys whose change starts the next pass at once. Registrations come
  // and go by the hundred when a large job starts: only the oldest agents
  // (the leader and those next in line) are woken by them, the others
  // when the round changes.
  const std::vector<std::string> acted_on = {
      key("round"),     key("settings"), key("checkpoint/"), key("done/"),
      key("draining/"), key("failure/"), key("saved/"),      key("nodes/" + self_.id)};
  std::vector<std::string> wake_on = acted_on;
  for (;;) {
    if (o_.stop_signal && o_.stop_signal->load() != 0)
      if (auto code = signals_.on_stop_signal(o_.stop_signal->load())) return leave(*code);
    wait_for_workers(wake_on);
    if (o_.join_timeout && !workers_.joined() && now_ms() - joined_job_at_ >= *o_.join_timeout) {
      self_.log(
          fmt::format("error: no round took this node within the join timeout ({} ms); giving up",
                      o_.join_timeout->count()));
      return leave(kAgentJoinTimeout);
    }
    if (short_since_ && o_.join_timeout && now_ms() - *short_since_ >= *o_.join_timeout) {
      // As torchrun's agents: a rendezvous that does not complete within
      // join_timeout ends the agent.
      self_.log(fmt::format(
          "error: too few nodes for {} ms (--rdzv-conf join_timeout): {} node(s) present; "
          "giving up with exit status {}",
          (now_ms() - *short_since_).count(), nodes_seen_, kAgentJoinTimeout));
      return leave(kAgentJoinTimeout);
    }
    if (short_since_ && now_ms() - short_said_ >= kShortOfNodesReminder) {
      short_said_ = now_ms();
      self_.log(short_of_nodes(false));
    }
    workers_.notice_fence();
    try {
      if (workers_.fenced()) rejoin_after_fence();
      // Workers that saved when asked may exit: neither a failure nor the
      // end of the job.
      if (!checkpoints_.saved_on_request()) workers_.report_exit();
      if (const auto overdue = workers_.join_overdue()) {
        self_.log(*overdue);
        workers_.restart_in_round(*policy_);
      }
      checkpoints_.follow();
      if (conn_.keep_alive().lost()) {
        self_.log(fmt::format(
            "lease gone (revoked by another agent, its link to this node lost; or expired: {} "
            "unreachable too long?); registering again",
            store.describe()));
        conn_.renew_lease();
        membership_.reclaim_node_key("expired with its lease");
        signals_.renew_mark();
      }
      // One read a pass, from the mirror: the round and this node's own
      // registration; an agent that follows every key (the leader, those
      // next in line, a static job's) also the oldest registrations (the
      // leader is the oldest live one) and every node's snapshot holdings.
      // Only the leader reads every registration. A static job's leader is
      // its lowest node rank: every registration is read.
      bool everything = conn_.follows_everything();
      const RangeRead window{key("nodes/"), true, ranked ? 0 : kLeaderWindow, true};
      std::vector<std::vector<KeyValue>> reads;
      std::optional<KeyValue> round_kv;
      auto read_pass = [&] {
        std::vector<RangeRead> wanted = {RangeRead{key("round")},
                                         RangeRead{key("nodes/" + self_.id)}};
        if (everything) {
          wanted.push_back(window);
          wanted.push_back(snapshots_.holdings_read());
        }
        reads = store.read(wanted);
        round_kv.reset();
        if (!reads[0].empty()) round_kv = reads[0].front();
      };
      read_pass();
      if (outage_since_) {
        self_.log(fmt::format("{} reachable again after {} ms", store.describe(),
                              (now_ms() - *outage_since_).count()));
        outage_since_.reset();
      }
      bool ignored = false;
      std::vector<NodeInfo> oldest;
      bool window_read = everything;
      if (everything) {
        oldest = membership_.live_nodes(reads[2], &ignored, ranked);
      } else {
        // An agent that follows its own part looks at the oldest
        // registrations when the round changed, and while it has no link
        // to its leader every kWindowRecheck: the nodes older than it may
        // have gone, and it may now lead. A leader it is linked to writes a
        // round when they go; a job whose oldest agents all died at once
        // has none.
        const std::int64_t round_revision = round_kv ? round_kv->mod_revision : 0;
        const bool round_changed = round_revision != window_round_revision_;
        if (auto joined = membership_.take_join_window()) {
          // The first pass: join() read them a moment ago, records and all.
          oldest = std::move(*joined);
          window_read = true;
        } else if (round_changed && behind_the_oldest(round_kv)) {
          window_round_revision_ = round_revision;
          window_read_at_ = now_ms();
        } else if (round_changed ||
                   (!links_.leader_linked() &&
                    now_ms() - window_read_at_ >= std::max(o_.poll_interval, kWindowRecheck))) {
          // The age index's keys say it (age, id and lease): the records
          // are read once this agent follows every key.
          oldest = membership_.oldest_by_age(store.read({membership_.age_window(false)}).front());
          window_read = true;
        }
        if (window_read) {
          // The round's oldest member leads it: when the index lacks it (its
          // entry not written yet, or deleted), it comes first all the same.
          const auto round = membership_.read_round(round_kv);
          if (const auto leader = round ? oldest_member(*round) : std::nullopt;
              leader && (oldest.empty() ||
                         round->member_revisions[*leader] < oldest.front().create_revision)) {
            NodeInfo first;
            first.id = round->members[*leader];
            first.create_revision = round->member_revisions[*leader];
            oldest.insert(oldest.begin(), std::move(first));
          }
          window_leader_ = oldest.empty() ? std::string() : oldest.front().id;
          window_leader_revision_ = oldest.empty() ? 0 : oldest.front().create_revision;
          window_round_revision_ = round_revision;
          window_read_at_ = now_ms();
        }
      }
      // Among the kLeaderWindow oldest: fewer live registrations are older
      // (the age index may lack the newest entries, never an old one that
      // lives, but this agent's own).
      const auto older = std::count_if(oldest.begin(), oldest.end(), [this](const NodeInfo& n) {
        return n.id != self_.id && n.create_revision < membership_.own_revision();
      });
      const bool in_window = ranked || (window_read && older < kLeaderWindow);
      if (window_read) {
        nodes_seen_ = oldest.size();
        conn_.follow_everything(in_window);
        if (in_window && !everything) {
          // It follows every key from now on (the mirror brings them); this
          // pass reads them from etcd meanwhile, and goes on as the oldest
          // agents' does.
          everything = true;
          read_pass();
          oldest = membership_.live_nodes(reads[2], &ignored, ranked);
          nodes_seen_ = oldest.size();
        }
      }
      wake_on = acted_on;
      if (everything && in_window) wake_on.push_back(key("nodes/"));
      if (!membership_.own_registration_ok(reads[1])) {
        // Its lease revoked (its link lost): the keep-alive fences and the
        // lease is renewed first.
        if (store.lease_remaining(conn_.lease()) < 0) {
          conn_.keep_alive().renew_now();
          continue;
        }
        membership_.reclaim_node_key(
            fmt::format("{} is gone or is not this agent's", key("nodes/" + self_.id)));
        continue;
      }
      membership_.keep_age_entry();
      std::vector<NodeInfo> alive;
      if (everything && (oldest.empty() || oldest.front().id == self_.id)) {
        // Leading (or no live registration among the oldest keys): all of
        // them; the leader tracks when the membership last changed.
        alive = ranked ? oldest
                       : membership_.live_nodes(store.get_prefix(key("nodes/")), &ignored, true);
        leadership_.track_membership(alive);
        nodes_seen_ = alive.size();
      } else {
        leadership_.not_leading();
      }
      links_.follow(window_read ? oldest : std::vector<NodeInfo>{}, alive);
      std::optional<RoundRecord> round = membership_.read_round(round_kv);
      snapshots_.follow(everything ? &reads[3] : nullptr, round);
      if (!alive.empty() && alive.front().id == self_.id)
        leadership_.lead(alive, round_kv, round, snapshots_.held_anywhere());
      if (round)
        if (auto code = apply(*round)) {
          stop_watch_.arm();
          conn_.linger_as_host();
          stop_watch_.disarm();
          return leave(*code);
        }
    } catch (const StoreGone& e) {
      // The agent that held a c10d or static rendezvous is gone, and the
      // rendezvous with it: as torchrun's agents, these end the job.
      self_.log(
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
        self_.log(fmt::format("{}; {}, giving up after {} ms", e.what(),
                              conn_.workers_during_outage(), o_.store_timeout.count()));
      }
      if (now - *outage_since_ >= o_.store_timeout) {
        self_.log(
            fmt::format("error: {} unreachable for {} ms (last error: {}); stopping the workers",
                        store.describe(), (now - *outage_since_).count(), e.what()));
        return leave(kAgentStoreLost);
      }
    } catch (const Error& e) {
      // Another agent took this node's id while it was away, or this node
      // cannot start its workers (node_workers.hpp).
      self_.log(fmt::format("error: {}", e.what()));
      return leave(2);
    }
  }
}

bool Agent::start_ahead_of_restore(const RoundRecord& round, std::size_t index) {
  // Their imports and model build overlap the wait (running workers
  // pausing, the members' holdings, the copy): they then wait for the
  // folder itself, which finish_pending_restore() links in place.
  if (!workers_.empty() || !policy_ || (o_.stop_signal && o_.stop_signal->load() != 0))
    return false;
  const auto pending = snapshots_.pending_restore(round.round);
  if (pending.empty()) return false;
  workers_.enter_round(round.round, true);
  checkpoints_.enter_round();
  short_since_.reset();
  restore_pending_round_ = round.round;
  restore_pending_index_ = index;
  workers_.start(round, index, *policy_, pending, snapshots_.prepare_bound());
  return true;
}

void Agent::finish_pending_restore(const RoundRecord& round) {
  // A store error leaves it pending: the next pass tries again.
  std::optional<std::filesystem::path> prepared;
  try {
    prepared = snapshots_.prepare_round(round);
  } catch (const RestoreFailed& failed) {
    restore_pending_round_ = 0;
    workers_.end_round(fmt::format("round {}: its snapshot could not be copied here", round.round),
                       o_.stop_grace);
    snapshots_.fail_round(round, failed.message);
    return;
  }
  restore_pending_round_ = 0;
  if (!prepared) {
    // A member left before the restore was agreed (the leader forms the
    // next round without it), or a stop signal came.
    workers_.end_round(fmt::format("round {}: not started: a member left", round.round),
                       o_.stop_grace);
    return;
  }
  if (!prepared->empty()) {
    snapshots_.link_restore(round.round, *prepared);
    self_.log(fmt::format("round {}: the workers started ahead of the restore load it: {}",
                          round.round, prepared->string()));
    return;
  }
  self_.log(fmt::format(
      "round {}: no snapshot in memory to restore; the workers started ahead of it start again "
      "without one",
      round.round));
  workers_.end_round(fmt::format("round {}: started again without a restore", round.round),
                     o_.stop_grace);
  workers_.start(round, restore_pending_index_, *policy_);
}

int run_agent(const AgentOptions& options) {
  Agent agent(options);
  return agent.run();
}

}  // namespace ductile::agent
