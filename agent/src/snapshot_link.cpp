// The snapshot servers' transport. See snapshot_link.hpp.
#include "snapshot_link.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "ductile/error.hpp"
#include "listening.hpp"
#include "snapshot_area.hpp"
#include "store_wire.hpp"

namespace ductile::agent {

namespace snapshot_server_detail {

// The IP address of a peer, as text ("" when it is of no IP family).
std::string peer_address(const sockaddr_storage& peer) {
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw = nullptr;
  if (peer.ss_family == AF_INET)
    raw = &reinterpret_cast<const sockaddr_in&>(peer).sin_addr;
  else if (peer.ss_family == AF_INET6)
    raw = &reinterpret_cast<const sockaddr_in6&>(peer).sin6_addr;
  if (!raw || !::inet_ntop(peer.ss_family, raw, text, sizeof text)) return {};
  return text;
}

// Waits for `events` on `fd`: at most `idle`, and until `deadline`, while
// `abandon` is not set.
void wait_for(int fd, short events, milliseconds idle, Clock::time_point deadline,
              const std::atomic<bool>* abandon) {
  const auto until = std::min(Clock::now() + idle, deadline);
  for (;;) {
    if (abandon && abandon->load()) throw Broken{"abandoned"};
    const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now());
    if (left.count() <= 0) throw Broken{"timed out"};
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min(left, kSlice).count()));
    if (n < 0 && errno != EINTR) throw Broken{std::strerror(errno)};
    if (n > 0) return;
  }
}

// A socket BIO whose writes never raise SIGPIPE (send with MSG_NOSIGNAL,
// as the plain connections do): the library cannot count on the process
// ignoring it. OpenSSL's socket BIO does the rest.
int send_without_sigpipe(BIO* bio, const char* data, int size) {
  BIO_clear_retry_flags(bio);
  int fd = -1;
  BIO_get_fd(bio, &fd);
  const ssize_t n = ::send(fd, data, static_cast<std::size_t>(size), MSG_NOSIGNAL);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
    BIO_set_retry_write(bio);
  return static_cast<int>(n);
}

BIO_METHOD* socket_without_sigpipe() {
  static BIO_METHOD* const method = [] {
    const BIO_METHOD* socket = BIO_s_socket();
    BIO_METHOD* m = BIO_meth_new(BIO_TYPE_SOCKET, "socket without SIGPIPE");
    if (!m) return m;
    BIO_meth_set_write(m, send_without_sigpipe);
    BIO_meth_set_read(m, BIO_meth_get_read(socket));
    BIO_meth_set_puts(m, BIO_meth_get_puts(socket));
    BIO_meth_set_ctrl(m, BIO_meth_get_ctrl(socket));
    BIO_meth_set_create(m, BIO_meth_get_create(socket));
    BIO_meth_set_destroy(m, BIO_meth_get_destroy(socket));
    return m;
  }();
  return method;
}

// OpenSSL's reasons for this thread's last failure (its queue emptied),
// with the check of the peer's certificate when that failed.
std::string tls_reasons(const SSL* ssl) {
  std::string reasons;
  while (const unsigned long error = ERR_get_error()) {
    const char* reason = ERR_reason_error_string(error);
    const std::string text = reason ? reason : fmt::format("error {:x}", error);
    if (reasons.find(text) == std::string::npos) reasons += (reasons.empty() ? "" : "; ") + text;
  }
  if (ssl && SSL_get_verify_result(ssl) != X509_V_OK)
    reasons += fmt::format(" (the peer's certificate: {})",
                           X509_verify_cert_error_string(SSL_get_verify_result(ssl)));
  return reasons.empty() ? "no reason given" : reasons;
}

void send_all(Link& link, const std::string& data, milliseconds idle, Clock::time_point deadline,
              const std::atomic<bool>* abandon) {
  link.send_all(data.data(), data.size(), idle, deadline, abandon);
}

void receive_exact(Link& link, char* data, std::size_t size, milliseconds idle,
                   Clock::time_point deadline, const std::atomic<bool>* abandon) {
  while (size > 0) {
    const std::size_t n = link.receive_some(data, size, idle, deadline, abandon);
    data += n;
    size -= n;
  }
}

std::string receive_string(Link& link, std::size_t size, milliseconds idle,
                           Clock::time_point deadline, const std::atomic<bool>* abandon) {
  std::string out(size, '\0');
  receive_exact(link, out.data(), size, idle, deadline, abandon);
  return out;
}

bool path_component(std::string_view part) {
  return !part.empty() && part != "." && part != ".." && part.size() <= 255 &&
         std::all_of(part.begin(), part.end(), [](char c) {
           return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '_' || c == '-';
         });
}

std::vector<std::string> split_path(const std::string& relative) {
  std::vector<std::string> parts;
  std::size_t from = 0;
  for (;;) {
    const auto slash = relative.find('/', from);
    parts.push_back(relative.substr(from, slash - from));
    if (slash == std::string::npos) return parts;
    from = slash + 1;
  }
}

