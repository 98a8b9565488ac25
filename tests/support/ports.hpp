// Free TCP ports for servers a test starts (etcd, a rank's join listener),
// and raw connections to them.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <random>
#include <string>

namespace ductile::test {

// A TCP port nobody holds now, below the kernel's ephemeral range: sockets
// bound to port 0 (MPI's and etcd's own) are never given it, so it stays
// free until the server the test starts binds it. From the ephemeral range
// only when nothing below is free.
inline int free_tcp_port() {
  auto bindable = [](int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    socklen_t len = sizeof addr;
    int got = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0
                  ? ntohs(addr.sin_port)
                  : 0;
    close(fd);
    return got;
  };
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  static std::mt19937 random(std::random_device{}());
  for (int attempt = 0; attempt < 200 && low > 10001; ++attempt)
    if (int port = bindable(std::uniform_int_distribution<int>(10000, low - 1)(random)))
      return port;
  return bindable(0);
}

// A raw TCP connection to `port` on 127.0.0.1, for bytes no real client
// sends; -1 when it cannot be made (the caller closes the descriptor).
inline int connect_loopback(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Reads `fd` until the peer closes it (true) or `limit` passes (false);
// what came is appended to `got` when given.
inline bool closed_by_peer(int fd, std::chrono::seconds limit, std::string* got = nullptr) {
  timeval tv{static_cast<time_t>(limit.count()), 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buffer[256];
  for (;;) {
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
    if (got) got->append(buffer, static_cast<std::size_t>(n));
  }
}

}  // namespace ductile::test
