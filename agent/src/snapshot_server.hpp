// The snapshot servers: each agent serves the files of its snapshot area
// (snapshot_area.hpp) to the other agents of its job, which copy them
// (replicas, a restore) with fetch_file(). Internal to libductile_agent.
//
// The protocol, one file a connection. The client sends "DSN1" and a
// random nonce of wire::kNonceBytes; the server answers a byte, 1 when it
// has the job's secret (then its own nonce and its proof,
// HMAC-SHA256(secret, snapshot host label, client nonce, server nonce)) or
// 0. The client checks the proof and sends a byte, 1 and its proof
// (HMAC-SHA256(secret, snapshot agent label, server nonce, client nonce))
// or 0 without a secret, then the file's path in the area as a 32-bit
// length and its bytes ("own/<tag>/<file>" or
// "replicas/<node>/<tag>/<file>"). The server answers a status byte: 0 and
// the file's size (64-bit) then its bytes; else a 32-bit length and why,
// and closes. Integers in the host's byte order, as the agents' protocol
// (store_wire.hpp) sends them. A secret on one side only, or two secrets
// that differ: refused, by the side that finds out.
//
// Two messages take the place of a file's path, after the same handshake,
// and are answered with the same status (0 and a size of 0 when taken):
//   "notify/<origin>/<tag>/<sha256>", then a 32-bit length (at most
//     kMaxNotifyBody) and the snapshot's file names, each ended by '\n':
//     node <origin> committed its snapshot <tag>, whose manifest's SHA-256
//     is <sha256>; sent by the origin to the members that keep replicas
//     of it, which pull it at once.
//   "have/<holder>/<origin>/<tag>/<sha256>": node <holder> holds a
//     complete replica of that snapshot; sent by the holder to the origin.
// The server checks the names (node ids, a snapshot tag, 64 lowercase hex
// digits, snapshot file names, each once) and hands the message to its
// handler, which must return at once (it never copies anything on the
// connection's thread: two agents copying from each other would wait on
// each other).
//
// A job whose rendezvous uses TLS with client certificates (an https etcd
// with --rdzv-cert and --rdzv-key) runs the same protocol inside TLS: the
// server presents the agent's certificate and requires one of the client,
// each side verifying the other's chain against the job's CA
// (--rdzv-cacert; the system's CAs without it) (SnapshotTls).
//
// Served: regular files only, reached without following a link (each
// component opened with O_NOFOLLOW below the area), names as a save
// writes them. Bounded: a request of at most kMaxSnapshotRequest bytes,
// the handshake and the request within wire::kProofTimeout,
// kSnapshotIdleTimeout without progress.
//
// No stranger starves the job's agents of the server: every connection is
// accepted at once, and one that has not yet sent its request (with the
// job's proof, when the job has a secret) is "unproven". At most
// kMaxSnapshotUnproven of those are kept, kMaxSnapshotUnprovenPerAddress
// from one address; a connection past either bound takes the place of the
// oldest unproven one (of its address, for the second), which is cut. So
// idle connections, however many, hold a member's request up by no more
// than its own handshake: the member's connection cuts the oldest of them.
// Proven connections are never cut for a newcomer; kMaxSnapshotConnections
// of them are served at once, and up to kMaxSnapshotWaiting more wait
// (within kSnapshotIdleTimeout) for one of them to end.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ductile/agent/etcd_store.hpp"
#include "snapshot_plan.hpp"

struct ssl_ctx_st;  // OpenSSL's SSL_CTX

namespace ductile::agent {

namespace snapshot_server_detail {
class Link;  // one connection, plain or TLS
}

inline constexpr std::size_t kMaxSnapshotRequest = 4096;
inline constexpr std::chrono::seconds kSnapshotIdleTimeout{30};
inline constexpr std::size_t kMaxSnapshotConnections = 16;
inline constexpr std::size_t kMaxSnapshotWaiting = 256;
inline constexpr std::size_t kMaxSnapshotUnproven = 32;
inline constexpr std::size_t kMaxSnapshotUnprovenPerAddress = 8;

// True for a path the server serves: "own/<tag>/<file>" or
// "replicas/<node>/<tag>/<file>" with a snapshot tag, a node id and a
// snapshot file's name.
bool servable_snapshot_path(const std::string& relative);

// The longest body of a notify: every file name a snapshot may have.
inline constexpr std::size_t kMaxNotifyBody = kMaxSnapshotFiles * (kMaxSnapshotFileChars + 1);

// A message between two agents' snapshot areas (see above).
struct SnapshotMessage {
  enum class Kind { notify, have };
  Kind kind = Kind::notify;
  std::string origin;  // the node whose workers wrote the snapshot
  std::string holder;  // have: the node holding its replica
  std::string tag;
  std::string sha256;
  std::vector<std::string> files;  // notify: the snapshot's files
};

// What the server does with a message: empty when taken (or ignored),
// else why it is refused (sent back to the sender). Called on a
// connection's thread; must not block.
using SnapshotMessageHandler = std::function<std::string(const SnapshotMessage&)>;

// The TLS of the snapshot copies: the job's CA, this agent's certificate
// and key, loaded once. Each side verifies the other's certificate chain
// against the CA and accepts a certificate issued for TLS clients (the
// purpose etcd asks of the agents' certificates), whichever side presents
// it; not the host name: the agents address each other by IP, which their
// certificates need not name. Ownership: owns its OpenSSL context.
// Threading: immutable once made; its connections may run on any threads.
// Errors: the constructor throws ductile::Error (invalid_argument) naming
// the option, the file and OpenSSL's reason when one cannot be loaded or
// the key is not the certificate's.
class SnapshotTls {
 public:
  // `files`: the certificate and its key set; the CA empty: the system's
  // CAs verify the peers. `options`: their options' names for messages, as
  // {"--rdzv-cacert", "--rdzv-cert", "--rdzv-key"}.
  SnapshotTls(const EtcdTls& files, const std::vector<std::string>& options);
  ~SnapshotTls();
  SnapshotTls(const SnapshotTls&) = delete;
  SnapshotTls& operator=(const SnapshotTls&) = delete;
  ssl_ctx_st* context() const { return context_; }
  // The files, named by their options, for a failed handshake's message.
  const std::string& described() const { return described_; }

