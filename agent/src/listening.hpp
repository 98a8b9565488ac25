// The listening sockets of a StoreServer: the addresses a host resolves
// to, bound on one port. Internal to libductile_agent.
#pragma once

#include <string>
#include <vector>

namespace ductile::agent {

// Non-blocking, close-on-exec sockets listening on `port` (0: a free one,
// the same on each) of `host`'s addresses, or of every interface when
// `host` is empty, resolves to none of this machine's addresses, or is a
// machine's name its own resolver gives as loopback only. The caller owns
// the descriptors (close_all). Throws std::system_error("bind") when the
// port cannot be bound (EADDRINUSE: taken; EMFILE: out of descriptors).
std::vector<int> listen_on(const std::string& host, int port);

// The port `fd` is bound to.
int bound_port(int fd);

// Closes each of `fds` and empties it.
void close_all(std::vector<int>& fds);

}  // namespace ductile::agent
