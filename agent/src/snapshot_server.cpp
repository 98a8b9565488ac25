// The snapshot servers' protocol: the server of an agent's area and the
// client that copies one file. See snapshot_server.hpp.
#include "snapshot_server.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <string_view>
#include <system_error>

#include <fmt/format.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "ductile/agent/records.hpp"
#include "ductile/error.hpp"
#include "listening.hpp"
#include "snapshot_area.hpp"
#include "store_wire.hpp"

namespace ductile::agent {

// Not an anonymous namespace: a unity build puts several of the library's
// files into one translation unit, where their helpers' names would clash.
namespace snapshot_server_detail {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr char kSnapshotMagic[4] = {'D', 'S', 'N', '1'};
// A snapshot server's proof is never an agent's, nor either one the
// rendezvous' (store_wire.hpp).
constexpr std::string_view kSnapshotHostLabel = "ductile snapshot host proof v1";
constexpr std::string_view kSnapshotAgentLabel = "ductile snapshot agent proof v1";
constexpr std::uint8_t kOk = 0, kRefused = 1, kUnauthorized = 2;
constexpr std::size_t kMaxReason = 1024;
constexpr std::size_t kProofBytes = 32;  // an HMAC-SHA256
constexpr std::size_t kChunk = 1 << 20;
// How often a wait looks at `abandon`.
constexpr milliseconds kSlice{200};

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

// Why a connection ended before its end.
struct Broken {
  std::string why;
  bool missing = false;  // the server holds no such file
};

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

template <class T>
T receive_value(Link& link, milliseconds idle, Clock::time_point deadline,
                const std::atomic<bool>* abandon) {
  T value{};
  receive_exact(link, reinterpret_cast<char*>(&value), sizeof value, idle, deadline, abandon);
  return value;
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

using namespace snapshot_server_detail;

bool servable_snapshot_path(const std::string& relative) {
  if (relative.size() > kMaxSnapshotRequest) return false;
  const auto parts = split_path(relative);
  if (!std::all_of(parts.begin(), parts.end(),
                   [](const std::string& p) { return path_component(p); }))
    return false;
  if (parts.size() == 3 && parts[0] == "own")
    return snapshot_tag_step(parts[1]).has_value() && snapshot_file_name(parts[2]);
  if (parts.size() == 4 && parts[0] == "replicas")
    return valid_node_id(parts[1]) && snapshot_tag_step(parts[2]).has_value() &&
           snapshot_file_name(parts[3]);
  return false;
}

SnapshotTls::SnapshotTls(const EtcdTls& files, const std::vector<std::string>& options) {
  described_ = fmt::format(
      "this agent verifies the peer's certificate against {} and presents {} '{}' (key {} '{}')",
      files.ca_file.empty() ? "the system's CAs (no " + options.at(0) + ")"
                            : fmt::format("{} '{}'", options.at(0), files.ca_file),
      options.at(1), files.cert_file, options.at(2), files.key_file);
  ERR_clear_error();
  context_ = SSL_CTX_new(TLS_method());
  if (!context_)
    throw Error(ErrorKind::io, fmt::format("cannot make a TLS context for the snapshot copies: {}",
                                           tls_reasons(nullptr)));
  auto refuse = [&](std::size_t option, const std::string& file, const std::string& problem,
                    const std::string& valid) {
    const std::string reasons = tls_reasons(nullptr);
    SSL_CTX_free(context_);
    return Error(
        ErrorKind::invalid_argument,
        fmt::format("{} '{}' {}: {}; give {}", options.at(option), file, problem, reasons, valid));
  };
  SSL_CTX_set_min_proto_version(context_, TLS1_2_VERSION);
  // An encrypted key fails to load instead of asking for its passphrase on
  // the terminal.
  SSL_CTX_set_default_passwd_cb(context_, [](char*, int, int, void*) { return 0; });
  if (files.ca_file.empty()) {
    if (SSL_CTX_set_default_verify_paths(context_) != 1) {
      const std::string reasons = tls_reasons(nullptr);
      SSL_CTX_free(context_);
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("{} is not given and the system's CAs cannot be loaded: {}; give {} "
                              "with the PEM file of the CA that signed the agents' certificates",
                              options.at(0), reasons, options.at(0)));
    }
  } else if (SSL_CTX_load_verify_locations(context_, files.ca_file.c_str(), nullptr) != 1) {
    throw refuse(0, files.ca_file, "cannot be loaded as the job's CA",
                 "the PEM file of the CA that signed the agents' certificates");
  }
  if (SSL_CTX_use_certificate_chain_file(context_, files.cert_file.c_str()) != 1)
    throw refuse(1, files.cert_file, "cannot be loaded as this agent's certificate",
                 "a PEM certificate signed by the job's CA");
  // Checked against the certificate as it loads.
  if (SSL_CTX_use_PrivateKey_file(context_, files.key_file.c_str(), SSL_FILETYPE_PEM) != 1)
    throw refuse(
        2, files.key_file,
        fmt::format("cannot be loaded as the key of {} '{}'", options.at(1), files.cert_file),
        "the certificate's unencrypted PEM key");
  // Mutual TLS: a server asks for the client's certificate and refuses a
  // client without one. Both sides check the peer's chain against the CA,
  // and that the certificate was issued for TLS clients (what etcd asks of
  // the same certificates), whichever side presents it: an agent's one
  // certificate serves both ends. No host name is checked: agents address
  // each other by IP, and a certificate made for etcd need not name it.
  SSL_CTX_set_verify(context_, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  SSL_CTX_set_purpose(context_, X509_PURPOSE_SSL_CLIENT);
  SSL_CTX_set_mode(context_, SSL_MODE_ENABLE_PARTIAL_WRITE);
  // One file a connection: a TLS handshake is never resumed, so no cache is kept.
  SSL_CTX_set_session_cache_mode(context_, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_num_tickets(context_, 0);
}

SnapshotTls::~SnapshotTls() {
  SSL_CTX_free(context_);
}

SnapshotServer::SnapshotServer(const std::filesystem::path& area, const std::string& host,
                               SnapshotAuth auth, SnapshotMessageHandler handler)
    : auth_(std::move(auth)), handler_(std::move(handler)) {
  area_fd_ = ::open(area.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (area_fd_ < 0)
    throw Error(ErrorKind::io, fmt::format("cannot open the snapshot area '{}' to serve it: {}",
                                           area.string(), std::strerror(errno)));
  try {
    listeners_ = listen_on(host, 0);
  } catch (const std::system_error& e) {
    ::close(area_fd_);
    throw Error(ErrorKind::io, fmt::format("cannot serve the snapshot area at a port of '{}': {}",
                                           host, e.code().message()));
  }
  port_ = bound_port(listeners_.front());
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    close_all(listeners_);
    ::close(area_fd_);
    throw Error(ErrorKind::io, fmt::format("cannot make a pipe: {}", std::strerror(errno)));
  }
  thread_ = std::thread([this] { accept_loop(); });
}

SnapshotServer::~SnapshotServer() {
  {
    std::unique_lock lock(mutex_);
    stopping_ = true;
    for (const auto& entry : connections_) ::shutdown(entry.first, SHUT_RDWR);
  }
  idle_.notify_all();  // connections waiting for a slot
  const char byte = 0;
  [[maybe_unused]] const auto written = ::write(wake_[1], &byte, 1);
  thread_.join();
  {
    // The connections' threads end at once: their sockets are shut down.
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [this] { return connections_.empty(); });
  }
  close_all(listeners_);
  ::close(wake_[0]);
  ::close(wake_[1]);
  ::close(area_fd_);
}

void SnapshotServer::accept_loop() {
  std::vector<pollfd> polled;
  for (;;) {
    polled.clear();
    polled.push_back({wake_[0], POLLIN, 0});
    for (int fd : listeners_) polled.push_back({fd, POLLIN, 0});
    if (::poll(polled.data(), polled.size(), -1) < 0) continue;  // EINTR
    if (polled[0].revents) return;
    for (std::size_t i = 1; i < polled.size(); ++i) {
      if (!polled[i].revents) continue;
      sockaddr_storage peer{};
      socklen_t peer_size = sizeof peer;
      const int fd = ::accept4(polled[i].fd, reinterpret_cast<sockaddr*>(&peer), &peer_size,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        // Out of descriptors: rest a moment rather than spin on the
        // pending connection.
        if (errno == EMFILE || errno == ENFILE) ::poll(nullptr, 0, 100);
        continue;
      }
      std::unique_lock lock(mutex_);
      if (stopping_) {
        ::close(fd);
        continue;
      }
      const std::string address = peer_address(peer);
      cut_oldest_unproven(address);
      connections_[fd] = Connection{address, ++accepted_};
      std::thread([this, fd] {
        bool was_served = false;
        {
          Link link(fd, false);
          serve(link, fd);
          // Still listed meanwhile: a stopping server cuts the drain short.
          link.drain_before_close();
        }
        std::unique_lock lock(mutex_);
        const auto at = connections_.find(fd);
        was_served = at->second.proven;
        connections_.erase(at);
        if (was_served) --served_;
        ::close(fd);
        idle_.notify_all();
      }).detach();
    }
  }
}

void SnapshotServer::cut_oldest_unproven(const std::string& address) {
  std::size_t unproven = 0, from_address = 0;
  auto oldest = connections_.end(), oldest_of_address = connections_.end();
  for (auto it = connections_.begin(); it != connections_.end(); ++it) {
    if (it->second.proven || it->second.cut) continue;
    ++unproven;
    if (oldest == connections_.end() || it->second.order < oldest->second.order) oldest = it;
    if (it->second.address != address) continue;
    ++from_address;
    if (oldest_of_address == connections_.end() ||
        it->second.order < oldest_of_address->second.order)
      oldest_of_address = it;
  }
  auto cut = connections_.end();
  if (from_address >= kMaxSnapshotUnprovenPerAddress)
    cut = oldest_of_address;
  else if (unproven >= kMaxSnapshotUnproven)
    cut = oldest;
  if (cut == connections_.end()) return;
  // Its thread ends at once, its socket shut down; listed until then, it
  // counts no more.
  ::shutdown(cut->first, SHUT_RDWR);
  cut->second.cut = true;
}

bool SnapshotServer::admit(int fd) {
  std::unique_lock lock(mutex_);
  if (waiting_ >= kMaxSnapshotWaiting) return false;
  ++waiting_;
  const bool slot = idle_.wait_for(lock, kSnapshotIdleTimeout, [this] {
    return stopping_ || served_ < kMaxSnapshotConnections;
  });
  --waiting_;
  if (!slot || stopping_) return false;
  ++served_;
  connections_.at(fd).proven = true;
  return true;
}

void SnapshotServer::serve(Link& link, int fd) {
  const milliseconds idle = kSnapshotIdleTimeout;
  // The handshake and the request come within the proof's time.
  const auto handshake_deadline = Clock::now() + wire::kProofTimeout;
  const auto no_deadline = Clock::time_point::max();
  try {
    if (auth_.tls) link.start_tls(*auth_.tls, true, idle, handshake_deadline, nullptr);
    char magic[sizeof kSnapshotMagic];
    receive_exact(link, magic, sizeof magic, idle, handshake_deadline, nullptr);
    if (std::memcmp(magic, kSnapshotMagic, sizeof magic) != 0) return;
    const std::string client_nonce =
        receive_string(link, wire::kNonceBytes, idle, handshake_deadline, nullptr);
    std::string hello;
    std::string host_nonce;
    if (auth_.secret.empty()) {
      wire::put<std::uint8_t>(hello, 0);
    } else {
      host_nonce = wire::random_nonce();
      wire::put<std::uint8_t>(hello, 1);
      hello += host_nonce;
      hello += wire::proof(auth_.secret, kSnapshotHostLabel, client_nonce, host_nonce);
    }
    send_all(link, hello, idle, handshake_deadline, nullptr);
    const auto proving = receive_value<std::uint8_t>(link, idle, handshake_deadline, nullptr);
    if (proving > 1) return;
    std::string given;
    if (proving == 1) given = receive_string(link, kProofBytes, idle, handshake_deadline, nullptr);
    if (!auth_.secret.empty()) {
      if (proving == 0) {
        send_all(link,
                 refusal(kUnauthorized,
                         "this snapshot server serves the agents of its job only, and this agent "
                         "gave no proof of the job's secret: give every agent of the job the "
                         "same DUCTILE_RDZV_SECRET or DUCTILE_RDZV_SECRET_FILE"),
                 idle, no_deadline, nullptr);
        return;
      }
      if (!wire::same_proof(
              given, wire::proof(auth_.secret, kSnapshotAgentLabel, host_nonce, client_nonce))) {
        send_all(link,
                 refusal(kUnauthorized,
                         "the snapshot server refused this agent's proof of the secret: the "
                         "secrets differ (every agent of the job needs the same "
                         "DUCTILE_RDZV_SECRET or DUCTILE_RDZV_SECRET_FILE)"),
                 idle, no_deadline, nullptr);
        return;
      }
    }
    const auto size = receive_value<std::uint32_t>(link, idle, handshake_deadline, nullptr);
    if (size > kMaxSnapshotRequest) {
      send_all(link,
               refusal(kRefused, fmt::format("a request of {} bytes, over the {} allowed", size,
                                             kMaxSnapshotRequest)),
               idle, no_deadline, nullptr);
      return;
    }
    const std::string relative = receive_string(link, size, idle, handshake_deadline, nullptr);
    if (!admit(fd)) {
      send_all(link,
               refusal(kRefused, fmt::format("the snapshot server is busy: {} copies served at "
                                             "once and more waiting; try again",
                                             kMaxSnapshotConnections)),
               idle, no_deadline, nullptr);
      return;
    }
    if (relative.starts_with("notify/") || relative.starts_with("have/")) {
      const std::string why = take_message(link, relative);
      if (why.empty()) {
        std::string taken;
        wire::put(taken, kOk);
        wire::put(taken, std::uint64_t{0});
        send_all(link, taken, idle, no_deadline, nullptr);
      } else {
        send_all(link, refusal(kRefused, why), idle, no_deadline, nullptr);
      }
      return;
    }
    if (!servable_snapshot_path(relative)) {
      send_all(
          link,
          refusal(kRefused, fmt::format("'{}' is not a snapshot file: give own/<tag>/<file> or "
                                        "replicas/<node>/<tag>/<file>",
                                        excerpt(relative))),
          idle, no_deadline, nullptr);
      return;
    }
    struct stat info{};
    std::string why;
    const int file = open_below(area_fd_, relative, info, why);
    if (file < 0) {
      send_all(link, refusal(kRefused, fmt::format("'{}': {}", relative, why)), idle, no_deadline,
               nullptr);
      return;
    }
    std::string head;
    wire::put(head, kOk);
    wire::put(head, static_cast<std::uint64_t>(info.st_size));
    try {
      send_all(link, head, idle, no_deadline, nullptr);
      // Its size as it was when opened: a file that shrinks since ends the
      // connection early, and the client refuses the copy.
      std::string buffer(kChunk, '\0');
      for (off_t offset = 0; offset < info.st_size;) {
        const auto want = static_cast<std::size_t>(
            std::min<off_t>(static_cast<off_t>(buffer.size()), info.st_size - offset));
        const ssize_t n = ::pread(file, buffer.data(), want, offset);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        link.send_all(buffer.data(), static_cast<std::size_t>(n), idle, no_deadline, nullptr);
        offset += n;
      }
    } catch (const Broken&) {
      ::close(file);
      return;
    }
    ::close(file);
  } catch (const Broken&) {
    // A client gone, silent too long, or cut at shutdown: its connection
    // ends, nothing else does.
  } catch (const wire::BadMessage&) {
  }
}

std::string SnapshotServer::take_message(Link& link, const std::string& request) {
  const auto parts = split_path(request);
  const bool notify = parts[0] == "notify";
  const std::size_t names = notify ? 4 : 5;
  const auto usage = [&] {
    return fmt::format(
        "'{}' is not a snapshot message: give notify/<origin>/<tag>/<sha256> or "
        "have/<holder>/<origin>/<tag>/<sha256> (node ids, a tag step<N>, 64 lowercase hex digits)",
        excerpt(request));
  };
  if (parts.size() != names || !std::all_of(parts.begin(), parts.end(),
                                            [](const std::string& p) { return path_component(p); }))
    return usage();
  SnapshotMessage message;
  message.kind = notify ? SnapshotMessage::Kind::notify : SnapshotMessage::Kind::have;
  std::size_t at = 1;
  if (!notify) message.holder = parts[at++];
  message.origin = parts[at++];
  message.tag = parts[at++];
  message.sha256 = parts[at++];
  const bool hex = message.sha256.size() == 64 &&
                   std::all_of(message.sha256.begin(), message.sha256.end(), [](char c) {
                     return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
                   });
  if (!valid_node_id(message.origin) || (!notify && !valid_node_id(message.holder)) ||
      !snapshot_tag_step(message.tag) || !hex)
    return usage();
  if (notify) {
    const milliseconds idle = kSnapshotIdleTimeout;
    const auto deadline = Clock::now() + wire::kProofTimeout;
    const auto size = receive_value<std::uint32_t>(link, idle, deadline, nullptr);
    if (size > kMaxNotifyBody)
      return fmt::format("a notify's file list of {} bytes, over the {} allowed", size,
                         kMaxNotifyBody);
    const std::string body = receive_string(link, size, idle, deadline, nullptr);
    std::set<std::string> seen;
    for (std::size_t from = 0; from < body.size();) {
      const auto end = body.find('\n', from);
      if (end == std::string::npos) return "a notify's file list must end each name with a newline";
      std::string name = body.substr(from, end - from);
      if (!snapshot_file_name(name) || !seen.insert(name).second)
        return fmt::format(
            "'{}' in a notify's file list is not a snapshot file (manifest.json, its sidecars, "
            "rank<r>-of-<W>.bin), or is listed twice",
            excerpt(name));
      message.files.push_back(std::move(name));
      from = end + 1;
    }
    if (!seen.count(kSnapshotManifest)) return "a notify's file list must name manifest.json";
  }
  if (!handler_) return "this snapshot server takes no messages";
  return handler_(message);
}

std::uintmax_t fetch_file(const std::string& host, int port, const std::string& relative,
                          const std::filesystem::path& dest, const SnapshotAuth& auth,
                          milliseconds timeout, std::optional<std::uintmax_t> expected_size,
                          std::uintmax_t max_size, const std::atomic<bool>* abandon) {
  const std::string where =
      fmt::format("'{}' from the snapshot server at {}:{}", relative, host, port);
  auto fail = [&](const std::string& why, bool missing = false) -> Error {
    return Error(missing ? ErrorKind::not_found : ErrorKind::io,
                 fmt::format("cannot copy {} to '{}': {}", where, dest.string(), why));
  };
  if (relative.size() > kMaxSnapshotRequest) throw fail("the path is too long");
  const auto no_deadline = Clock::time_point::max();
  std::unique_ptr<Link> link;
  int out = -1;
  bool created = false;  // only a copy this call created is removed (O_EXCL)
  try {
    link = open_request(host, port, relative, "", auth, timeout, abandon);
    const auto size = receive_value<std::uint64_t>(*link, timeout, no_deadline, abandon);
    if (expected_size && size != *expected_size)
      throw Broken{fmt::format("it has {} bytes, not the {} expected", size, *expected_size)};
    if (size > max_size)
      throw Broken{
          fmt::format("it has {} bytes, more than the {} such a file may have", size, max_size)};
    out = ::open(dest.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (out < 0) throw Broken{fmt::format("cannot create the copy: {}", std::strerror(errno))};
    created = true;
    std::string buffer(static_cast<std::size_t>(std::min<std::uint64_t>(size, kChunk)) + 1, '\0');
    for (std::uint64_t left = size; left > 0;) {
      const std::size_t n = link->receive_some(
          buffer.data(), static_cast<std::size_t>(std::min<std::uint64_t>(left, kChunk)), timeout,
          no_deadline, abandon);
      for (std::size_t done = 0; done < n;) {
        const ssize_t w = ::write(out, buffer.data() + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) throw Broken{fmt::format("cannot write the copy: {}", std::strerror(errno))};
        done += static_cast<std::size_t>(w);
      }
      left -= n;
    }
    if (::close(out) != 0) {
      out = -1;
      throw Broken{fmt::format("cannot write the copy: {}", std::strerror(errno))};
    }
    out = -1;
    return size;
  } catch (const Broken& e) {
    if (out >= 0) ::close(out);
    if (created) ::unlink(dest.c_str());
    throw fail(e.why, e.missing);
  } catch (const wire::BadMessage& e) {
    if (out >= 0) ::close(out);
    if (created) ::unlink(dest.c_str());
    throw fail(e.what());
  }
}

void send_snapshot_message(const std::string& host, int port, const SnapshotMessage& message,
                           const SnapshotAuth& auth, milliseconds timeout,
                           const std::atomic<bool>* abandon) {
  const bool notify = message.kind == SnapshotMessage::Kind::notify;
  const std::string request =
      notify ? fmt::format("notify/{}/{}/{}", message.origin, message.tag, message.sha256)
             : fmt::format("have/{}/{}/{}/{}", message.holder, message.origin, message.tag,
                           message.sha256);
  std::string body;
  if (notify)
    for (const auto& file : message.files) body += file + "\n";
  const auto no_deadline = Clock::time_point::max();
  std::unique_ptr<Link> link;
  try {
    link = open_request(host, port, request, body, auth, timeout, abandon);
    if (receive_value<std::uint64_t>(*link, timeout, no_deadline, abandon) != 0)
      throw Broken{"it does not speak the snapshot protocol"};
  } catch (const Broken& e) {
    throw Error(ErrorKind::io, fmt::format("cannot send '{}' to the snapshot server at {}:{}: {}",
                                           request, host, port, e.why));
  } catch (const wire::BadMessage& e) {
    throw Error(ErrorKind::io, fmt::format("cannot send '{}' to the snapshot server at {}:{}: {}",
                                           request, host, port, e.what()));
  }
}

}  // namespace ductile::agent