 private:
  ssl_ctx_st* context_ = nullptr;
  std::string described_;
};

// How the agents of a job know each other: the job's secret (empty: none)
// and, for a job over TLS, its TLS (null: plain TCP). Implicit from a
// secret alone.
struct SnapshotAuth {
  SnapshotAuth(std::string job_secret = {}, std::shared_ptr<const SnapshotTls> job_tls = nullptr)
      : secret(std::move(job_secret)), tls(std::move(job_tls)) {}
  SnapshotAuth(const char* job_secret) : secret(job_secret) {}
  std::string secret;
  std::shared_ptr<const SnapshotTls> tls;
};

// Ownership: owns its listening sockets, its thread and its connections'
// threads; holds the area's directory open (it must outlive nothing: a
// removed area serves nothing). Threading: its own threads; construct and
// destroy on one thread. Errors: the constructor throws ductile::Error
// (io) when the area cannot be opened or no port bound.
class SnapshotServer {
 public:
  // Serves `area` on a free port of `host`'s addresses (listen_on);
  // `auth`'s secret empty: no proof asked; its TLS set: TLS clients with
  // a certificate of the job's CA only. `handler`: the messages' (none:
  // they are refused).
  SnapshotServer(const std::filesystem::path& area, const std::string& host, SnapshotAuth auth,
                 SnapshotMessageHandler handler = {});
  // Stops serving: open connections are cut.
  ~SnapshotServer();
  SnapshotServer(const SnapshotServer&) = delete;
  SnapshotServer& operator=(const SnapshotServer&) = delete;
  int port() const { return port_; }

 private:
  // A connection served by its own thread.
  struct Connection {
    std::string address;      // the peer's IP address
    std::uint64_t order = 0;  // accepted as the order-th: the oldest has the lowest
    bool proven = false;      // its request came (with the proof the job asks)
    bool cut = false;         // shut down to make room for a newcomer
  };

  void accept_loop();
  // Makes room for an unproven connection from `address`: cuts the oldest
  // unproven one of that address, or of all, when a bound is reached.
  // Called with mutex_ held.
  void cut_oldest_unproven(const std::string& address);
  // The connection `fd` sent its request: no longer unproven; waits for one
  // of the kMaxSnapshotConnections served at once. False when it should end
  // (no slot within kSnapshotIdleTimeout, too many waiting, or stopping).
  bool admit(int fd);
  void serve(snapshot_server_detail::Link& link, int fd);
  // The answer to a message whose request line is `request`: its body (a
  // notify's) read from `link`.
  std::string take_message(snapshot_server_detail::Link& link, const std::string& request);

  const SnapshotAuth auth_;
  const SnapshotMessageHandler handler_;
  int area_fd_ = -1;
  std::vector<int> listeners_;
  int wake_[2] = {-1, -1};  // a pipe: written to stop the accept loop
  int port_ = 0;
  std::mutex mutex_;
  std::condition_variable idle_;           // a connection ended or left the served ones
  std::map<int, Connection> connections_;  // open, by socket
  std::uint64_t accepted_ = 0;
  std::size_t served_ = 0;   // proven connections being served
  std::size_t waiting_ = 0;  // proven connections waiting to be served
  bool stopping_ = false;
  std::thread thread_;
};

// Copies the file `relative` of the area served at host:port to `dest`
// (created, never replaced: O_EXCL), proving `auth`'s secret when there is
// one, over TLS when it has TLS.
// The size the server announces must be `expected_size` when given and at
// most `max_size`; the bytes received must be as many. `timeout`: the
// longest wait without progress (connecting included); `abandon`, when
// set, stops the copy within a fraction of a second. Returns the size.
// Throws ductile::Error naming the server, the file and the problem (dest
// is then removed): not_found when the server answered that its area
// holds no such file, else io.
std::uintmax_t fetch_file(const std::string& host, int port, const std::string& relative,
                          const std::filesystem::path& dest, const SnapshotAuth& auth,
                          std::chrono::milliseconds timeout,
                          std::optional<std::uintmax_t> expected_size = std::nullopt,
                          std::uintmax_t max_size = UINTMAX_MAX,
                          const std::atomic<bool>* abandon = nullptr);

// Sends `message` to the snapshot server at host:port and waits for its
// answer (`timeout`: the longest wait without progress). Throws
// ductile::Error (io) naming the server and why (its refusal included).
void send_snapshot_message(const std::string& host, int port, const SnapshotMessage& message,
                           const SnapshotAuth& auth, std::chrono::milliseconds timeout,
                           const std::atomic<bool>* abandon = nullptr);

}  // namespace ductile::agent
