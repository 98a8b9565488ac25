// The listening sockets of a StoreServer (see listening.hpp): resolving a
// host, choosing between its own addresses and every interface, and
// binding one port on each.
#include "listening.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <system_error>

namespace ductile::agent {

namespace {

struct Address {
  sockaddr_storage storage{};
  socklen_t length = 0;
};

void set_port(Address& a, int port) {
  const auto p = htons(static_cast<std::uint16_t>(port));
  if (a.storage.ss_family == AF_INET6)
    reinterpret_cast<sockaddr_in6*>(&a.storage)->sin6_port = p;
  else
    reinterpret_cast<sockaddr_in*>(&a.storage)->sin_port = p;
}

// The addresses `host` resolves to, each once (empty when it does not).
std::vector<Address> resolve(const std::string& host) {
  std::vector<Address> out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return out;
  for (addrinfo* a = found; a; a = a->ai_next) {
    if ((a->ai_family != AF_INET && a->ai_family != AF_INET6) ||
        a->ai_addrlen > sizeof(sockaddr_storage))
      continue;
    Address address;
    std::memcpy(&address.storage, a->ai_addr, a->ai_addrlen);
    address.length = a->ai_addrlen;
    const bool seen = std::any_of(out.begin(), out.end(), [&](const Address& o) {
      return o.length == address.length &&
             std::memcmp(&o.storage, &address.storage, address.length) == 0;
    });
    if (!seen) out.push_back(address);
  }
  ::freeaddrinfo(found);
  return out;
}

// A listening socket on `a`, or -1 with errno set.
int listen_at(const Address& a) {
  int fd = ::socket(a.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (a.storage.ss_family == AF_INET6) {
    // The v6 wildcard takes v4 clients too (v4-mapped); a named v6
    // address only its own, so that a v4 address binds the same port.
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a.storage);
    int v6_only = IN6_IS_ADDR_UNSPECIFIED(&v6->sin6_addr) ? 0 : 1;
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6_only, sizeof v6_only);
  }
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&a.storage), a.length) == 0 &&
      ::listen(fd, SOMAXCONN) == 0)
    return fd;
  const int e = errno;
  ::close(fd);
  errno = e;
  return -1;
}

// Every interface: v6 with v4-mapped where the kernel allows, else v4.
std::vector<int> listen_everywhere(int port) {
  for (const char* any : {"::", "0.0.0.0"})
    for (Address a : resolve(any)) {
      set_port(a, port);
      if (int fd = listen_at(a); fd >= 0) return {fd};
      if (errno == EADDRINUSE) throw std::system_error(errno, std::generic_category(), "bind");
    }
  throw std::system_error(errno, std::generic_category(), "bind");
}

// `port` on each of `addresses` that is one of this machine's; throws
// for any other failure (EADDRINUSE: taken), closing what it bound.
std::vector<int> listen_on_each(std::vector<Address> addresses, int port) {
  std::vector<int> fds;
  for (auto& address : addresses) {
    set_port(address, port);
    int fd = listen_at(address);
    if (fd >= 0) {
      fds.push_back(fd);
      if (port == 0) port = bound_port(fd);  // the others bind the same
      continue;
    }
    const int e = errno;
    if (e == EADDRNOTAVAIL || e == EAFNOSUPPORT) continue;  // not an address of this machine
    close_all(fds);
    throw std::system_error(e, std::generic_category(), "bind");
  }
  return fds;
}

bool loopback(const Address& a) {
  if (a.storage.ss_family == AF_INET6)
    return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(&a.storage)->sin6_addr);
  return (ntohl(reinterpret_cast<const sockaddr_in*>(&a.storage)->sin_addr.s_addr) >> 24) == 127;
}

bool numeric(const std::string& host) {
  in_addr v4{};
  in6_addr v6{};
  return ::inet_pton(AF_INET, host.c_str(), &v4) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), &v6) == 1;
}

}  // namespace

int bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

void close_all(std::vector<int>& fds) {
  for (int fd : fds) ::close(fd);
  fds.clear();
}

// The listening sockets of `host`:`port`. Only the host's addresses: a
// store bound to a loopback endpoint is not reachable from the network.
// Served on every interface instead, as torch's own store is: a host none
// of whose addresses is here (a forwarded address), and a machine's name
// that its own resolver gives as loopback only (127.0.1.1 in /etc/hosts)
// while the other machines resolve it to this one's address.
std::vector<int> listen_on(const std::string& host, int port) {
  if (host.empty()) return listen_everywhere(port);
  const std::vector<Address> addresses = resolve(host);
  if (addresses.empty()) return listen_everywhere(port);
  const bool local_name = host == "localhost" || host.starts_with("localhost.") ||
                          host.ends_with(".localhost") || numeric(host);
  if (!local_name && std::all_of(addresses.begin(), addresses.end(), loopback))
    return listen_everywhere(port);
  // A free port chosen on the first address may be taken on another:
  // then another, a few times.
  for (int attempt = 0; attempt < 8; ++attempt) {
    try {
      std::vector<int> fds = listen_on_each(addresses, port);
      if (fds.empty()) return listen_everywhere(port);
      return fds;
    } catch (const std::system_error& e) {
      if (port != 0 || e.code().value() != EADDRINUSE) throw;
    }
  }
  throw std::system_error(EADDRINUSE, std::generic_category(), "bind");
}

}  // namespace ductile::agent
