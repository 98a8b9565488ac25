// The snapshot servers' transport: a connection, plain or over TLS, read
// and written with every wait bounded; the paths a server may serve; the
// client's connect and request. Internal to libductile_agent (the server
// and client of snapshot_server.cpp); see snapshot_server.hpp.
//
// Threading: a Link is used by one thread at a time. Errors: Broken (why
// a connection ended), thrown by every call that reads, writes or waits.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include "snapshot_server.hpp"

namespace ductile::agent {

// Not an anonymous namespace: a unity build puts several of the library's
// files into one translation unit, where their helpers' names would clash.
namespace snapshot_server_detail {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

inline constexpr char kSnapshotMagic[4] = {'D', 'S', 'N', '1'};
// A snapshot server's proof is never an agent's, nor either one the
// rendezvous' (store_wire.hpp).
inline constexpr std::string_view kSnapshotHostLabel = "ductile snapshot host proof v1";
inline constexpr std::string_view kSnapshotAgentLabel = "ductile snapshot agent proof v1";
inline constexpr std::uint8_t kOk = 0, kRefused = 1, kUnauthorized = 2;
inline constexpr std::size_t kMaxReason = 1024;
inline constexpr std::size_t kProofBytes = 32;  // an HMAC-SHA256
inline constexpr std::size_t kChunk = 1 << 20;
// How often a wait looks at `abandon`.
inline constexpr milliseconds kSlice{200};

// The IP address of a peer, as text ("" when it is of no IP family).
std::string peer_address(const sockaddr_storage& peer);

// Why a connection ended before its end.
struct Broken {
  std::string why;
  bool missing = false;  // the server holds no such file
};

// Waits for `events` on `fd`: at most `idle`, and until `deadline`, while
// `abandon` is not set.
void wait_for(int fd, short events, milliseconds idle, Clock::time_point deadline,
              const std::atomic<bool>* abandon);

// A socket BIO whose writes never raise SIGPIPE (send with MSG_NOSIGNAL,
// as the plain connections do): the library cannot count on the process
// ignoring it. OpenSSL's socket BIO does the rest.
BIO_METHOD* socket_without_sigpipe();

// OpenSSL's reasons for this thread's last failure (its queue emptied),
// with the check of the peer's certificate when that failed.
std::string tls_reasons(const SSL* ssl);

// One connection, plain or TLS: the framing below reads and writes
// through it, each call bounded like the plain socket's (the same waits
// on the non-blocking socket, whichever way OpenSSL asks to wait).
class Link {
 public:
  // `fd`: a connected non-blocking socket, closed with the link when
  // `owns_fd`.
  Link(int fd, bool owns_fd) : fd_(fd), owns_fd_(owns_fd) {}
  ~Link() {
    if (ssl_) SSL_free(ssl_);
    if (owns_fd_) ::close(fd_);
  }
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  // The TLS handshake, as the server or the client, within `idle` and
  // `deadline`: the peer's certificate verified against the job's CA.
  // Throws Broken with OpenSSL's reason and the files involved.
  void start_tls(const SnapshotTls& tls, bool server, milliseconds idle, Clock::time_point deadline,
                 const std::atomic<bool>* abandon) {
    ssl_ = SSL_new(tls.context());
    BIO* bio = ssl_ ? BIO_new(socket_without_sigpipe()) : nullptr;
    if (!bio) throw Broken{fmt::format("cannot start TLS: {}", tls_reasons(ssl_))};
    BIO_set_fd(bio, fd_, BIO_NOCLOSE);
    SSL_set_bio(ssl_, bio, bio);
    described_ = tls.described();
    if (server)
      SSL_set_accept_state(ssl_);
    else
      SSL_set_connect_state(ssl_);
    tls_call(
        "the TLS handshake failed", [this] { return SSL_do_handshake(ssl_); }, idle, deadline,
        abandon);
  }

  void send_all(const char* data, std::size_t size, milliseconds idle, Clock::time_point deadline,
                const std::atomic<bool>* abandon) {
    while (size > 0) {
      std::size_t n = 0;
      if (ssl_) {
        const int chunk = static_cast<int>(std::min<std::size_t>(size, INT_MAX));
        n = static_cast<std::size_t>(tls_call(
            "the TLS connection failed", [&] { return SSL_write(ssl_, data, chunk); }, idle,
            deadline, abandon));
      } else {
        const ssize_t sent = ::send(fd_, data, size, MSG_NOSIGNAL);
        if (sent < 0 && errno == EINTR) continue;
        if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) throw Broken{std::strerror(errno)};
        if (sent <= 0) {
          wait_for(fd_, POLLOUT, idle, deadline, abandon);
          continue;
        }
        n = static_cast<std::size_t>(sent);
      }
      data += n;
      size -= n;
    }
  }

