// The store an agent serves: one thread, one poll loop, torch's TCPStore
// protocol and the agents' protocol. See store_server.hpp.
//
// torch's TCPStore protocol (as torch 2.13's clients speak it): a client
// first sends VALIDATE and a magic number, then commands of one byte and
// their fields; integers in the host's byte order, strings and values as a
// 64-bit length and the bytes. WAIT answers once every key exists (or the
// client cancels); keys are stored as the clients send them.
#include "ductile/agent/store_server.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "store_wire.hpp"

namespace ductile::agent {

using namespace wire;

namespace {

// torch's command bytes (c10d::detail::QueryType) and answers.
enum class Command : std::uint8_t {
  validate,
  set,
  compare_set,
  get,
  add,
  check,
  wait,
  num_keys,
  delete_key,
  append,
  multi_get,
  multi_set,
  cancel_wait,
  ping,
  queue_push,
  queue_pop,
  queue_len,
  list_keys,
  barrier
};
constexpr std::uint32_t kValidationMagic = 0x3C85F7CE;
constexpr std::uint8_t kReady = 0, kNotReady = 1;            // CHECK
constexpr std::uint8_t kStopWaiting = 0, kWaitCanceled = 1;  // WAIT, BARRIER

// Bounds of what one client may send (torch's own server has bounds too).
constexpr std::uint64_t kMaxKey = 64 * 1024;
constexpr std::uint64_t kMaxValue = 64u << 20;
constexpr std::uint64_t kMaxKeys = 128 * 1024;
constexpr std::size_t kMaxBuffered = (64u << 20) + (1u << 20);

int listen_on(int port) {
  // Every interface, IPv6 and IPv4 (v4-mapped) where the kernel allows,
  // else IPv4 only: workers reach it at whatever MASTER_ADDR resolves to.
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1, zero = 0;
  if (fd >= 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_any;
    addr.sin6_port = htons(static_cast<std::uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
        ::listen(fd, SOMAXCONN) == 0)
      return fd;
    const int e = errno;
    ::close(fd);
    if (e == EADDRINUSE) throw std::system_error(e, std::generic_category(), "bind");
  }
  fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "socket");
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(fd, SOMAXCONN) != 0) {
    const int e = errno;
    ::close(fd);
    throw std::system_error(e, std::generic_category(), "bind");
  }
  return fd;
}

int bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

}  // namespace

struct StoreServer::Impl {
  enum class Kind { unknown, torch_unvalidated, torch, agent };
  struct Connection {
    int fd = -1;
    Kind kind = Kind::unknown;
    std::string in, out;
    std::size_t awaited = 0;  // keys of a WAIT or BARRIER not there yet
    bool closing = false;
  };

  std::shared_ptr<MemoryStore> rendezvous;
  int listen_fd = -1, wake_fd = -1, port = 0;
  std::thread thread;
  std::mutex mutex;  // guards the requests below
  std::condition_variable done;
  bool stop = false;
  std::uint64_t resets_asked = 0, resets_done = 0;

  std::map<std::uint64_t, Connection> connections;
  std::uint64_t next_id = 1;
  // The workers' store.
  std::unordered_map<std::string, std::string> values;
  std::unordered_map<std::string, std::deque<std::string>> queues;
  std::unordered_map<std::string, std::vector<std::uint64_t>> waiting;  // key -> connections

