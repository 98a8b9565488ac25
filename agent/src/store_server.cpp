// The store an agent serves (see store_server.hpp): one thread, one poll
// loop, the connections and their buffers. A connection's first byte tells
// its protocol: torch's TCPStore protocol, served by the workers' store
// (torch_store.cpp), or the agents' (store_protocol.cpp). The listening
// sockets: listening.cpp.
//
// Against a client that does not play by them, what the server holds is
// bounded: each message, each connection's unread answers, all buffers
// together, a partial message's silence, an agent's time to prove the
// secret; running out of descriptors pauses accepting instead of spinning.
#include "ductile/agent/store_server.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "listening.hpp"
#include "store_wire.hpp"
#include "torch_store.hpp"

namespace ductile::agent {

using namespace wire;

namespace {

// While the process is out of descriptors, accepting fails at once: the
// listening sockets rest this long (the connections are served
// meanwhile) rather than wake the loop again and again.
constexpr std::chrono::milliseconds kAcceptPause{250};
// While a WAIT is pending its client sends nothing but CANCEL_WAIT: past
// this much input the connection is no longer read (the kernel's buffers
// then hold the client back, as torch's own server does).
constexpr std::size_t kInputWhileWaiting = 64 * 1024;
// A connection's buffer keeps at most this much room it does not use: the
// room a large message took goes back once the message is served (the
// bound of all buffers counts the bytes held, not the room).
constexpr std::size_t kIdleRoom = 1u << 20;

using Clock = std::chrono::steady_clock;

}  // namespace

struct StoreServer::Impl final : TorchClients {
  enum class Kind { unknown, torch, agent };
  struct Connection {
    int fd = -1;
    Kind kind = Kind::unknown;
    std::string in, out;
    TorchClient torch;  // a torch client's: validated, its waits
    Clock::time_point last_input = Clock::now();
    bool closing = false;
    // An agent's: its proof of the secret, then its requests; closed when
    // not admitted by `admit_by`.
    std::unique_ptr<AgentPeer> peer;
    Clock::time_point admit_by;
  };

  explicit Impl(const StoreLimits& limits) : limits(limits), workers(limits, *this) {}

  std::shared_ptr<MemoryStore> rendezvous;
  std::string agents_secret;
  const StoreLimits limits;
  std::vector<int> listen_fds;
  int wake_fd = -1, port = 0;
  std::thread thread;
  std::mutex mutex;  // guards the requests below
  std::condition_variable done;
  bool stop = false;
  std::uint64_t resets_asked = 0, resets_done = 0;

  std::map<std::uint64_t, Connection> connections;
  std::uint64_t next_id = 1;
  std::size_t buffered = 0;  // bytes of every connection's `in` and `out`
  Clock::time_point accept_paused_until{};
  TorchStore workers;  // the workers' store

  void wake() {
    std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake_fd, &one, sizeof one);
  }

  TorchClient* find(std::uint64_t id) override {
    auto c = connections.find(id);
    return c == connections.end() ? nullptr : &c->second.torch;
  }

  void answer(std::uint64_t id, const std::string& bytes) override {
    if (auto c = connections.find(id); c != connections.end()) queue_out(c->second, bytes);
  }

  // One torch command from the front of c.in: the bytes it took, or 0 when
  // the buffer holds only part of it.
  std::size_t torch_command(std::uint64_t id, Connection& c) {
    std::string reply;
    const std::size_t used = workers.command(id, c.torch, c.in, reply);
    if (used != 0) queue_out(c, reply);
    return used;
  }

  void queue_out(Connection& c, const std::string& bytes) {
    if (c.closing || bytes.empty()) return;
    if (c.out.size() + bytes.size() > kMaxUnread) {
      // A client that sends and never reads its answers is dropped.
      drop(c);
      return;
    }
    // The bound of all buffers is kept by the loop, between requests.
    c.out += bytes;
    buffered += bytes.size();
  }

  // Closes `c` (at the end of the loop's turn) and lets its buffers go now.
  void drop(Connection& c) {
    c.closing = true;
    buffered -= c.in.size() + c.out.size();
    std::string().swap(c.in);
    std::string().swap(c.out);
  }

  // Over the bound of all buffers: the connection holding the most goes
  // (a client sending one large message is not cut for another's).
  void keep_within_buffer_limit() {
    while (buffered > limits.max_buffered_bytes) {
      Connection* largest = nullptr;
      for (auto& [id, c] : connections)
        if (!c.closing &&
            (!largest || c.in.size() + c.out.size() > largest->in.size() + largest->out.size()))
          largest = &c;
      if (!largest) return;
      drop(*largest);
    }
  }

