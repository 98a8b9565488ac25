// The snapshot servers' protocol: the server of an agent's area and the
// client that copies one file. See snapshot_server.hpp.
#include "snapshot_server.hpp"

#include "snapshot_link.hpp"

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
