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
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

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

// Strings (literals too) after their length; numbers and enums as they are.
template <class T>
void put_field(std::string& out, const T& value) {
  if constexpr (std::is_convertible_v<const T&, std::string>)
    put_bytes(out, value);
  else
    put(out, value);
}

// Fields of the agents' protocol in order (an operation or a status first).
template <class... Fields>
std::string message(const Fields&... fields) {
  std::string out;
  (put_field(out, fields), ...);
  return out;
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

// The labels of the two proofs: a host's proof is never an agent's.
constexpr std::string_view kHostLabel = "ductile rendezvous host proof v1";
constexpr std::string_view kAgentLabel = "ductile rendezvous agent proof v1";

}  // namespace

// OpenSSL failing (cannot happen with a working libcrypto) breaks the
// exchange as a bad message would: the connection is closed.
std::string random_nonce() {
  std::string nonce(kNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) !=
      1)
    throw BadMessage("the random number generator failed");
  return nonce;
}

// Each field after its length: no two inputs read the same.
std::string proof(const std::string& secret, std::string_view label, const std::string& first,
                  const std::string& second) {
  std::string message;
  for (std::string_view part : {label, std::string_view(first), std::string_view(second)}) {
    put<std::uint64_t>(message, part.size());
    message.append(part);
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
            reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest, &size))
    throw BadMessage("HMAC-SHA256 failed");
  return std::string(reinterpret_cast<const char*>(digest), size);
}

bool same_proof(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

AgentPeer::AgentPeer(KeyValueStore& store, std::string secret)
    : store_(store), secret_(std::move(secret)), admitted_(secret_.empty()) {}

std::string AgentPeer::answer(const std::string& request, bool& close) {
  close = false;
  Cursor in(request);
  const auto op = static_cast<Op>(take<std::uint8_t>(in));
  if (op == Op::hello) {
    if (!client_nonce_.empty() || (admitted_ && !secret_.empty()))
      throw BadMessage("a second hello");
    std::string nonce;
    if (!in.bytes(nonce, kNonceBytes) || nonce.size() != kNonceBytes || in.left() != 0)
      throw BadMessage("a hello without its nonce");
    std::string out;
    put(out, Status::ok);
    if (secret_.empty()) {
      put<std::uint8_t>(out, 0);
      return out;
    }
    client_nonce_ = std::move(nonce);
    host_nonce_ = random_nonce();
    put<std::uint8_t>(out, 1);
    put_bytes(out, host_nonce_);
    put_bytes(out, proof(secret_, kHostLabel, client_nonce_, host_nonce_));
    return out;
  }
  if (admitted_) return serve(store_, request);
  close = true;
  if (op != Op::prove || client_nonce_.empty())
    return message(
        Status::unauthorized,
        "this rendezvous admits the agents of its job only, and this agent gave no proof of the "
        "job's secret: give every agent of the job the same DUCTILE_RDZV_SECRET or "
        "DUCTILE_RDZV_SECRET_FILE");
  std::string given;
  if (!in.bytes(given, EVP_MAX_MD_SIZE) || in.left() != 0)
    throw BadMessage("a proof of another size");
  if (!same_proof(given, proof(secret_, kAgentLabel, host_nonce_, client_nonce_)))
    return message(
        Status::unauthorized,
        "the host refused this agent's proof of the secret: the secrets differ (every agent of "
        "the job needs the same DUCTILE_RDZV_SECRET or DUCTILE_RDZV_SECRET_FILE)");
  close = false;
  admitted_ = true;
  return message(Status::ok);
}

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
        // A MemoryStore holds less than a frame; several ranges of it may
        // not: an error answer, never a frame the client must refuse.
        if (out.size() > kMaxFrame)
          throw StoreError(fmt::format(
              "a read answer of {} bytes, over the {} bytes of a frame: read fewer ranges at once",
              out.size(), kMaxFrame));
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
  std::string secret;
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
    if (!secret.empty()) prove_secret(deadline);
  }

  // Sends one request and returns its answer, less its status: an error
  // answer throws StoreError, an unauthorized one StoreRefused.
  std::string round_trip(const std::string& request,
                         std::chrono::steady_clock::time_point deadline) {
    std::string frame;
    wire::put(frame, static_cast<std::uint32_t>(request.size()));
    send_all(frame + request, deadline);
    std::uint32_t size = 0;
    std::string header = receive(sizeof size, deadline);
    std::memcpy(&size, header.data(), sizeof size);
    if (size > kMaxFrame) throw BadMessage("an answer over the frame limit");
    std::string answer = receive(size, deadline);
    answered = true;
    Cursor in(answer);
    auto status = take<Status>(in);
    if (status == Status::unauthorized) {
      disconnect();
      throw StoreRefused(description + ": " + take_bytes(in));
    }
    if (status == Status::error) throw StoreError(description + ": " + take_bytes(in));
    return answer.substr(in.used());
  }

  // The challenge-response of store_wire.hpp, the agent's side.
  void prove_secret(std::chrono::steady_clock::time_point deadline) {
    const std::string client_nonce = random_nonce();
    const std::string answer = round_trip(message(Op::hello, client_nonce), deadline);
    Cursor in(answer);
    const auto has_secret = take<std::uint8_t>(in);
    auto refuse = [&](const std::string& why) {
      disconnect();
      throw StoreRefused(fmt::format("{}: {}", description, why));
    };
    if (has_secret == 0)
      refuse(
          "the host has no secret and this agent has one: the secrets differ (every agent of the "
          "job needs the same DUCTILE_RDZV_SECRET or DUCTILE_RDZV_SECRET_FILE, or none)");
    std::string host_nonce, host_proof;
    if (!in.bytes(host_nonce, kNonceBytes) || host_nonce.size() != kNonceBytes ||
        !in.bytes(host_proof, EVP_MAX_MD_SIZE) || in.left() != 0)
      throw BadMessage("a malformed answer to hello");
    if (!same_proof(host_proof, proof(secret, kHostLabel, client_nonce, host_nonce)))
      refuse(
          "the host's proof of the secret does not match this agent's: the secrets differ "
          "(every agent of the job needs the same DUCTILE_RDZV_SECRET or "
          "DUCTILE_RDZV_SECRET_FILE)");
    round_trip(message(Op::prove, proof(secret, kAgentLabel, host_nonce, client_nonce)), deadline);
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
                                   std::string description, std::string secret)
    : impl_(std::make_unique<Impl>(std::move(host), port, timeout, std::move(description),
                                   std::move(secret))) {}

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
      return c.round_trip(request, deadline);
    } catch (const BadMessage& e) {
      c.disconnect();
      if (reused && attempt == 0) continue;
      c.unavailable(e.what());
    }
  }
}

