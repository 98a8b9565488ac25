// The agents' protocol of a hosted rendezvous: requests served on the
// host's MemoryStore, and RendezvousClient, the other agents' side. See
// store_server.hpp and store_wire.hpp.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "ductile/agent/store_server.hpp"
#include "store_wire.hpp"

namespace ductile::agent {
namespace wire {
namespace {

constexpr std::uint64_t kMaxString = kMaxFrame;
constexpr std::uint32_t kMaxRanges = 64;

void put_kv(std::string& out, const KeyValue& kv) {
  put_bytes(out, kv.key);
  put_bytes(out, kv.value);
  put(out, kv.create_revision);
  put(out, kv.mod_revision);
  put(out, kv.lease);
}

// A field of a complete frame: missing bytes break the protocol.
template <class T>
T take(Cursor& in) {
  T value{};
  if (!in.value(value)) throw BadMessage("a request ends early");
  return value;
}
std::string take_bytes(Cursor& in) {
  std::string s;
  if (!in.bytes(s, kMaxString)) throw BadMessage("a request ends early");
  return s;
}

KeyValue take_kv(Cursor& in) {
  KeyValue kv;
  kv.key = take_bytes(in);
  kv.value = take_bytes(in);
  kv.create_revision = take<std::int64_t>(in);
  kv.mod_revision = take<std::int64_t>(in);
  kv.lease = take<std::int64_t>(in);
  return kv;
}

}  // namespace

std::string serve(KeyValueStore& store, const std::string& request) {
  Cursor in(request);
  const auto op = static_cast<Op>(take<std::uint8_t>(in));
  std::string out;
  put(out, Status::ok);
  try {
    switch (op) {
      case Op::grant:
        put(out, store.grant_lease(take<std::int64_t>(in)));
        break;
      case Op::keep_alive:
        put<std::uint8_t>(out, store.keep_alive(take<std::int64_t>(in)) ? 1 : 0);
        break;
      case Op::revoke:
        store.revoke_lease(take<std::int64_t>(in));
        break;
      case Op::remaining:
        put(out, store.lease_remaining(take<std::int64_t>(in)));
        break;
      case Op::put: {
        std::string key = take_bytes(in), value = take_bytes(in);
        store.put(key, value, take<std::int64_t>(in));
        break;
      }
      case Op::read: {
        const auto count = take<std::uint32_t>(in);
        if (count > kMaxRanges) throw BadMessage("too many ranges in one read");
        std::vector<RangeRead> reads(count);
        for (auto& r : reads) {
          r.key = take_bytes(in);
          r.prefix = take<std::uint8_t>(in) != 0;
          r.limit = take<std::int64_t>(in);
          r.oldest_first = take<std::uint8_t>(in) != 0;
        }
        auto results = store.read(reads);
        put(out, static_cast<std::uint32_t>(results.size()));
        for (const auto& kvs : results) {
          put(out, static_cast<std::uint32_t>(kvs.size()));
          for (const auto& kv : kvs) put_kv(out, kv);
        }
        break;
      }
      case Op::erase:
        store.erase(take_bytes(in));
        break;
      case Op::erase_prefix:
        store.erase_prefix(take_bytes(in));
        break;
      case Op::compare_and_swap: {
        std::string key = take_bytes(in);
        const auto expected = take<std::int64_t>(in);
        std::string value = take_bytes(in);
        put<std::uint8_t>(out,
                          store.compare_and_swap(key, expected, value, take<std::int64_t>(in)));
        break;
      }
      default:
        throw BadMessage(fmt::format("unknown operation {}", static_cast<int>(op)));
    }
  } catch (const StoreError& e) {
    out.clear();
    put(out, Status::error);
    put_bytes(out, e.what());
  }
  if (in.left() != 0) throw BadMessage("a request with bytes after its fields");
  return out;
}

}  // namespace wire

using namespace wire;

struct RendezvousClient::Impl {
  std::string host;
  int port = 0;
  std::chrono::milliseconds timeout;
  std::string description;
  int fd = -1;
  bool answered = false;  // the host answered once: a refusal now means it is gone

