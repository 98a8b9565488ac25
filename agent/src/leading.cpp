// The leader's pass: it reads the members' done, saved and draining marks
// and the failure and checkpoint records of the round, asks the policy
// (rendezvous.hpp) what to do, and writes the next round, with the place
// of its workers' store. See leadership.hpp.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <system_error>

#include <fmt/format.h>

#include "ductile/error.hpp"

#include "leadership.hpp"

namespace ductile::agent {

namespace {

// The machine's limits, not a bug: `what` failed (and says how) because
// this process ran out of file descriptors.
Error out_of_descriptors(const std::string& what) {
  struct rlimit files {};
  getrlimit(RLIMIT_NOFILE, &files);
  return Error(ErrorKind::io,
               fmt::format("{}; this process ran out of file descriptors (open files limit, "
                           "ulimit -n: {}): raise the limit",
                           what,
                           files.rlim_cur == RLIM_INFINITY ? std::string("unlimited")
                                                           : std::to_string(files.rlim_cur)));
}

// The port `port` (0: any) when it can be bound now, else 0.
int bindable_port(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 && (errno == EMFILE || errno == ENFILE))
    throw out_of_descriptors(fmt::format(
        "cannot look for a free TCP port for MASTER_PORT: socket: {}", std::strerror(errno)));
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  socklen_t len = sizeof addr;
  int got = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0
                ? ntohs(addr.sin_port)
                : 0;
  close(fd);
  return got;
}

// A TCP port nobody holds now, other than `avoid` (the last round's). Taken
// below the kernel's ephemeral range when it can be: the workers bind it
// some time after the leader chose it, and meanwhile sockets bound to port
// 0 (MPI's daemons, a gloo store's clients) are never given such a port.
int free_port(int avoid) {
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  static std::mt19937 random(std::random_device{}());
  for (int attempt = 0; attempt < 200 && low > 10001; ++attempt) {
    int port = bindable_port(std::uniform_int_distribution<int>(10000, low - 1)(random));
    if (port != 0 && port != avoid) return port;
  }
  for (int attempt = 0; attempt < 16; ++attempt)
    if (int port = bindable_port(0); port != 0 && port != avoid) return port;
  throw std::runtime_error("cannot find a free TCP port for MASTER_PORT");
}

}  // namespace

void Leadership::serve_fixed_worker_store() {
  try {
    worker_store_ = std::make_unique<StoreServer>(o_.master_addr, o_.master_port, nullptr);
  } catch (const std::system_error& e) {
    throw Error(ErrorKind::invalid_argument,
                fmt::format("--master-port {} cannot be served on this host: {}; is another "
                            "job (or torchrun) using it? give another --master-port",
                            o_.master_port, e.code().message()));
  }
}

void Leadership::start_mpi_server() {
  if (o_.mpi_world) mpi_server_ = std::make_unique<OmpiServer>();
}

void Leadership::drop_stale_worker_store(const RoundRecord& round) {
  if (worker_store_ && o_.master_port == 0 &&
      (round.master_addr != self_.addr || round.master_port != worker_store_->port()))
    worker_store_.reset();
}

void Leadership::track_membership(const std::vector<NodeInfo>& alive) {
  std::vector<std::string> ids;
  for (const auto& n : alive) ids.push_back(n.id);
  if (ids != last_alive_) {
    last_alive_ = ids;
    last_membership_change_ = now_ms();
  }
}

std::vector<std::string> Leadership::marked(const std::string& what, const RoundRecord* round,
                                            const std::vector<NodeInfo>& alive,
                                            const char* if_ignored) {
  const std::string r = round ? std::to_string(round->round) : "";
  const std::string prefix = self_.key(what + "/" + (round ? r + "/" : ""));
  std::vector<std::string> out;
  for (const auto& kv : conn_.store().get_prefix(prefix)) {
    const std::string node = kv.key.substr(prefix.size());
    auto it =
        std::find_if(alive.begin(), alive.end(), [&](const NodeInfo& n) { return n.id == node; });
    try {
      check_mark(what.c_str(), kv.value, node, round ? round->round : 0);
      if (round &&
          std::find(round->members.begin(), round->members.end(), node) == round->members.end())
        throw MalformedRecord(
            fmt::format("{} record: {} is not a member of round {}", what, excerpt(node, 80), r));
      // A node's mark is on its registration's lease (a key that etcdctl
      // or another client wrote is not; see "Untrusted contents").
      if (it == alive.end() || kv.lease == 0 || kv.lease != it->lease)
        throw MalformedRecord(fmt::format(
            "{} record: it is not on the lease of node {}'s registration", what, excerpt(node)));
      out.push_back(node);
    } catch (const MalformedRecord& e) {
      conn_.ignore_record(kv, e.what(), if_ignored);
    }
  }
  return out;
}

void Leadership::place_worker_store(RoundRecord& next, const NodeInfo& rank0,
                                    std::unique_ptr<StoreServer>& server) {
  if (!o_.agent_store) {
    // Rank 0's worker creates the store there (torchrun's etcd rendezvous).
    next.master_addr = rank0.addr;
    next.master_port = free_port(last_port_);
    last_port_ = next.master_port;
    return;
  }
  if (o_.master_port != 0) {
    // Static: the store at the address and port asked, the same every
    // round, emptied for the new round's workers.
    next.master_addr = o_.master_addr;
    next.master_port = o_.master_port;
    StoreServer* fixed =
        conn_.rendezvous_server() ? conn_.rendezvous_server() : worker_store_.get();
    if (fixed) fixed->reset_worker_store();
    return;
  }
  // A new store each round, on this leader's host: bound before it is
  // published, so no other process can take its port meanwhile.
  try {
    server = std::make_unique<StoreServer>(rank0.addr, 0, nullptr);
  } catch (const std::system_error& e) {
    if (e.code().value() != EMFILE && e.code().value() != ENFILE) throw;
    // The round is not formed, and the agent stops as when it cannot start
    // its workers.
    throw out_of_descriptors(
        fmt::format("round {} cannot form: the workers' store cannot be served on {}: {}",
                    next.round, rank0.addr, e.what()));
  }
  next.master_addr = rank0.addr;
  next.master_port = server->port();
}