namespace {

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
  return only_value<std::int64_t>(call(message(Op::grant, ttl_seconds)), impl_->description);
}

bool RendezvousClient::keep_alive(std::int64_t lease) {
  return only_value<std::uint8_t>(call(message(Op::keep_alive, lease)), impl_->description) != 0;
}

void RendezvousClient::revoke_lease(std::int64_t lease) {
  call(message(Op::revoke, lease));
}

std::int64_t RendezvousClient::lease_remaining(std::int64_t lease) {
  return only_value<std::int64_t>(call(message(Op::remaining, lease)), impl_->description);
}

void RendezvousClient::put(const std::string& key, const std::string& value, std::int64_t lease) {
  call(message(Op::put, key, value, lease));
}

std::vector<std::vector<KeyValue>> RendezvousClient::read(const std::vector<RangeRead>& reads) {
  std::string r = message(Op::read, static_cast<std::uint32_t>(reads.size()));
  for (const auto& one : reads)
    r += message(one.key, std::uint8_t{one.prefix}, one.limit, std::uint8_t{one.oldest_first});
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
  call(message(Op::erase, key));
}

void RendezvousClient::erase_prefix(const std::string& prefix) {
  call(message(Op::erase_prefix, prefix));
}

bool RendezvousClient::compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                                        const std::string& value, std::int64_t lease) {
  return only_value<std::uint8_t>(
             call(message(Op::compare_and_swap, key, expected_mod_revision, value, lease)),
             impl_->description) != 0;
}

std::string RendezvousClient::describe() const {
  return impl_->description;
}

}  // namespace ductile::agent
