// The clock and the host names the agent uses: this host's names and
// addresses, as torchrun finds them. See agent_common.hpp.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <unistd.h>

#include <algorithm>
#include <set>
#include <vector>

#include "agent_common.hpp"

namespace ductile::agent {

using std::chrono::milliseconds;

milliseconds now_ms() {
  return std::chrono::duration_cast<milliseconds>(
      std::chrono::system_clock::now().time_since_epoch());
}

std::string host_name() {
  char buffer[256] = {};
  if (gethostname(buffer, sizeof buffer - 1) != 0) return "localhost";
  return buffer;
}

namespace {

// The numeric addresses `host` resolves to.
std::set<std::string> addresses_of(const std::string& host) {
  std::set<std::string> out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return out;
  for (addrinfo* a = found; a; a = a->ai_next) {
    char text[NI_MAXHOST];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, text, sizeof text, nullptr, 0, NI_NUMERICHOST) == 0)
      out.insert(text);
  }
  freeaddrinfo(found);
  return out;
}

}  // namespace

std::string fully_qualified_host_name() {
  // As Python's getfqdn(): the host name's first address, its name and
  // aliases from the resolver; the first of them with a dot, else its name.
  const std::string name = host_name();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  addrinfo* found = nullptr;
  if (getaddrinfo(name.c_str(), nullptr, &hints, &found) != 0 || !found) return name;
  hostent entry{}, *result = nullptr;
  std::vector<char> buffer(16384);
  int error = 0;
  const void* address = nullptr;
  socklen_t length = 0;
  if (found->ai_family == AF_INET) {
    address = &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr;
    length = sizeof(in_addr);
  } else if (found->ai_family == AF_INET6) {
    address = &reinterpret_cast<sockaddr_in6*>(found->ai_addr)->sin6_addr;
    length = sizeof(in6_addr);
  }
  std::string fqdn = name;
  if (address &&
      gethostbyaddr_r(address, length, found->ai_family, &entry, buffer.data(), buffer.size(),
                      &result, &error) == 0 &&
      result && result->h_name) {
    std::vector<std::string> names = {result->h_name};
    for (char** alias = result->h_aliases; alias && *alias; ++alias) names.push_back(*alias);
    auto dotted = std::find_if(names.begin(), names.end(), [](const std::string& n) {
      return n.find('.') != std::string::npos;
    });
    fqdn = dotted != names.end() ? *dotted : names.front();
  }
  freeaddrinfo(found);
  return fqdn;
}

bool names_this_machine(const std::string& host) {
  if (host == "localhost" || host == host_name() || host == fully_qualified_host_name())
    return true;
  in_addr v4{};
  in6_addr v6{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1 && (ntohl(v4.s_addr) >> 24) == 127) return true;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  const std::set<std::string> wanted = addresses_of(host);
  if (wanted.empty()) return false;
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) return false;
  bool mine = false;
  for (ifaddrs* i = interfaces; i && !mine; i = i->ifa_next) {
    if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6))
      continue;
    char text[NI_MAXHOST];
    socklen_t length =
        i->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (getnameinfo(i->ifa_addr, length, text, sizeof text, nullptr, 0, NI_NUMERICHOST) == 0)
      mine = wanted.count(text) > 0;
  }
  freeifaddrs(interfaces);
  return mine;
}

}  // namespace ductile::agent