  ~Impl() { disconnect(); }
  void disconnect() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }

  [[noreturn]] void unavailable(const std::string& what) const {
    throw StoreUnavailable(fmt::format("{}: {}", description, what));
  }

  // Waits until `fd` is ready for `events` or the deadline passes.
  bool wait(short events, std::chrono::steady_clock::time_point deadline) const {
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd, events, 0};
      int rc = ::poll(&p, 1, static_cast<int>(left.count()));
      if (rc > 0) return true;
      if (rc < 0 && errno != EINTR) return false;
    }
  }

  void connect(std::chrono::steady_clock::time_point deadline) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0)
      unavailable(fmt::format("cannot resolve {}: {}", host, gai_strerror(rc)));
    int last_error = 0;
    for (addrinfo* a = found; a && fd < 0; a = a->ai_next) {
      fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) {
        last_error = errno;
        continue;
      }
      int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        if (wait(POLLOUT, deadline)) {
          socklen_t len = sizeof last_error;
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &last_error, &len);
          rc = last_error == 0 ? 0 : -1;
        } else {
          last_error = ETIMEDOUT;
        }
      } else if (rc != 0) {
        last_error = errno;
      }
      if (rc != 0) disconnect();
    }
    ::freeaddrinfo(found);
    if (fd < 0) {
      std::string what = fmt::format("cannot connect to {}:{}: {}", host, port,
                                     std::strerror(last_error ? last_error : ECONNREFUSED));
      if (answered && last_error == ECONNREFUSED)
        throw StoreGone(fmt::format("{}: {} (its agent is gone)", description, what));
      unavailable(what);
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    send_all(std::string(kAgentMagic, sizeof kAgentMagic), deadline);
  }

  void send_all(const std::string& data, std::chrono::steady_clock::time_point deadline) {
    std::size_t sent = 0;
    while (sent < data.size()) {
      ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<std::size_t>(n);
      } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        if (!wait(POLLOUT, deadline)) throw BadMessage("timed out sending");
      } else {
        throw BadMessage(std::string("sending failed: ") + std::strerror(errno));
      }
    }
  }

  std::string receive(std::size_t size, std::chrono::steady_clock::time_point deadline) {
    std::string data(size, '\0');
    std::size_t got = 0;
    while (got < size) {
      ssize_t n = ::recv(fd, data.data() + got, size - got, 0);
      if (n > 0) {
        got += static_cast<std::size_t>(n);
      } else if (n == 0) {
        throw BadMessage("the host closed the connection");
      } else if (errno == EAGAIN || errno == EINTR) {
        if (!wait(POLLIN, deadline)) throw BadMessage("timed out waiting for the answer");
      } else {
        throw BadMessage(std::string("receiving failed: ") + std::strerror(errno));
      }
    }
    return data;
  }
};

RendezvousClient::RendezvousClient(std::string host, int port, std::chrono::milliseconds timeout,
                                   std::string description)
    : impl_(std::make_unique<Impl>()) {
  impl_->host = std::move(host);
  impl_->port = port;
  impl_->timeout = timeout;
  impl_->description = std::move(description);
}

RendezvousClient::~RendezvousClient() = default;

std::string RendezvousClient::call(const std::string& request) {
  Impl& c = *impl_;
  // A connection kept from an earlier call may have broken meanwhile: one
  // more try on a new one.
  for (int attempt = 0;; ++attempt) {
    const bool reused = c.fd >= 0;
    const auto deadline = std::chrono::steady_clock::now() + c.timeout;
    try {
      if (c.fd < 0) c.connect(deadline);
      std::string frame;
      wire::put(frame, static_cast<std::uint32_t>(request.size()));
      c.send_all(frame + request, deadline);
      std::uint32_t size = 0;
      std::string header = c.receive(sizeof size, deadline);
      std::memcpy(&size, header.data(), sizeof size);
      if (size > kMaxFrame) throw BadMessage("an answer over the frame limit");
      std::string answer = c.receive(size, deadline);
      c.answered = true;
      Cursor in(answer);
      auto status = take<Status>(in);
      if (status == Status::error) throw StoreError(c.description + ": " + take_bytes(in));
      return answer.substr(in.used());
    } catch (const BadMessage& e) {
      c.disconnect();
      if (reused && attempt == 0) continue;
      c.unavailable(e.what());
    }
  }
}