void Leadership::lead(const std::vector<NodeInfo>& alive, std::optional<KeyValue>& round_kv,
                      std::optional<RoundRecord>& round, bool snapshots_held) {
  // The record holds a previous run's last round: this run's first round
  // replaces it.
  const bool previous =
      round_kv && !round && membership_.previous_run_revision() == round_kv->mod_revision;
  if (round_kv && !round && !previous && membership_.last_good_round()) {
    // A record no agent wrote: put back the last valid one (the workers of
    // every member go on in their round).
    if (conn_.store().compare_and_swap(self_.key("round"), round_kv->mod_revision,
                                       to_json(*membership_.last_good_round()))) {
      self_.log(fmt::format("leader: restored round {} in {}", membership_.last_good_round()->round,
                            self_.key("round")));
      round_kv = conn_.store().get(self_.key("round"));
      round = membership_.read_round(round_kv);
    }
    return;
  }
  Observation seen;
  seen.now = now_ms();
  seen.alive = alive;
  seen.last_membership_change = last_membership_change_;
  seen.round = round;
  if (seen.round && !seen.round->members.empty()) {
    std::string r = std::to_string(seen.round->round);
    if (auto f = conn_.store().get(self_.key("failure/" + r))) {
      try {
        seen.failure = failure_from_json(f->value);
        auto [it, inserted] = failure_seen_.try_emplace(seen.round->round, seen.now);
        seen.failure_seen = it->second;
      } catch (const MalformedRecord& e) {
        conn_.ignore_record(*f, e.what(), "not counted as a failure");
      }
    }
    auto done = marked("done", &*seen.round, alive);
    seen.all_done = std::all_of(seen.round->members.begin(), seen.round->members.end(),
                                [&](const std::string& id) {
                                  return std::find(done.begin(), done.end(), id) != done.end();
                                });
  }
  seen.draining = marked("draining", nullptr, alive, "the node is not draining");
  if (settings_.checkpoint_timeout.count() > 0 && seen.round && !seen.round->members.empty()) {
    std::string r = std::to_string(seen.round->round);
    if (auto c = conn_.store().get(self_.key("checkpoint/" + r))) {
      try {
        seen.checkpoint = checkpoint_from_json(c->value, seen.round->round);
      } catch (const MalformedRecord& e) {
        conn_.ignore_record(*c, e.what(), "no checkpoint asked");
      }
    }
    seen.saved = marked("saved", &*seen.round, alive);
  }
  Decision d = decide(seen, settings_);
  if (d.action == Action::keep) return;
  if (d.action == Action::request_checkpoint) {
    CheckpointRequest request{seen.round->round, self_.id, excerpt(d.reason, kMaxTextChars - 3),
                              seen.now.count()};
    if (conn_.store().compare_and_swap(self_.key("checkpoint/" + std::to_string(seen.round->round)),
                                       0, to_json(request), conn_.lease()))
      self_.log(fmt::format(
          "leader: asked the workers of round {} to checkpoint before re-forming ({}); waiting "
          "up to {} ms",
          seen.round->round, d.reason, settings_.checkpoint_timeout.count()));
    return;
  }
  RoundRecord next = seen.round.value_or(RoundRecord{});
  std::unique_ptr<StoreServer> next_store;  // the new round's workers' store, when new
  if (d.action == Action::new_round) {
    next.round = std::max(next.round, membership_.highest_round()) + 1;
    next.members.clear();
    next.member_revisions.clear();
    for (const auto& n : d.members) {
      next.members.push_back(n.id);
      next.member_revisions.push_back(n.create_revision);
    }
    next.world_size = static_cast<std::int64_t>(d.members.size()) * o_.nproc_per_node;
    next.master_addr.clear();
    next.master_port = 0;
    if (!d.members.empty()) place_worker_store(next, d.members.front(), next_store);
    bool mpi = mpi_server_ && !d.members.empty();
    next.mpi_server_uri = mpi ? mpi_server_->uri() : std::string();
    next.mpi_join_port = mpi ? free_port(next.master_port) : 0;
    if (d.counts_as_restart) next.restarts += 1;
    next.started_ms = seen.now.count();
    next.snapshots_held = snapshots_held;
    next.state = RoundState::running;
    next.failure.reset();
  } else if (d.action == Action::succeed) {
    next.state = RoundState::succeeded;
  } else {
    next.state = RoundState::failed;
    next.failure = seen.failure;
  }
  next.reason = excerpt(d.reason, kMaxTextChars - 3);  // what every reader accepts
  std::string text = to_json(next);
  if (previous) membership_.clear_previous_run();
  if (conn_.store().compare_and_swap(self_.key("round"), round_kv ? round_kv->mod_revision : 0,
                                     text)) {
    if (next_store) worker_store_ = std::move(next_store);  // the old round's goes
    if (d.action == Action::new_round)
      self_.log(fmt::format("leader: round {} formed: {}", next.round, d.reason));
    else
      self_.log(fmt::format("leader: job {}: {}", to_string(next.state), d.reason));
    round_kv = conn_.store().get(self_.key("round"));
    round = membership_.read_round(round_kv);
  }
}

}  // namespace ductile::agent
