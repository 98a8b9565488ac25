#include "mpi_join.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "mpi_lifetime.hpp"

namespace ductile::accel {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::uint32_t kHelloMagic = 0x444a4e31;  // "DJN1"
constexpr std::uint32_t kStatusPort = 0, kStatusRefused = 1;

class Socket {
 public:
  explicit Socket(int fd = -1) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Socket& operator=(Socket&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  int fd() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_;
};

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

// Waits for `events` on `fd` until the deadline; false on timeout or error.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int n = poll(&p, 1, remaining_ms(deadline));
    if (n > 0) return true;
    if (n == 0 || errno != EINTR) return false;
  }
}

bool read_all(int fd, void* data, std::size_t bytes, Clock::time_point deadline) {
  auto* out = static_cast<char*>(data);
  while (bytes > 0) {
    if (!wait_for(fd, POLLIN, deadline)) return false;
    ssize_t n = recv(fd, out, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    out += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

bool write_all(int fd, const void* data, std::size_t bytes) {
  const auto* in = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = send(fd, in, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    in += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

bool send_message(int fd, std::uint32_t status, const std::string& text) {
  std::uint32_t header[2] = {htonl(status), htonl(static_cast<std::uint32_t>(text.size()))};
  return write_all(fd, header, sizeof header) && write_all(fd, text.data(), text.size());
}

// Tells every rank that reached rank 0 why the join failed.
void refuse_all(std::vector<Socket>& peers, const std::string& why) {
  for (auto& p : peers)
    if (p) send_message(p.fd(), kStatusRefused, why);
}

std::string mpi_failure(const char* call, int code) {
  return std::string(call) + " failed: " + mpi_error_string(code);
}

// Replaces `group` by the merge of `inter` (freed), `high` ordering the
// remote side first or last; errors come back as codes on the result too.
int merge_into(MPI_Comm& inter, bool high, MPI_Comm& group) {
  MPI_Comm merged = MPI_COMM_NULL;
  int rc = MPI_Intercomm_merge(inter, high ? 1 : 0, &merged);
  MPI_Comm_free(&inter);
  if (rc != MPI_SUCCESS) return rc;
  MPI_Comm_set_errhandler(merged, MPI_ERRORS_RETURN);
  if (group != MPI_COMM_NULL) MPI_Comm_free(&group);
  group = merged;
  return MPI_SUCCESS;
}

// The group accepts the next joiner through `port` (collective over group).
int accept_one(const char* port, MPI_Comm& group) {
  MPI_Comm inter = MPI_COMM_NULL;
  int rc = MPI_Comm_accept(port, MPI_INFO_NULL, 0, group, &inter);
  if (rc != MPI_SUCCESS) return rc;
  return merge_into(inter, false, group);
}

// Rank 0: waits for the hello of every other rank; their sockets by rank.
bool gather_joiners(JoinRequest& r, Clock::time_point deadline, std::vector<Socket>& peers,
                    std::string& error) {
  if (r.listener < 0 && !listen_for_joiners(r, error)) return false;
  Socket listener(std::exchange(r.listener, -1));
  peers.resize(static_cast<std::size_t>(r.size));
  int joined = 1;
  auto refuse = [&](const std::string& why) {
    refuse_all(peers, why);
    error = why;
    return false;
  };
  while (joined < r.size) {
    if (!wait_for(listener.fd(), POLLIN, deadline))
      return refuse(std::to_string(r.size - joined) + " of the " + std::to_string(r.size) +
                    " ranks did not reach rank 0 at port " + std::to_string(r.port) + " within " +
                    std::to_string(static_cast<int>(r.timeout_seconds)) +
                    " s (DUCTILE_MPI_JOIN_TIMEOUT)");
    Socket peer(accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!peer) continue;
    std::uint32_t hello[3];
    // A connection that says nothing in time, or not our greeting, is not
    // one of the job's processes: drop it.
    auto hello_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(10));
    if (!read_all(peer.fd(), hello, sizeof hello, hello_deadline) || ntohl(hello[0]) != kHelloMagic)
      continue;
    int rank = static_cast<int>(ntohl(hello[1])), size = static_cast<int>(ntohl(hello[2]));
    if (size != r.size || rank <= 0 || rank >= r.size || peers[static_cast<std::size_t>(rank)]) {
      std::string why = size != r.size ? "a process with RANK=" + std::to_string(rank) +
                                             " says WORLD_SIZE=" + std::to_string(size) +
                                             " where rank 0 has " + std::to_string(r.size)
                                       : "two processes joined with RANK=" + std::to_string(rank) +
                                             " (every rank from 1 to WORLD_SIZE-1 must join once)";
      send_message(peer.fd(), kStatusRefused, why);
      return refuse(why);
    }
    peers[static_cast<std::size_t>(rank)] = std::move(peer);
    ++joined;
  }
  return true;
}

MPI_Comm join_as_root(JoinRequest& r, Clock::time_point deadline, std::string& error) {
  std::vector<Socket> peers;
  if (!gather_joiners(r, deadline, peers, error)) return MPI_COMM_NULL;
  char port[MPI_MAX_PORT_NAME] = {};
  int rc = MPI_Open_port(MPI_INFO_NULL, port);
  if (rc != MPI_SUCCESS) {
    error = mpi_failure("MPI_Open_port", rc) +
            " (is the ompi-server named by OMPI_MCA_pmix_server_uri running?)";
    refuse_all(peers, "rank 0: " + error);
    return MPI_COMM_NULL;
  }
  MPI_Comm group = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_SELF, &group);
  for (int joiner = 1; joiner < r.size && error.empty(); ++joiner) {
    // One joiner at a time: the group's accept must meet that joiner's
    // connect, so the next one learns the port only now.
    if (!send_message(peers[static_cast<std::size_t>(joiner)].fd(), kStatusPort, port))
      error = "rank " + std::to_string(joiner) + " closed its connection before joining";
    else if ((rc = accept_one(port, group)) != MPI_SUCCESS)
      error = mpi_failure("MPI_Comm_accept", rc) + " for rank " + std::to_string(joiner);
  }
  MPI_Close_port(port);
  if (!error.empty()) {
    refuse_all(peers, "rank 0: " + error);
    return MPI_COMM_NULL;
  }
  return group;
}

MPI_Comm join_as_member(const JoinRequest& r, Clock::time_point deadline, std::string& error) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  std::string port_text = std::to_string(r.port);
  if (int gai = getaddrinfo(r.host.c_str(), port_text.c_str(), &hints, &found); gai != 0) {
    error = "cannot resolve '" + r.host + "' of DUCTILE_MPI_JOIN: " + gai_strerror(gai);
    return MPI_COMM_NULL;
  }
  sockaddr_in addr{};
  std::memcpy(&addr, found->ai_addr, sizeof addr);
  freeaddrinfo(found);
  Socket server;
  while (!server) {
    Socket attempt(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (connect(attempt.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      server = std::move(attempt);
    } else if (Clock::now() >= deadline) {
      error = "rank " + std::to_string(r.rank) + " could not reach rank 0 at " + r.host + ":" +
              port_text + " within " + std::to_string(static_cast<int>(r.timeout_seconds)) +
              " s (DUCTILE_MPI_JOIN, DUCTILE_MPI_JOIN_TIMEOUT): " + std::strerror(errno);
      return MPI_COMM_NULL;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  std::uint32_t hello[3] = {htonl(kHelloMagic), htonl(static_cast<std::uint32_t>(r.rank)),
                            htonl(static_cast<std::uint32_t>(r.size))};
  std::uint32_t header[2] = {};
  if (!write_all(server.fd(), hello, sizeof hello) ||
      !read_all(server.fd(), header, sizeof header, deadline)) {
    error = "rank 0 at " + r.host + ":" + port_text +
            " did not hand out its MPI port in time or closed the connection";
    return MPI_COMM_NULL;
  }
  std::uint32_t status = ntohl(header[0]), length = ntohl(header[1]);
  std::string text(std::min<std::uint32_t>(length, 4096), '\0');
  if (length > 4096 || !read_all(server.fd(), text.data(), text.size(), deadline)) {
    error = "rank 0 at " + r.host + ":" + port_text + " sent a malformed reply";
    return MPI_COMM_NULL;
  }
  if (status != kStatusPort) {
    error = "rank 0 refused the join: " + text;
    return MPI_COMM_NULL;
  }
  MPI_Comm inter = MPI_COMM_NULL, group = MPI_COMM_NULL;
  int rc = MPI_Comm_connect(text.c_str(), MPI_INFO_NULL, 0, MPI_COMM_SELF, &inter);
  if (rc == MPI_SUCCESS) rc = merge_into(inter, true, group);
  if (rc != MPI_SUCCESS) {
    error = mpi_failure("MPI_Comm_connect", rc) + " to rank 0";
    return MPI_COMM_NULL;
  }
  for (int joiner = r.rank + 1; joiner < r.size; ++joiner) {
    if ((rc = accept_one(text.c_str(), group)) != MPI_SUCCESS) {
      error = mpi_failure("MPI_Comm_accept", rc) + " for rank " + std::to_string(joiner);
      return MPI_COMM_NULL;
    }
  }
  return group;
}

}  // namespace

bool join_request_from_env(const LaunchInfo& launch, std::optional<JoinRequest>& request,
                           std::string& error) {
  request.reset();
  const char* join = std::getenv("DUCTILE_MPI_JOIN");
  if (join == nullptr || *join == '\0' || launch.source != "RANK/WORLD_SIZE" || launch.size < 2)
    return true;
  std::string text = join;
  auto colon = text.rfind(':');
  char* end = nullptr;
  long port = colon == std::string::npos ? 0 : std::strtol(text.c_str() + colon + 1, &end, 10);
  if (colon == std::string::npos || colon == 0 || end == nullptr || *end != '\0' || port < 1 ||
      port > 65535) {
    error = "DUCTILE_MPI_JOIN='" + text.substr(0, 200) +
            "' is not HOST:PORT (the address where rank 0 hands out its MPI port, e.g. "
            "node0:29501)";
    return false;
  }
  JoinRequest r;
  r.rank = launch.rank;
  r.size = launch.size;
  r.host = text.substr(0, colon);
  r.port = static_cast<int>(port);
  if (const char* t = std::getenv("DUCTILE_MPI_JOIN_TIMEOUT"); t != nullptr && *t != '\0') {
    char* t_end = nullptr;
    r.timeout_seconds = std::strtod(t, &t_end);
    if (*t_end != '\0' || !(r.timeout_seconds > 0) || r.timeout_seconds > 1e6) {
      error = std::string("DUCTILE_MPI_JOIN_TIMEOUT='") + std::string(t).substr(0, 50) +
              "' is not a number of seconds (> 0)";
      return false;
    }
  }
  const char* server = std::getenv("OMPI_MCA_pmix_server_uri");
  if (server == nullptr || *server == '\0') {
    error =
        "DUCTILE_MPI_JOIN is set but OMPI_MCA_pmix_server_uri is not: processes started "
        "without mpirun join one MPI world only through an ompi-server that all of them reach "
        "(`ductile agent --mpi-world` starts one and sets both)";
    return false;
  }
  request = std::move(r);
  return true;
}

bool listen_for_joiners(JoinRequest& r, std::string& error) {
  Socket listener(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  int one = 1;
  setsockopt(listener.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<std::uint16_t>(r.port));
  if (!listener || bind(listener.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      listen(listener.fd(), 128) != 0) {
    error = "rank 0 cannot listen on port " + std::to_string(r.port) +
            " (DUCTILE_MPI_JOIN): " + std::strerror(errno) + "; give a free port";
    return false;
  }
  r.listener = listener.release();
  return true;
}

MPI_Comm join_world(JoinRequest& r, std::string& error) {
  // Errors of the dynamic-process calls made on MPI_COMM_SELF come back as
  // codes rather than aborting the process.
  MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(r.timeout_seconds));
  MPI_Comm group =
      r.rank == 0 ? join_as_root(r, deadline, error) : join_as_member(r, deadline, error);
  if (group == MPI_COMM_NULL) return MPI_COMM_NULL;
  MPI_Comm world = MPI_COMM_NULL;
  int rc = MPI_Comm_split(group, 0, r.rank, &world);
  MPI_Comm_free(&group);
  if (rc != MPI_SUCCESS) {
    error = mpi_failure("MPI_Comm_split", rc);
    return MPI_COMM_NULL;
  }
  MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN);
  return world;
}

}  // namespace ductile::accel