namespace {

std::string request(Op op) {
  std::string out;
  wire::put(out, op);
  return out;
}

// The single value of an answer.
template <class T>
T only_value(const std::string& answer, const std::string& description) {
  Cursor in(answer);
  T value{};
  if (!in.value(value) || in.left() != 0)
    throw StoreError(description + ": a malformed answer (not one value)");
  return value;
}

}  // namespace

std::int64_t RendezvousClient::grant_lease(std::int64_t ttl_seconds) {
  std::string r = request(Op::grant);
  wire::put(r, ttl_seconds);
  return only_value<std::int64_t>(call(r), impl_->description);
}

bool RendezvousClient::keep_alive(std::int64_t lease) {
  std::string r = request(Op::keep_alive);
  wire::put(r, lease);
  return only_value<std::uint8_t>(call(r), impl_->description) != 0;
}

void RendezvousClient::revoke_lease(std::int64_t lease) {
  std::string r = request(Op::revoke);
  wire::put(r, lease);
  call(r);
}

std::int64_t RendezvousClient::lease_remaining(std::int64_t lease) {
  std::string r = request(Op::remaining);
  wire::put(r, lease);
  return only_value<std::int64_t>(call(r), impl_->description);
}

void RendezvousClient::put(const std::string& key, const std::string& value, std::int64_t lease) {
  std::string r = request(Op::put);
  put_bytes(r, key);
  put_bytes(r, value);
  wire::put(r, lease);
  call(r);
}

std::optional<KeyValue> RendezvousClient::get(const std::string& key) {
  auto found = read({RangeRead{key}});
  if (found.front().empty()) return std::nullopt;
  return found.front().front();
}

std::vector<KeyValue> RendezvousClient::get_prefix(const std::string& prefix) {
  return read({RangeRead{prefix, true}}).front();
}

std::vector<std::vector<KeyValue>> RendezvousClient::read(const std::vector<RangeRead>& reads) {
  std::string r = request(Op::read);
  wire::put(r, static_cast<std::uint32_t>(reads.size()));
  for (const auto& one : reads) {
    put_bytes(r, one.key);
    wire::put<std::uint8_t>(r, one.prefix);
    wire::put(r, one.limit);
    wire::put<std::uint8_t>(r, one.oldest_first);
  }
  std::string answer = call(r);
  try {
    Cursor in(answer);
    const auto count = take<std::uint32_t>(in);
    if (count != reads.size()) throw BadMessage("another count of ranges");
    std::vector<std::vector<KeyValue>> out(count);
    for (auto& kvs : out) {
      const auto n = take<std::uint32_t>(in);
      if (n > in.left()) throw BadMessage("a range longer than its answer");
      for (std::uint32_t i = 0; i < n; ++i) kvs.push_back(take_kv(in));
    }
    return out;
  } catch (const BadMessage& e) {
    impl_->disconnect();
    throw StoreError(fmt::format("{}: a malformed answer ({})", impl_->description, e.what()));
  }
}

void RendezvousClient::erase(const std::string& key) {
  std::string r = request(Op::erase);
  put_bytes(r, key);
  call(r);
}

void RendezvousClient::erase_prefix(const std::string& prefix) {
  std::string r = request(Op::erase_prefix);
  put_bytes(r, prefix);
  call(r);
}

bool RendezvousClient::compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                                        const std::string& value, std::int64_t lease) {
  std::string r = request(Op::compare_and_swap);
  put_bytes(r, key);
  wire::put(r, expected_mod_revision);
  put_bytes(r, value);
  wire::put(r, lease);
  return only_value<std::uint8_t>(call(r), impl_->description) != 0;
}

std::string RendezvousClient::describe() const {
  return impl_->description;
}

}  // namespace ductile::agent
