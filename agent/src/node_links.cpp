// The links to the leader, their heartbeats, and the revocation of a lost
// node's lease; see node_links.hpp.
#include "node_links.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include "ductile/error.hpp"
#include "listening.hpp"
#include "store_wire.hpp"

namespace ductile::agent {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

constexpr std::string_view kLinkHostLabel = "ductile link host proof v1";
constexpr std::string_view kLinkAgentLabel = "ductile link agent proof v1";
constexpr char kLinkMagic[4] = {'D', 'L', 'K', '1'};
constexpr char kHeartbeat = 'H', kGoodbye = 'B', kDropped = 'D';
constexpr std::size_t kProofBytes = 32;  // HMAC-SHA256
// Revoked leases remembered, so that each loss is reported once.
constexpr std::size_t kMaxRevokedRemembered = 4096;

// Sends all of `bytes` now or fails: a handshake's few bytes fit any
// socket's buffer, and a heartbeat that does not fit is not needed (the
// peer reads nothing: its silence is seen on the other side).
bool send_now(int fd, const std::string& bytes) {
  const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  return n == static_cast<ssize_t>(bytes.size());
}

enum class Read { progress, again, closed };

// Reads up to `want` more bytes onto `in`.
Read read_more(int fd, std::string& in, std::size_t want) {
  char buffer[256];
  const ssize_t n = ::recv(fd, buffer, std::min(want, sizeof buffer), MSG_DONTWAIT);
  if (n > 0) {
    in.append(buffer, static_cast<std::size_t>(n));
    return Read::progress;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Read::again;
  return Read::closed;
}

std::string proof_or_zeros(const std::string& secret, std::string_view label,
                           const std::string& first, const std::string& second) {
  return secret.empty() ? std::string(kProofBytes, '\0')
                        : wire::proof(secret, label, first, second);
}

std::string seconds_text(Clock::duration d) {
  return fmt::format("{:.1f}", std::chrono::duration<double>(d).count());
}

}  // namespace

struct NodeLinks::Peer {
  enum class Stage { connecting, hello, answer, proof, linked };
  int fd = -1;
  Stage stage = Stage::hello;
  std::string in;     // the handshake's bytes read so far
  std::string nonce;  // this side's
  Clock::time_point opened, heard;
  std::uint64_t order = 0;  // accepted as the order-th
  std::string id;           // the node at the other end, once linked (or the leader's)
  std::int64_t lease = 0;
  bool asked = false;        // the judge's silence made the keep-alive confirm the lease
  bool said_silent = false;  // its silence is logged
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

void NodeLinks::serve() {
  if (o_.rendezvous == RendezvousKind::embedded) return;  // one node: no one to link with
  try {
    listeners_ = listen_on(self_.addr, 0);
  } catch (const std::system_error& e) {
    throw Error(ErrorKind::io, fmt::format("cannot listen for the links of the job's agents on "
                                           "{}: {}",
                                           self_.addr, e.code().message()));
  }
  port_ = bound_port(listeners_.front());
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0)
    throw Error(ErrorKind::io, fmt::format("cannot make a pipe: {}", std::strerror(errno)));
  links_ = std::thread([this] { run(); });
  revoker_ = std::thread([this] { revoke(); });
}

void NodeLinks::follow(const std::vector<NodeInfo>& oldest, const std::vector<NodeInfo>& alive) {
  if (!links_.joinable()) return;
  const bool leading = !alive.empty() && alive.front().id == self_.id;
  std::map<std::string, std::int64_t> members;
  if (leading)
    for (const auto& n : alive)
      if (n.id != self_.id) members[n.id] = n.lease;
  const std::int64_t own = conn_.lease();
  Leader target;
  bool retarget = false;
  {
    std::lock_guard lock(mutex_);
    members_ = std::move(members);
    judge_ = leading && alive.size() > 1 ? alive[1].id : std::string();
    own_lease_ = own;
    keep_alive_ = conn_.keep_alive_handle();
    if (leading || (!oldest.empty() && oldest.front().id == self_.id)) {
      retarget = !leader_.id.empty();
    } else if (!oldest.empty()) {
      const NodeInfo& first = oldest.front();
      leader_.next = oldest.size() > 1 && oldest[1].id == self_.id;
      retarget = first.id != leader_seen_ || own != leader_.own_lease ||
                 (first.lease != 0 && first.lease != leader_.lease);
    }
  }
  if (!retarget) return;
  if (!leading && !oldest.empty() && oldest.front().id != self_.id) {
    // The leader's address and link port, from its registration when the
    // pass read its key only.
    NodeInfo first = oldest.front();
    if (first.addr.empty() || first.lease == 0) {
      auto kv = conn_.store().get(self_.key("nodes/" + first.id));
      if (kv) {
        try {
          first = node_from_json(kv->value, first.id, kv->create_revision);
          first.lease = kv->lease;
        } catch (const MalformedRecord&) {
          first.link_port = 0;  // the leader's own pass deals with its record
        }
      } else {
        first.link_port = 0;
      }
    }
    target.id = first.id;
    target.lease = first.lease;
    target.next = oldest.size() > 1 && oldest[1].id == self_.id;
    // The leader's address resolved here, on the agent's thread: a slow
    // resolver never holds up a heartbeat.
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* found = nullptr;
    if (first.link_port > 0 && !first.addr.empty() &&
        ::getaddrinfo(first.addr.c_str(), std::to_string(first.link_port).c_str(), &hints,
                      &found) == 0 &&
        found) {
      std::memcpy(&target.addr, found->ai_addr, found->ai_addrlen);
      target.addr_len = found->ai_addrlen;
    }
    if (found) ::freeaddrinfo(found);
  }
  {
    std::lock_guard lock(mutex_);
    target.own_lease = own;
    target.generation = leader_.generation + 1;
    leader_seen_ = oldest.empty() ? std::string() : oldest.front().id;
    if (leading) leader_seen_ = self_.id;
    leader_ = target;
  }
  [[maybe_unused]] auto n = ::write(wake_[1], "w", 1);
}

void NodeLinks::close() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && !links_.joinable()) return;
    stopping_ = true;
  }
  revocations_ready_.notify_all();
  if (wake_[1] >= 0) {
    [[maybe_unused]] auto n = ::write(wake_[1], "s", 1);
  }
  if (links_.joinable()) links_.join();
  if (revoker_.joinable()) revoker_.join();
  close_all(listeners_);
  for (int& fd : wake_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
}