// The file below the area, each directory opened without following a
// link, the file itself too and without blocking (a FIFO); a regular file
// only. Returns the descriptor, or -1 and why.
int open_below(int area_fd, const std::string& relative, struct stat& info, std::string& why) {
  const auto parts = split_path(relative);
  int dir = area_fd;
  for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
    const int next =
        ::openat(dir, parts[i].c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    const int error = errno;
    if (dir != area_fd) ::close(dir);
    if (next < 0) {
      why = error == ELOOP || error == ENOTDIR ? fmt::format("'{}' is not a directory", parts[i])
                                               : std::strerror(error);
      return -1;
    }
    dir = next;
  }
  const int fd =
      ::openat(dir, parts.back().c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  const int error = errno;
  if (dir != area_fd) ::close(dir);
  if (fd < 0) {
    why = error == ELOOP ? "a symbolic link" : std::strerror(error);
    return -1;
  }
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    why = "not a regular file";
    return -1;
  }
  return fd;
}

std::string refusal(std::uint8_t status, const std::string& why) {
  std::string out;
  wire::put(out, status);
  const std::string text = why.substr(0, kMaxReason);
  wire::put(out, static_cast<std::uint32_t>(text.size()));
  out += text;
  return out;
}

// A connected non-blocking socket to host:port, or Broken.
int connect_to(const std::string& host, int port, milliseconds timeout,
               const std::atomic<bool>* abandon) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) throw Broken{fmt::format("cannot resolve it: {}", ::gai_strerror(rc))};
  std::string last = "no address";
  for (addrinfo* a = found; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last = std::strerror(errno);
      continue;
    }
    try {
      if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
        if (errno != EINPROGRESS) throw Broken{std::strerror(errno)};
        wait_for(fd, POLLOUT, timeout, Clock::now() + timeout, abandon);
        int error = 0;
        socklen_t size = sizeof error;
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size);
        if (error != 0) throw Broken{std::strerror(error)};
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      ::freeaddrinfo(found);
      return fd;
    } catch (const Broken& e) {
      ::close(fd);
      last = e.why;
      if (last == "abandoned") break;
    }
  }
  ::freeaddrinfo(found);
  throw Broken{fmt::format("cannot connect: {}", last)};
}

// Connects to the server at host:port (over TLS when `auth` has it),
// proves its secret, sends `request` (a file's path or a message) and
// `body` when not empty (its 32-bit length first), and reads the status:
// returns the connection, the answer's size next. Throws Broken (the
// server's refusal included).
std::unique_ptr<Link> open_request(const std::string& host, int port, const std::string& request,
                                   const std::string& body, const SnapshotAuth& auth,
                                   milliseconds timeout, const std::atomic<bool>* abandon) {
  const auto no_deadline = Clock::time_point::max();
  const std::string& secret = auth.secret;
  auto link = std::make_unique<Link>(connect_to(host, port, timeout, abandon), true);
  if (auth.tls) link->start_tls(*auth.tls, false, timeout, no_deadline, abandon);
  const std::string client_nonce = wire::random_nonce();
  std::string hello(kSnapshotMagic, sizeof kSnapshotMagic);
  hello += client_nonce;
  send_all(*link, hello, timeout, no_deadline, abandon);
  const auto has_secret = receive_value<std::uint8_t>(*link, timeout, no_deadline, abandon);
  std::string sent;
  if (has_secret == 1) {
    const std::string host_nonce =
        receive_string(*link, wire::kNonceBytes, timeout, no_deadline, abandon);
    const std::string host_proof =
        receive_string(*link, kProofBytes, timeout, no_deadline, abandon);
    if (secret.empty())
      throw Broken{
          "the server asks for the job's secret and this agent has none: the secrets differ "
          "(every agent of the job needs the same DUCTILE_RDZV_SECRET or "
          "DUCTILE_RDZV_SECRET_FILE, or none)"};
    if (!wire::same_proof(host_proof,
                          wire::proof(secret, kSnapshotHostLabel, client_nonce, host_nonce)))
      throw Broken{
          "the server's proof of the secret does not match this agent's: the secrets differ "
          "(every agent of the job needs the same DUCTILE_RDZV_SECRET or "
          "DUCTILE_RDZV_SECRET_FILE)"};
    wire::put<std::uint8_t>(sent, 1);
    sent += wire::proof(secret, kSnapshotAgentLabel, host_nonce, client_nonce);
  } else if (has_secret == 0) {
    if (!secret.empty())
      throw Broken{
          "the server has no secret and this agent has one: the secrets differ (every agent of "
          "the job needs the same DUCTILE_RDZV_SECRET or DUCTILE_RDZV_SECRET_FILE, or none)"};
    wire::put<std::uint8_t>(sent, 0);
  } else {
    throw Broken{"it does not speak the snapshot protocol"};
  }
  wire::put(sent, static_cast<std::uint32_t>(request.size()));
  sent += request;
  if (!body.empty()) {
    wire::put(sent, static_cast<std::uint32_t>(body.size()));
    sent += body;
  }
  send_all(*link, sent, timeout, no_deadline, abandon);
  const auto status = receive_value<std::uint8_t>(*link, timeout, no_deadline, abandon);
  if (status != kOk) {
    const auto size = receive_value<std::uint32_t>(*link, timeout, no_deadline, abandon);
    if (size > kMaxReason || (status != kRefused && status != kUnauthorized))
      throw Broken{"it does not speak the snapshot protocol"};
    const std::string reason = receive_string(*link, size, timeout, no_deadline, abandon);
    // The server's answer for a file its area does not hold (serve()).
    const bool missing =
        status == kRefused && reason == fmt::format("'{}': {}", request, std::strerror(ENOENT));
    throw Broken{fmt::format("the server refused it: {}", reason), missing};
  }
  return link;
}

}  // namespace snapshot_server_detail

}  // namespace ductile::agent