  // One frame of the agents' protocol: the bytes it took, or 0.
  std::size_t agent_frame(Connection& c) {
    Cursor in(c.in);
    std::uint32_t size = 0;
    if (!in.value(size)) return 0;
    if (size > kMaxFrame) throw BadMessage("a frame over the limit");
    if (in.left() < size) return 0;
    bool refused = false;
    std::string answer = c.peer->answer(c.in.substr(in.used(), size), refused);
    std::string frame;
    put(frame, static_cast<std::uint32_t>(answer.size()));
    frame += answer;
    if (refused) {
      // The refusal, a few bytes, goes out before the connection closes.
      [[maybe_unused]] auto n =
          ::send(c.fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      drop(c);
    } else {
      queue_out(c, frame);
    }
    return in.used() + size;
  }

  void consume(Connection& c, std::size_t used) {
    c.in.erase(0, used);
    buffered -= used;
  }

  void process(std::uint64_t id, Connection& c) {
    try {
      while (!c.closing && !c.in.empty()) {
        if (c.kind == Kind::unknown) {
          if (c.in[0] == static_cast<char>(TorchCommand::validate)) {
            c.kind = Kind::torch;
          } else {
            if (c.in.size() < sizeof kAgentMagic) return;
            if (!rendezvous ||
                c.in.compare(0, sizeof kAgentMagic, kAgentMagic, sizeof kAgentMagic) != 0)
              throw BadMessage("neither torch's TCPStore protocol nor the agents'");
            c.kind = Kind::agent;
            c.peer = std::make_unique<AgentPeer>(*rendezvous, agents_secret);
            c.admit_by = Clock::now() + kProofTimeout;
            consume(c, sizeof kAgentMagic);
            continue;
          }
        }
        // A WAIT or BARRIER in progress: nothing else until it is answered.
        if (c.torch.waiting() && c.in[0] != static_cast<char>(TorchCommand::cancel_wait)) return;
        const std::size_t used = c.kind == Kind::agent ? agent_frame(c) : torch_command(id, c);
        if (used == 0) return;
        if (!c.closing) consume(c, used);
      }
    } catch (const BadMessage&) {
      drop(c);
    } catch (const std::bad_alloc&) {
      drop(c);
    }
  }

  void flush(Connection& c) {
    while (!c.closing && !c.out.empty()) {
      ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, static_cast<std::size_t>(n));
        buffered -= static_cast<std::size_t>(n);
      } else {
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
        drop(c);
      }
    }
  }

  static void trim(std::string& buffer) {
    if (buffer.capacity() > kIdleRoom && buffer.size() < buffer.capacity() / 4)
      buffer.shrink_to_fit();
  }

  static bool reading(const Connection& c) {
    return !c.torch.waiting() || c.in.size() < kInputWhileWaiting;
  }

  void receive(std::uint64_t id, Connection& c) {
    char buffer[65536];
    while (!c.closing && reading(c)) {
      ssize_t n = ::recv(c.fd, buffer, sizeof buffer, 0);
      if (n > 0) {
        const auto got = static_cast<std::size_t>(n);
        c.last_input = Clock::now();
        // Grown to one message's bound at most (not to twice it).
        if (c.in.size() + got > c.in.capacity())
          c.in.reserve(std::min(kMaxBuffered + sizeof buffer,
                                std::max(2 * c.in.capacity(), c.in.size() + got)));
        c.in.append(buffer, got);
        buffered += got;
        process(id, c);
        trim(c.in);
        // In every state, waiting included: no message is larger.
        if (c.in.size() > kMaxBuffered) drop(c);
        keep_within_buffer_limit();
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) return;
      drop(c);  // end of stream or an error
    }
  }

  void accept_from(int listen_fd) {
    for (;;) {
      int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        connections[next_id++].fd = fd;
        continue;
      }
      if (errno == EINTR || errno == ECONNABORTED) continue;
      // Out of descriptors or memory: the pending clients wait in the
      // backlog while the connections are served.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        accept_paused_until = Clock::now() + kAcceptPause;
      return;
    }
  }

  void close_connection(std::map<std::uint64_t, Connection>::iterator it) {
    workers.forget_waits(it->second.torch);
    buffered -= it->second.in.size() + it->second.out.size();
    ::close(it->second.fd);
    connections.erase(it);
  }

  template <class Predicate>
  void close_where(Predicate doomed) {
    for (auto it = connections.begin(); it != connections.end();)
      if (doomed(it->second))
        close_connection(it++);
      else
        ++it;
  }

  void reset_workers() {
    close_where([](const Connection& c) { return c.kind != Kind::agent; });
    workers.clear();
  }

  // Connections in the middle of a message that stayed silent too long
  // are closed; the time until the next may be: poll's timeout (-1: none).
  int close_silent(Clock::time_point now) {
    Clock::time_point next = Clock::time_point::max();
    auto close_at = [&](Connection& c, Clock::time_point deadline) {
      if (deadline <= now)
        drop(c);
      else
        next = std::min(next, deadline);
    };
    for (auto& [id, c] : connections) {
      // An agent that did not prove the secret in time.
      if (!c.closing && c.peer && !c.peer->admitted()) close_at(c, c.admit_by);
      if (!c.closing && !c.in.empty() && !c.torch.waiting())
        close_at(c, c.last_input + limits.idle_message_timeout);
    }
    if (accept_paused_until > now) next = std::min(next, accept_paused_until);
    if (next == Clock::time_point::max()) return -1;
    const auto wait = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
    return static_cast<int>(std::min<std::int64_t>(wait, 60'000));
  }

  void loop() {
    std::vector<pollfd> fds;
    std::vector<std::uint64_t> ids;
    for (;;) {
      {
        std::lock_guard lock(mutex);
        if (stop) return;
        if (resets_done != resets_asked) {
          reset_workers();
          resets_done = resets_asked;
          done.notify_all();
        }
      }
      const auto now = Clock::now();
      const int timeout = close_silent(now);
      close_where([](const Connection& c) { return c.closing; });
      // Negative descriptors are skipped by poll: the listening sockets
      // rest while accepting is paused.
      const bool accepting = accept_paused_until <= now;
      fds.assign(1, {wake_fd, POLLIN, 0});
      for (int fd : listen_fds) fds.push_back({accepting ? fd : -1, POLLIN, 0});
      ids.clear();
      for (auto& [id, c] : connections) {
        fds.push_back(
            {c.fd, static_cast<short>((reading(c) ? POLLIN : 0) | (c.out.empty() ? 0 : POLLOUT)),
             0});
        ids.push_back(id);
      }
      if (::poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR) {
        // Cannot happen with valid descriptors; whoever waits is released.
        std::lock_guard lock(mutex);
        stop = true;
        done.notify_all();
        return;
      }
      if (fds[0].revents) {
        std::uint64_t count = 0;
        [[maybe_unused]] auto n = ::read(wake_fd, &count, sizeof count);
      }
      for (std::size_t l = 0; l < listen_fds.size(); ++l)
        if (fds[1 + l].revents & POLLIN) accept_from(listen_fds[l]);
      const std::size_t first = 1 + listen_fds.size();
      for (std::size_t i = 0; i < ids.size(); ++i) {
        auto it = connections.find(ids[i]);
        if (it == connections.end() || !fds[first + i].revents) continue;
        if (fds[first + i].revents & (POLLIN | POLLHUP | POLLERR)) {
          // A client not read (waiting) that hung up or broke: gone.
          if (reading(it->second))
            receive(it->first, it->second);
          else
            drop(it->second);
        }
      }
      for (auto& [id, c] : connections)
        // Input that came behind a WAIT answered meanwhile.
        if (!c.closing && !c.in.empty() && !c.torch.waiting()) process(id, c);
      keep_within_buffer_limit();
      close_where([this](Connection& c) {
        flush(c);
        trim(c.out);
        return c.closing;
      });
    }
  }
};

StoreServer::StoreServer(const std::string& host, int port, std::shared_ptr<MemoryStore> rendezvous,
                         StoreLimits limits, std::string agents_secret)
    : impl_(std::make_unique<Impl>(limits)) {
  impl_->rendezvous = std::move(rendezvous);
  impl_->agents_secret = std::move(agents_secret);
  impl_->listen_fds = listen_on(host, port);
  impl_->port = bound_port(impl_->listen_fds.front());
  impl_->wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (impl_->wake_fd < 0) {
    const int e = errno;
    close_all(impl_->listen_fds);
    throw std::system_error(e, std::generic_category(), "eventfd");
  }
  impl_->thread = std::thread([this] { impl_->loop(); });
}

StoreServer::~StoreServer() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stop = true;
  }
  impl_->wake();
  impl_->thread.join();
  for (auto& [id, c] : impl_->connections) ::close(c.fd);
  close_all(impl_->listen_fds);
  ::close(impl_->wake_fd);
}

int StoreServer::port() const {
  return impl_->port;
}

void StoreServer::reset_worker_store() {
  std::unique_lock lock(impl_->mutex);
  const std::uint64_t ticket = ++impl_->resets_asked;
  impl_->wake();
  impl_->done.wait(lock, [&] { return impl_->resets_done >= ticket || impl_->stop; });
}

}  // namespace ductile::agent