void NodeLinks::lost(const std::string& id, std::int64_t lease, const std::string& why,
                     bool leader) {
  std::lock_guard lock(mutex_);
  if (lease == 0 || revoked_.count(lease) != 0) return;
  if (!leader) {
    // Only a live registration's node, with the lease its link named.
    auto it = members_.find(id);
    if (it == members_.end() || it->second != lease) return;
  }
  if (revoked_.size() >= kMaxRevokedRemembered) revoked_.clear();
  revoked_.insert(lease);
  revocations_.push_back(Revocation{id, lease, why});
  revocations_ready_.notify_all();
}

void NodeLinks::revoke() {
  std::unique_ptr<KeyValueStore> store;
  std::unique_lock lock(mutex_);
  for (;;) {
    revocations_ready_.wait(lock, [this] { return stopping_ || !revocations_.empty(); });
    if (stopping_) return;  // leaving: the others' leases are theirs to keep
    Revocation r = std::move(revocations_.front());
    revocations_.pop_front();
    const std::int64_t own = own_lease_;
    lock.unlock();
    try {
      if (!store) store = conn_.store_factory()(o_.request_timeout);
      if (!store->keep_alive(own)) {
        // This node is the one cut off (its own lease is gone): the
        // other is not its to judge.
        self_.log(fmt::format(
            "node {} {}but this node's own lease is gone: its lease is left alone", r.id, r.why));
      } else {
        store->revoke_lease(r.lease);
        self_.log(fmt::format("node {} {}its lease revoked", r.id, r.why));
      }
    } catch (const StoreError& e) {
      self_.log(fmt::format(
          "node {} {}revoking its lease failed ({}); its registration goes when the lease "
          "expires (--lease-ttl {} s)",
          r.id, r.why, e.what(), o_.lease_ttl.count()));
    }
    lock.lock();
  }
}