  void wake() {
    std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake_fd, &one, sizeof one);
  }

  bool present(const std::string& key) const {
    if (values.count(key)) return true;
    auto q = queues.find(key);
    return q != queues.end() && !q->second.empty();
  }

  void answer(std::uint64_t id, const std::string& bytes) {
    auto it = connections.find(id);
    if (it != connections.end() && !it->second.closing) it->second.out += bytes;
  }

  // Every connection waiting for `key` counts it as there; those with all
  // their keys get STOP_WAITING. `one`: only the first of them (a queue
  // push wakes one popper).
  void arrived(const std::string& key, bool one = false) {
    auto w = waiting.find(key);
    if (w == waiting.end()) return;
    auto& ids = w->second;
    while (!ids.empty()) {
      const std::uint64_t id = ids.front();
      ids.erase(ids.begin());
      auto c = connections.find(id);
      if (c == connections.end() || c->second.awaited == 0) continue;
      if (--c->second.awaited == 0) {
        answer(id, std::string(1, static_cast<char>(kStopWaiting)));
        if (one) break;
      }
    }
    if (ids.empty()) waiting.erase(w);
  }

  void forget_waits(std::uint64_t id) {
    for (auto it = waiting.begin(); it != waiting.end();) {
      std::erase(it->second, id);
      it = it->second.empty() ? waiting.erase(it) : std::next(it);
    }
    if (auto c = connections.find(id); c != connections.end()) c->second.awaited = 0;
  }

  // Reads `count` keys; false when the buffer ends first.
  static bool keys(Cursor& in, std::vector<std::string>& out) {
    std::uint64_t count = 0;
    if (!in.value(count)) return false;
    if (count > kMaxKeys) throw BadMessage("too many keys in one command");
    out.resize(static_cast<std::size_t>(count));
    for (auto& k : out)
      if (!in.bytes(k, kMaxKey)) return false;
    return true;
  }

  static std::int64_t as_counter(const std::string& value) {
    try {
      std::size_t used = 0;
      std::int64_t v = std::stoll(value, &used);
      if (used == value.size()) return v;
    } catch (const std::exception&) {
    }
    throw BadMessage("ADD on a key whose value is not a number");
  }

  // One torch command from the front of c.in: the bytes it took, or 0 when
  // the buffer holds only part of it.
  std::size_t torch_command(std::uint64_t id, Connection& c) {
    Cursor in(c.in);
    std::uint8_t byte = 0;
    if (!in.value(byte)) return 0;
    const auto command = static_cast<Command>(byte);
    if (c.kind == Kind::torch_unvalidated) {
      std::uint32_t magic = 0;
      if (command != Command::validate) throw BadMessage("a client that did not validate");
      if (!in.value(magic)) return 0;
      if (magic != kValidationMagic) throw BadMessage("a wrong validation number");
      c.kind = Kind::torch;
      return in.used();
    }
    std::string key, value, reply;
    switch (command) {
      case Command::ping: {
        std::uint32_t nonce = 0;
        if (!in.value(nonce)) return 0;
        put(reply, nonce);
        break;
      }
      case Command::set:
        if (!in.bytes(key, kMaxKey) || !in.bytes(value, kMaxValue)) return 0;
        values[key] = std::move(value);
        arrived(key);
        break;
      case Command::compare_set: {
        std::string expected;
        if (!in.bytes(key, kMaxKey) || !in.bytes(expected, kMaxValue) ||
            !in.bytes(value, kMaxValue))
          return 0;
        // torch's answer: the value now there; a missing key is created
        // only when `expected` is empty, else `expected` comes back.
        auto it = values.find(key);
        if (it == values.end()) {
          if (expected.empty()) values[key] = value;
          put_bytes(reply, expected.empty() ? value : expected);
        } else {
          if (it->second == expected) it->second = value;
          put_bytes(reply, it->second);
        }
        arrived(key);
        break;
      }
      case Command::get: {
        if (!in.bytes(key, kMaxKey)) return 0;
        auto it = values.find(key);
        put_bytes(reply, it == values.end() ? std::string() : it->second);
        break;
      }
      case Command::add: {
        std::int64_t delta = 0;
        if (!in.bytes(key, kMaxKey) || !in.value(delta)) return 0;
        auto it = values.find(key);
        const std::int64_t sum = (it == values.end() ? 0 : as_counter(it->second)) + delta;
        values[key] = std::to_string(sum);
        put(reply, sum);
        arrived(key);
        break;
      }
      case Command::check: {
        std::vector<std::string> ks;
        if (!keys(in, ks)) return 0;
        const bool all = std::all_of(ks.begin(), ks.end(), [&](auto& k) { return present(k); });
        put(reply, all ? kReady : kNotReady);
        break;
      }
      case Command::wait: {
        std::vector<std::string> ks;
        if (!keys(in, ks)) return 0;
        std::size_t missing = 0;
        for (const auto& k : ks)
          if (!present(k)) {
            waiting[k].push_back(id);
            ++missing;
          }
        c.awaited = missing;
        if (missing == 0) put(reply, kStopWaiting);
        break;
      }
      case Command::num_keys:
        put(reply, static_cast<std::int64_t>(values.size()));
        break;
      case Command::delete_key:
        if (!in.bytes(key, kMaxKey)) return 0;
        put(reply, static_cast<std::int64_t>(values.erase(key)));
        break;
      case Command::append:
        if (!in.bytes(key, kMaxKey) || !in.bytes(value, kMaxValue)) return 0;
        values[key] += value;
        arrived(key);
        break;
      case Command::multi_get: {
        std::vector<std::string> ks;
        if (!keys(in, ks)) return 0;
        for (const auto& k : ks) {
          auto it = values.find(k);
          put_bytes(reply, it == values.end() ? std::string() : it->second);
        }
        break;
      }
      case Command::multi_set: {
        std::uint64_t count = 0;
        if (!in.value(count)) return 0;
        if (count > kMaxKeys) throw BadMessage("too many keys in one command");
        std::vector<std::pair<std::string, std::string>> pairs(static_cast<std::size_t>(count));
        for (auto& [k, v] : pairs)
          if (!in.bytes(k, kMaxKey) || !in.bytes(v, kMaxValue)) return 0;
        for (auto& [k, v] : pairs) {
          values[k] = std::move(v);
          arrived(k);
        }
        break;
      }
      case Command::cancel_wait:
        forget_waits(id);
        put(reply, kWaitCanceled);
        break;
      case Command::queue_push:
        if (!in.bytes(key, kMaxKey) || !in.bytes(value, kMaxValue)) return 0;
        queues[key].push_back(std::move(value));
        arrived(key, true);
        break;
      case Command::queue_pop: {
        if (!in.bytes(key, kMaxKey)) return 0;
        auto& queue = queues[key];
        put(reply, static_cast<std::int64_t>(queue.size()));
        if (!queue.empty()) {
          put_bytes(reply, queue.front());
          queue.pop_front();
        }
        break;
      }
      case Command::queue_len: {
        if (!in.bytes(key, kMaxKey)) return 0;
        auto q = queues.find(key);
        put(reply, static_cast<std::int64_t>(q == queues.end() ? 0 : q->second.size()));
        break;
      }
      case Command::list_keys:
        put(reply, static_cast<std::int64_t>(values.size()));
        for (const auto& [k, v] : values) put_bytes(reply, k);
        break;
      case Command::barrier: {
        std::int64_t world = 0;
        if (!in.bytes(key, kMaxKey) || !in.value(world)) return 0;
        auto it = values.find(key);
        const std::int64_t count = (it == values.end() ? 0 : as_counter(it->second)) + 1;
        values[key] = std::to_string(count);
        if (count >= world) {
          arrived(key);
          put(reply, kStopWaiting);
        } else {
          waiting[key].push_back(id);
          c.awaited = 1;
        }
        break;
      }
      default:
        throw BadMessage("an unknown command");
    }
    c.out += reply;
    return in.used();
  }

  // One frame of the agents' protocol: the bytes it took, or 0.
  std::size_t agent_frame(Connection& c) {
    Cursor in(c.in);
    std::uint32_t size = 0;
    if (!in.value(size)) return 0;
    if (size > kMaxFrame) throw BadMessage("a frame over the limit");
    if (in.left() < size) return 0;
    std::string answer = serve(*rendezvous, c.in.substr(in.used(), size));
    put(c.out, static_cast<std::uint32_t>(answer.size()));
    c.out += answer;
    return in.used() + size;
  }

  void process(std::uint64_t id, Connection& c) {
    try {
      while (!c.closing && !c.in.empty()) {
        if (c.kind == Kind::unknown) {
          if (c.in[0] == static_cast<char>(Command::validate)) {
            c.kind = Kind::torch_unvalidated;
          } else {
            if (c.in.size() < sizeof kAgentMagic) return;
            if (!rendezvous ||
                c.in.compare(0, sizeof kAgentMagic, kAgentMagic, sizeof kAgentMagic) != 0)
              throw BadMessage("neither torch's TCPStore protocol nor the agents'");
            c.kind = Kind::agent;
            c.in.erase(0, sizeof kAgentMagic);
            continue;
          }
        }
        // A WAIT or BARRIER in progress: nothing else until it is answered.
        if (c.awaited > 0 && c.in[0] != static_cast<char>(Command::cancel_wait)) return;
        const std::size_t used = c.kind == Kind::agent ? agent_frame(c) : torch_command(id, c);
        if (used == 0) {
          if (c.in.size() > kMaxBuffered) throw BadMessage("a message over the limit");
          return;
        }
        c.in.erase(0, used);
      }
    } catch (const BadMessage&) {
      c.closing = true;
    } catch (const std::bad_alloc&) {
      c.closing = true;
    }
  }

  void flush(Connection& c) {
    // A client that sends and never reads its answers is dropped.
    if (c.out.size() > 2 * kMaxBuffered) {
      c.closing = true;
      return;
    }
    while (!c.out.empty()) {
      ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, static_cast<std::size_t>(n));
      } else {
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
        c.closing = true;
        return;
      }
    }
  }

  void receive(std::uint64_t id, Connection& c) {
    char buffer[65536];
    for (;;) {
      ssize_t n = ::recv(c.fd, buffer, sizeof buffer, 0);
      if (n > 0) {
        c.in.append(buffer, static_cast<std::size_t>(n));
        process(id, c);
        if (c.closing) return;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) return;
      c.closing = true;  // end of stream or an error
      return;
    }
  }

  void accept_all() {
    for (;;) {
      int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      connections[next_id++].fd = fd;
    }
  }

  void close_connection(std::map<std::uint64_t, Connection>::iterator it) {
    forget_waits(it->first);
    ::close(it->second.fd);
    connections.erase(it);
  }

  void reset_workers() {
    for (auto it = connections.begin(); it != connections.end();)
      if (it->second.kind != Kind::agent)
        close_connection(it++);
      else
        ++it;
    values.clear();
    queues.clear();
    waiting.clear();
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
      fds.assign({{listen_fd, POLLIN, 0}, {wake_fd, POLLIN, 0}});
      ids.clear();
      for (auto& [id, c] : connections) {
        fds.push_back({c.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
        ids.push_back(id);
      }
      if (::poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) {
        // Cannot happen with valid descriptors; whoever waits is released.
        std::lock_guard lock(mutex);
        stop = true;
        done.notify_all();
        return;
      }
      if (fds[1].revents) {
        std::uint64_t count = 0;
        [[maybe_unused]] auto n = ::read(wake_fd, &count, sizeof count);
      }
      if (fds[0].revents & POLLIN) accept_all();
      for (std::size_t i = 0; i < ids.size(); ++i) {
        auto it = connections.find(ids[i]);
        if (it == connections.end() || !fds[i + 2].revents) continue;
        if (fds[i + 2].revents & (POLLIN | POLLHUP | POLLERR)) receive(it->first, it->second);
      }
      for (auto it = connections.begin(); it != connections.end();) {
        // Input that came behind a WAIT answered meanwhile.
        if (!it->second.in.empty() && it->second.awaited == 0) process(it->first, it->second);
        flush(it->second);
        if (it->second.closing)
          close_connection(it++);
        else
          ++it;
      }
    }
  }
};

StoreServer::StoreServer(int port, std::shared_ptr<MemoryStore> rendezvous)
    : impl_(std::make_unique<Impl>()) {
  impl_->rendezvous = std::move(rendezvous);
  impl_->listen_fd = listen_on(port);
  impl_->port = bound_port(impl_->listen_fd);
  impl_->wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (impl_->wake_fd < 0) {
    const int e = errno;
    ::close(impl_->listen_fd);
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
  ::close(impl_->listen_fd);
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