  // Up to `size` bytes (at least one) into `data`.
  std::size_t receive_some(char* data, std::size_t size, milliseconds idle,
                           Clock::time_point deadline, const std::atomic<bool>* abandon) {
    if (ssl_) {
      const int chunk = static_cast<int>(std::min<std::size_t>(size, INT_MAX));
      return static_cast<std::size_t>(tls_call(
          "the TLS connection failed", [&] { return SSL_read(ssl_, data, chunk); }, idle, deadline,
          abandon));
    }
    for (;;) {
      const ssize_t n = ::recv(fd_, data, size, 0);
      if (n > 0) return static_cast<std::size_t>(n);
      if (n == 0) throw Broken{"the connection was closed"};
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) throw Broken{std::strerror(errno)};
      wait_for(fd_, POLLIN, idle, deadline, abandon);
    }
  }

  // Before a served connection is closed: its answer sent (and TLS's
  // close_notify), the client's unread bytes (a request refused before it
  // was read) are drained for a moment, so that the close is a FIN after
  // the answer and not a reset that could cut it off.
  void drain_before_close() {
    if (ssl_ && SSL_is_init_finished(ssl_)) {
      ERR_clear_error();
      SSL_shutdown(ssl_);  // sends close_notify; the client's is not awaited
    }
    ::shutdown(fd_, SHUT_WR);
    const auto until = Clock::now() + std::chrono::seconds(1);
    char discard[4096];
    for (std::size_t drained = 0; drained < (64u << 10);) {
      const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now());
      pollfd p{fd_, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
      const ssize_t n = ::recv(fd_, discard, sizeof discard, 0);
      if (n <= 0) break;
      drained += static_cast<std::size_t>(n);
    }
  }

 private:
  // Runs `call` (an SSL_* function: > 0 is done) until done, waiting on
  // the socket for what OpenSSL asks. Returns its result.
  template <class Call>
  int tls_call(std::string_view failed, Call call, milliseconds idle, Clock::time_point deadline,
               const std::atomic<bool>* abandon) {
    for (;;) {
      ERR_clear_error();
      errno = 0;
      const int n = call();
      if (n > 0) return n;
      switch (SSL_get_error(ssl_, n)) {
        case SSL_ERROR_WANT_READ:
          wait_for(fd_, POLLIN, idle, deadline, abandon);
          continue;
        case SSL_ERROR_WANT_WRITE:
          wait_for(fd_, POLLOUT, idle, deadline, abandon);
          continue;
        case SSL_ERROR_ZERO_RETURN:
          throw Broken{"the connection was closed"};
        case SSL_ERROR_SYSCALL:
          if (errno != 0 && ERR_peek_error() == 0) throw Broken{std::strerror(errno)};
          if (ERR_peek_error() == 0) throw Broken{"the connection was closed"};
          [[fallthrough]];
        default:
          throw Broken{fmt::format("{}: {}; {}", failed, tls_reasons(ssl_), described_)};
      }
    }
  }

  int fd_;
  bool owns_fd_;
  SSL* ssl_ = nullptr;
  std::string described_;  // the TLS files, for messages
};

void send_all(Link& link, const std::string& data, milliseconds idle, Clock::time_point deadline,
              const std::atomic<bool>* abandon);

void receive_exact(Link& link, char* data, std::size_t size, milliseconds idle,
                   Clock::time_point deadline, const std::atomic<bool>* abandon);

std::string receive_string(Link& link, std::size_t size, milliseconds idle,
                           Clock::time_point deadline, const std::atomic<bool>* abandon);

template <class T>
T receive_value(Link& link, milliseconds idle, Clock::time_point deadline,
                const std::atomic<bool>* abandon) {
  T value{};
  receive_exact(link, reinterpret_cast<char*>(&value), sizeof value, idle, deadline, abandon);
  return value;
}

bool path_component(std::string_view part);

std::vector<std::string> split_path(const std::string& relative);

// The file below the area, each directory opened without following a
// link, the file itself too and without blocking (a FIFO); a regular file
// only. Returns the descriptor, or -1 and why.
int open_below(int area_fd, const std::string& relative, struct stat& info, std::string& why);

std::string refusal(std::uint8_t status, const std::string& why);

// A connected non-blocking socket to host:port, or Broken.
int connect_to(const std::string& host, int port, milliseconds timeout,
               const std::atomic<bool>* abandon);

// Connects to the server at host:port (over TLS when `auth` has it),
// proves its secret, sends `request` (a file's path or a message) and
// `body` when not empty (its 32-bit length first), and reads the status:
// returns the connection, the answer's size next. Throws Broken (the
// server's refusal included).
std::unique_ptr<Link> open_request(const std::string& host, int port, const std::string& request,
                                   const std::string& body, const SnapshotAuth& auth,
                                   milliseconds timeout, const std::atomic<bool>* abandon);

}  // namespace snapshot_server_detail

}  // namespace ductile::agent