void NodeLinks::run() {
  const milliseconds timeout = o_.heartbeat;
  const milliseconds period = std::max(timeout / 4, milliseconds(10));
  // The longest this loop sleeps; it wakes sooner for a beat to send or a
  // silence to act on (each at its time, to the millisecond).
  const milliseconds turn = std::clamp<milliseconds>(period, milliseconds(10), milliseconds(250));
  // How long a node whose judge fell silent gives the store to renew its
  // lease before it fences (KeepAlive::confirm_within).
  const milliseconds confirm = period;
  // A silent node may be alive on the other side of a cut: its lease is
  // revoked only once its own fence has surely stopped its workers, so
  // that two rounds never train at once. That fence is the first of two:
  // its judge's link silent for `timeout` and no renewal within `confirm`;
  // or 3/4 of the TTL after its last renewal. Either counts from the
  // node's last byte heard here, which came at most a period before the
  // cut; plus a margin.
  const milliseconds fenced_by = std::max(
      timeout, period + milliseconds(100) +
                   std::min(timeout + confirm,
                            std::chrono::duration_cast<milliseconds>(o_.lease_ttl) * 3 / 4));
  const std::string& secret = conn_.snapshot_auth().secret;
  const std::string heartbeat_text =
      fmt::format("{:g}", std::chrono::duration<double>(timeout).count());
  std::map<int, Peer> peers;  // links from the other agents, by socket
  Peer up;                    // this agent's link to the leader
  std::uint64_t up_generation = 0;
  std::string refused_by;  // the leader whose refusal was said (once each)
  Clock::time_point retry_at{}, last_turn = Clock::now(), last_beat = Clock::now();
  std::uint64_t accepted = 0;
  // Out of descriptors, accepting pauses (the listeners are not polled)
  // rather than spinning on a connection it cannot take.
  Clock::time_point accept_after{};

  auto retry_later = [&] {
    up.close();
    retry_at = Clock::now() + period;
  };
  auto say_goodbye = [&](Peer& peer) {
    if (peer.stage == Peer::Stage::linked) send_now(peer.fd, std::string(1, kGoodbye));
    peer.close();
  };

  for (;;) {
    Leader leader;
    bool stopping = false;
    std::weak_ptr<KeepAlive> keep_alive;
    std::string judge;  // leading: the next oldest, which judges this agent
    {
      std::lock_guard lock(mutex_);
      leader = leader_;
      stopping = stopping_;
      keep_alive = keep_alive_;
      judge = judge_;
    }
    // The keep-alive as follow() last saw it: none before the agent's loop,
    // none once the connection closed.
    auto check_lease = [&] {
      if (auto running = keep_alive.lock()) running->renew_now();
    };
    // The judge's link fell silent: this node may be the one cut off.
    auto confirm_lease = [&](const std::string& why) {
      if (auto running = keep_alive.lock()) running->confirm_within(confirm, why);
    };
    auto judge_heard = [&] {
      if (auto running = keep_alive.lock()) running->judge_heard();
    };
    auto now = Clock::now();
    if (stopping) {
      leader_linked_.store(false, std::memory_order_relaxed);
      say_goodbye(up);
      for (auto& [fd, peer] : peers) say_goodbye(peer);
      return;
    }
    // This process was stopped or starved (SIGSTOP, a loaded machine): the
    // silence it saw is its own, and every link gets a fresh timeout.
    if (now - last_turn > timeout / 2) {
      up.heard = now;
      for (auto& [fd, peer] : peers) peer.heard = now;
    }
    last_turn = now;

    if (leader.generation != up_generation) {
      say_goodbye(up);
      up = Peer{};
      up_generation = leader.generation;
      retry_at = now;
    }
    if (up.fd < 0 && !leader.id.empty() && leader.addr_len > 0 && now >= retry_at) {
      up = Peer{};
      up.id = leader.id;
      up.lease = leader.lease;
      up.opened = now;
      up.fd = ::socket(leader.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (up.fd >= 0 && (::connect(up.fd, reinterpret_cast<const sockaddr*>(&leader.addr),
                                   leader.addr_len) == 0 ||
                         errno == EINPROGRESS))
        up.stage = Peer::Stage::connecting;
      else
        retry_later();
    }

    if (now - last_beat >= period) {
      last_beat = now;
      const std::string beat(1, kHeartbeat);
      if (up.fd >= 0 && up.stage == Peer::Stage::linked) send_now(up.fd, beat);
      for (auto& [fd, peer] : peers)
        if (peer.stage == Peer::Stage::linked) send_now(fd, beat);
    }

    // Silence, and handshakes past their time.
    for (auto it = peers.begin(); it != peers.end();) {
      Peer& peer = it->second;
      const bool linked = peer.stage == Peer::Stage::linked;
      if (linked && peer.id == judge && !peer.asked && now - peer.heard > timeout) {
        peer.asked = true;
        confirm_lease(
            fmt::format("the link from node {}, next in line to lead, fell silent", peer.id));
      }
      if (linked && now - peer.heard > timeout && !peer.said_silent) {
        peer.said_silent = true;
        self_.log(fmt::format(
            "node {} silent for {} s (--heartbeat {} s): its lease is revoked once its fence has "
            "stopped its workers ({:g} s after the last byte heard)",
            peer.id, seconds_text(now - peer.heard), heartbeat_text,
            std::chrono::duration<double>(fenced_by).count()));
      }
      if (linked && now - peer.heard > fenced_by) {
        send_now(peer.fd, std::string(1, kDropped));
        lost(peer.id, peer.lease,
             fmt::format("silent for {} s (--heartbeat {} s): ", seconds_text(now - peer.heard),
                         heartbeat_text),
             false);
      } else if (linked || now - peer.opened <= wire::kProofTimeout) {
        ++it;
        continue;
      }
      peer.close();
      it = peers.erase(it);
    }
    if (up.fd >= 0) {
      if (up.stage == Peer::Stage::linked && !up.asked && now - up.heard > timeout) {
        // The leader judges this node, and the next oldest the leader:
        // this node may be the one cut off. Its lease is checked now, not
        // at the next renewal; a lease gone fences at once, and one not
        // renewed within `confirm` fences too.
        up.asked = true;
        confirm_lease(fmt::format("the link to the leader, node {}, fell silent", up.id));
      }
      if (up.stage == Peer::Stage::linked && leader.next && now - up.heard > fenced_by) {
        send_now(up.fd, std::string(1, kDropped));
        lost(up.id, up.lease,
             fmt::format("silent for {} s (--heartbeat {} s): ", seconds_text(now - up.heard),
                         heartbeat_text),
             true);
        retry_later();
      } else if (up.stage != Peer::Stage::linked && now - up.opened > wire::kProofTimeout) {
        retry_later();
      }
    }

    leader_linked_.store(up.fd >= 0 && up.stage == Peer::Stage::linked && now - up.heard <= timeout,
                         std::memory_order_relaxed);
    std::vector<pollfd> fds;
    fds.push_back({wake_[0], POLLIN, 0});
    for (int fd : listeners_) fds.push_back({now >= accept_after ? fd : -1, POLLIN, 0});
    for (auto& [fd, peer] : peers) fds.push_back({fd, POLLIN, 0});
    if (up.fd >= 0)
      fds.push_back(
          {up.fd, static_cast<short>(up.stage == Peer::Stage::connecting ? POLLOUT : POLLIN), 0});
    // Asleep until the next beat or silence to act on, or a turn.
    Clock::time_point soonest = last_beat + period;
    auto by = [&](Clock::time_point at) { soonest = std::min(soonest, at); };
    for (const auto& [fd, peer] : peers) {
      if (peer.stage != Peer::Stage::linked) continue;
      if (!peer.said_silent || (peer.id == judge && !peer.asked)) by(peer.heard + timeout);
      by(peer.heard + fenced_by);
    }
    if (up.fd >= 0 && up.stage == Peer::Stage::linked) {
      if (!up.asked) by(up.heard + timeout);
      if (leader.next) by(up.heard + fenced_by);
    }
    const auto wait = std::clamp<milliseconds>(
        std::chrono::duration_cast<milliseconds>(soonest - now) + milliseconds(1), milliseconds(1),
        turn);
    if (::poll(fds.data(), fds.size(), static_cast<int>(wait.count())) < 0 && errno != EINTR)
      std::this_thread::sleep_for(wait);
    now = Clock::now();
    if (fds[0].revents != 0) {
      char drain[64];
      while (::read(wake_[0], drain, sizeof drain) > 0) {
      }
    }

    // New connections: each kept while there is room; past
    // kMaxUnprovenLinks in their handshake, the oldest of those is cut.
    for (std::size_t i = 0; i < listeners_.size(); ++i) {
      if (fds[1 + i].revents == 0) continue;
      for (int taken = 0; taken < 64; ++taken) {
        int fd = ::accept4(listeners_[i], nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && (errno == EMFILE || errno == ENFILE))
          accept_after = Clock::now() + milliseconds(250);
        if (fd < 0) break;
        if (peers.size() >= kMaxLinks + kMaxUnprovenLinks) {
          ::close(fd);
          continue;
        }
        std::size_t unproven = 0;
        auto oldest = peers.end();
        for (auto it = peers.begin(); it != peers.end(); ++it)
          if (it->second.stage != Peer::Stage::linked) {
            ++unproven;
            if (oldest == peers.end() || it->second.order < oldest->second.order) oldest = it;
          }
        if (unproven >= kMaxUnprovenLinks && oldest != peers.end()) {
          oldest->second.close();
          peers.erase(oldest);
        }
        Peer& peer = peers[fd];
        peer.fd = fd;
        peer.stage = Peer::Stage::hello;
        peer.opened = peer.heard = now;
        peer.order = ++accepted;
      }
    }

    // The links of the other agents (this agent leads, or is about to).
    std::vector<int> ended;
    for (std::size_t i = 1 + listeners_.size(); i < fds.size(); ++i) {
      if (fds[i].revents == 0 || fds[i].fd == up.fd) continue;
      auto it = peers.find(fds[i].fd);
      if (it == peers.end()) continue;
      Peer& peer = it->second;
      bool end = false;
      if (peer.stage == Peer::Stage::hello) {
        const std::size_t want = sizeof kLinkMagic + wire::kNonceBytes;
        Read r = read_more(peer.fd, peer.in, want - peer.in.size());
        end = r == Read::closed;
        if (!end && peer.in.size() == want) {
          const std::string theirs = peer.in.substr(sizeof kLinkMagic);
          end = peer.in.compare(0, sizeof kLinkMagic, kLinkMagic, sizeof kLinkMagic) != 0;
          if (!end) {
            peer.nonce = wire::random_nonce();
            std::string answer(1, secret.empty() ? '\0' : '\1');
            answer += peer.nonce;
            answer += proof_or_zeros(secret, kLinkHostLabel, theirs, peer.nonce);
            end = !send_now(peer.fd, answer);
            peer.in = theirs;  // kept for the proof's check
            peer.stage = Peer::Stage::proof;
          }
        }
      } else if (peer.stage == Peer::Stage::proof) {
        // The agent's nonce, then its flag, proof, id length, id and lease.
        const std::size_t head = wire::kNonceBytes + 1 + kProofBytes + 1;
        std::size_t want = head;
        if (peer.in.size() >= head) want = head + static_cast<unsigned char>(peer.in[head - 1]) + 8;
        Read r = read_more(peer.fd, peer.in, want - peer.in.size());
        end = r == Read::closed;
        if (!end && peer.in.size() >= head) {
          const std::size_t id_chars = static_cast<unsigned char>(peer.in[head - 1]);
          end = id_chars == 0 || id_chars > kMaxNodeIdChars;
          if (!end && peer.in.size() == head + id_chars + 8) {
            const std::string theirs = peer.in.substr(0, wire::kNonceBytes);
            const bool flagged = peer.in[wire::kNonceBytes] != '\0';
            const std::string given = peer.in.substr(wire::kNonceBytes + 1, kProofBytes);
            const std::string id = peer.in.substr(head, id_chars);
            std::int64_t lease = 0;
            std::memcpy(&lease, peer.in.data() + head + id_chars, sizeof lease);
            end = flagged != !secret.empty() ||
                  (!secret.empty() && !wire::same_proof(given, wire::proof(secret, kLinkAgentLabel,
                                                                           peer.nonce, theirs))) ||
                  !valid_node_id(id) || lease <= 0;
            if (!end) {
              // A node that links again says goodbye on its earlier link;
              // a link that names a node's id with another lease may
              // close as it likes (lost() acts on the lease of a live
              // registration only).
              peer.id = id;
              peer.lease = lease;
              peer.in.clear();
              peer.heard = now;
              peer.stage = Peer::Stage::linked;
            }
          }
        }
      } else {
        std::string got;
        Read r = read_more(peer.fd, got, 64);
        if (r == Read::closed) {
          lost(peer.id, peer.lease, "lost: its link closed; ", false);
          end = true;
        }
        for (char c : got) {
          if (c == kHeartbeat) {
            peer.heard = now;
            if (peer.asked) judge_heard();
            peer.asked = false;
          } else if (c == kDropped) {
            // The next oldest found this agent silent and revoked its
            // lease: the keep-alive finds out at once and fences.
            check_lease();
            end = true;
            break;
          } else {
            end = true;  // goodbye, or a byte that is no part of a link
            break;
          }
        }
      }
      if (end) ended.push_back(peer.fd);
    }
    for (int fd : ended) {
      auto it = peers.find(fd);
      if (it == peers.end()) continue;
      it->second.close();
      peers.erase(it);
    }

    // This agent's link to the leader.
    const pollfd* mine = nullptr;
    for (const auto& p : fds)
      if (up.fd >= 0 && p.fd == up.fd) mine = &p;
    if (!mine || mine->revents == 0) continue;
    if (up.stage == Peer::Stage::connecting) {
      int error = 0;
      socklen_t len = sizeof error;
      if (::getsockopt(up.fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0 || error != 0) {
        retry_later();  // not there (yet): quietly tried again
        continue;
      }
      up.nonce = wire::random_nonce();
      if (!send_now(up.fd, std::string(kLinkMagic, sizeof kLinkMagic) + up.nonce)) {
        retry_later();
        continue;
      }
      up.stage = Peer::Stage::answer;
    } else if (up.stage == Peer::Stage::answer) {
      const std::size_t want = 1 + wire::kNonceBytes + kProofBytes;
      if (read_more(up.fd, up.in, want - up.in.size()) == Read::closed) {
        retry_later();
        continue;
      }
      if (up.in.size() < want) continue;
      const bool flagged = up.in[0] != '\0';
      const std::string theirs = up.in.substr(1, wire::kNonceBytes);
      const std::string given = up.in.substr(1 + wire::kNonceBytes, kProofBytes);
      std::string problem;
      if (flagged != !secret.empty())
        problem = flagged ? "the leader has the job's secret, this agent none"
                          : "this agent has a secret, the leader none";
      else if (!secret.empty() &&
               !wire::same_proof(given, wire::proof(secret, kLinkHostLabel, up.nonce, theirs)))
        problem = "the secrets differ";
      if (!problem.empty()) {
        if (refused_by != up.id)
          self_.log(fmt::format(
              "cannot link to the leader, node {}: {} (give every agent of the job the same "
              "DUCTILE_RDZV_SECRET or DUCTILE_RDZV_SECRET_FILE); its loss is known when its "
              "lease expires",
              up.id, problem));
        refused_by = up.id;
        retry_at = Clock::now() + timeout * 10;
        up.close();
        continue;
      }
      std::string hello(1, secret.empty() ? '\0' : '\1');
      hello += proof_or_zeros(secret, kLinkAgentLabel, theirs, up.nonce);
      hello += static_cast<char>(self_.id.size());
      hello += self_.id;
      hello.append(reinterpret_cast<const char*>(&leader.own_lease), sizeof leader.own_lease);
      if (!send_now(up.fd, hello)) {
        retry_later();
        continue;
      }
      up.in.clear();
      up.heard = now;
      up.stage = Peer::Stage::linked;
    } else {
      std::string got;
      Read r = read_more(up.fd, got, 64);
      bool end = r == Read::closed;
      if (end && leader.next) lost(up.id, up.lease, "lost: its link closed; ", true);
      for (char c : got) {
        if (c == kHeartbeat) {
          up.heard = now;
          if (up.asked) judge_heard();
          up.asked = false;
          continue;
        }
        if (c == kDropped) {
          self_.log(fmt::format(
              "the leader, node {}, found this node silent for longer than --heartbeat {} s and "
              "dropped its link (its lease revoked)",
              up.id, heartbeat_text));
          check_lease();
        }
        end = true;  // goodbye, dropped, or a byte that is no part of a link
        break;
      }
      if (end) retry_later();
    }
  }
}

}  // namespace ductile::agent
