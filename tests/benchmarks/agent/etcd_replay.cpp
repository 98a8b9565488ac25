// etcd's side of N agents joining a job and then at rest, made by one light
// process instead of N agents (a program, not a test; bench_agent.py
// replay runs it): it goes further than a machine that holds a few hundred
// agents.
//
// Each replayed agent makes the requests an agent of an elastic job makes
// on etcd, through the same EtcdStore: a connection and its lease's grant;
// its registration, with the reads it joins by and its mirror's first
// read, in one transaction; its age index entry; the watch of its part of
// the job's keys on a connection of its own, from the registration's
// revision; its lease renewals on a stream of a third connection, every
// TTL/3, the first TTL/3 after the grant. The 16 oldest also read every
// registration and watch every key (they follow everything). Once all
// joined, the oldest writes the round record naming every member, and
// each watch receives it.
//
// Prints one line of figures (bench_agent.py parses it):
//   replay agents=N joined_s=... delivered_s=... forming_cpu_s=...
//   rest_cpu_s=... rest_s=... renewals=...
// joined_s: from the first grant until the last age entry was written
// (every agent started at once, `threads` joining at a time);
// delivered_s: from the round's write until every watch had it;
// forming_cpu_s: etcd's CPU over both; rest_cpu_s: etcd's CPU over rest_s
// seconds after that, while every lease is renewed and nothing else
// happens; renewals: the renewals made in that time.
//
// JOINS_PER_S: agent i starts its join no sooner than i / JOINS_PER_S
// seconds after the first (0: as soon as one of THREADS is free), to
// replay agents that start over a while, as on a machine that starts them
// one after the other.
//
// usage: agent_etcd_replay ENDPOINT ETCD_PID AGENTS [TTL_S=5] [REST_S=10] [THREADS=32]
//                          [JOINS_PER_S=0]
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ductile/agent/etcd_store.hpp"

using namespace ductile::agent;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kWindow = 16;  // the oldest agents, which follow every key
const std::string kPrefix = "/ductile/agent/replay/";

// The CPU seconds process `pid` used so far (user and system).
double cpu_seconds(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  if (close == std::string::npos)
    throw std::runtime_error("no such process: " + std::to_string(pid));
  std::istringstream fields(text.substr(close + 2));
  std::string skip;
  for (int i = 0; i < 11; ++i) fields >> skip;
  long user = 0, system = 0;
  fields >> user >> system;
  return double(user + system) / double(sysconf(_SC_CLK_TCK));
}

std::string node_id(int i) {
  char id[16];
  std::snprintf(id, sizeof id, "n%05d", i);
  return id;
}

// A registration record the size of an agent's.
std::string record(int i) {
  return "{\"id\":\"" + node_id(i) +
         "\",\"addr\":\"127.0.0.1\",\"rank\":-1,\"snapshot_port\":40001,\"link_port\":40002}";
}

struct Agent {
  std::int64_t lease = 0;
  std::int64_t revision = 0;
  std::vector<KeyRange> followed;
  std::unique_ptr<EtcdStore> requests, watch, renewals;
  std::thread watcher;
  std::atomic<bool> stop{false};
  std::atomic<bool> has_round{false};
  Clock::time_point granted;
};

int parse(const char* text, const char* what) {
  int value = 0;
  const std::string s(text);
  if (std::from_chars(s.data(), s.data() + s.size(), value).ptr != s.data() + s.size() ||
      value <= 0) {
    std::fprintf(stderr, "agent_etcd_replay: %s '%s' is not a positive integer\n", what, text);
    std::exit(2);
  }
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4 || argc > 8) {
    std::fprintf(stderr,
                 "usage: agent_etcd_replay ENDPOINT ETCD_PID AGENTS [TTL_S=5] [REST_S=10] "
                 "[THREADS=32] [JOINS_PER_S=0]\n");
    return 2;
  }
  const std::string endpoint = argv[1];
  const int etcd_pid = parse(argv[2], "ETCD_PID");
  const int n = parse(argv[3], "AGENTS");
  const int ttl = argc > 4 ? parse(argv[4], "TTL_S") : 5;
  const int rest_s = argc > 5 ? parse(argv[5], "REST_S") : 10;
  const int threads = argc > 6 ? parse(argv[6], "THREADS") : 32;
  const int joins_per_s =
      argc > 7 && std::string(argv[7]) != "0" ? parse(argv[7], "JOINS_PER_S") : 0;
  const auto timeout = std::chrono::milliseconds(30000);
  // A replayed agent keeps 2 connections open (its requests' closes once
  // it joined: an idle connection costs etcd nothing), each with its curl
  // handles' files: 8 in all.
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  const rlim_t wanted = 8 * static_cast<rlim_t>(n) + 1024;
  if (files.rlim_cur < wanted) {
    const rlimit raised{wanted, std::max(wanted, files.rlim_max)};
    if (setrlimit(RLIMIT_NOFILE, &raised) != 0) {
      std::fprintf(stderr,
                   "agent_etcd_replay: %d agents need %llu open files and the limit is %llu: "
                   "raise it (ulimit -n, or run as root) or give fewer AGENTS\n",
                   n, static_cast<unsigned long long>(wanted),
                   static_cast<unsigned long long>(files.rlim_max));
      return 2;
    }
  }
  const auto period = std::chrono::milliseconds(ttl * 1000 / 3);

  std::vector<Agent> agents(static_cast<std::size_t>(n));
  std::atomic<int> delivered{0};
  std::atomic<bool> renewing{true};
  std::atomic<long> renewals{0};

  // The renewals: a few threads, each renewing its share of the leases at
  // their times (every TTL/3 from each grant).
  std::mutex mutex;
  std::string failure;  // the first request that failed (mutex held)
  std::vector<std::thread> renewers;
  const int renewer_count = std::max(1, std::min(8, n / 256));
  for (int r = 0; r < renewer_count; ++r)
    renewers.emplace_back([&, r] {
      std::vector<Clock::time_point> next(static_cast<std::size_t>(n), Clock::time_point::max());
      while (renewing) {
        auto soonest = Clock::now() + std::chrono::milliseconds(50);
        for (int i = r; i < n; i += renewer_count) {
          Agent& a = agents[static_cast<std::size_t>(i)];
          auto& due = next[static_cast<std::size_t>(i)];
          if (due == Clock::time_point::max()) {
            std::lock_guard lock(mutex);
            if (a.lease == 0) continue;
            due = a.granted + period;
            a.renewals = std::make_unique<EtcdStore>(endpoint, timeout);
          }
          if (Clock::now() >= due) {
            try {
              if (a.renewals->keep_alive(a.lease)) ++renewals;
            } catch (const StoreError& e) {
              std::lock_guard lock(mutex);
              if (failure.empty()) failure = e.what();
            }
            due += period;
          }
          soonest = std::min(soonest, due);
        }
        std::this_thread::sleep_until(soonest);
      }
    });

  const double cpu_start = cpu_seconds(etcd_pid);
  const auto start = Clock::now();
  std::atomic<int> next_agent{0};
  std::vector<std::thread> joiners;
  for (int t = 0; t < threads; ++t)
    joiners.emplace_back([&] {
      try {
        for (int i = next_agent++; i < n; i = next_agent++) {
          Agent& a = agents[static_cast<std::size_t>(i)];
          if (joins_per_s > 0)
            std::this_thread::sleep_until(
                start + std::chrono::microseconds(std::int64_t{1000000} * i / joins_per_s));
          const std::string id = node_id(i), own = kPrefix + "nodes/" + id;
          a.requests = std::make_unique<EtcdStore>(endpoint, timeout);
          const auto lease = a.requests->grant_lease(ttl);
          {
            std::lock_guard lock(mutex);
            a.lease = lease;
            a.granted = Clock::now();
          }
          RangeRead ages{kPrefix + "ages/", true, kWindow};
          const std::vector<RangeRead> reads = {
              RangeRead{own}, RangeRead{kPrefix + "nodes/", true, 2},
              RangeRead{kPrefix + "settings"}, RangeRead{kPrefix + "round"}, ages};
          a.followed = {KeyRange{kPrefix + "checkpoint/", kPrefix + "holdings/"},
                        KeyRange{kPrefix + "restore/", kPrefix + "snapshots/"}, single_key(own)};
          std::vector<std::vector<KeyValue>> contents;
          if (!a.requests->compare_and_swap_then_read_ranges(own, 0, record(i), lease, reads,
                                                             a.followed, contents))
            throw std::runtime_error(own + " exists: start with an empty etcd");
          a.revision = a.requests->changed_at();
          char age[32];
          std::snprintf(age, sizeof age, "%020lld", static_cast<long long>(a.revision));
          a.requests->put(kPrefix + "ages/" + age + "/" + id, record(i), lease);
          if (i < kWindow) {
            // The oldest follow every key but the age index.
            a.followed = {KeyRange{kPrefix, kPrefix + "ages/"},
                          KeyRange{kPrefix + "ages0", prefix_range(kPrefix).end}};
            (void)a.requests->read_ranges_at(a.followed);
          }
          if (i > 0) a.requests.reset();
          a.watch = std::make_unique<EtcdStore>(endpoint, timeout);
          a.watcher = std::thread([&a, &delivered] {
            try {
              a.watch->watch(
                  a.followed, a.revision + 1,
                  [&](const WatchMessage& message) {
                    for (const auto& event : message.events)
                      if (event.kv.key == kPrefix + "round" && !a.has_round.exchange(true))
                        ++delivered;
                    return true;
                  },
                  a.stop);
            } catch (const StoreError& e) {
              std::fprintf(stderr, "agent_etcd_replay: a watch ended: %s\n", e.what());
            }
          });
        }
      } catch (const std::exception& e) {
        std::lock_guard lock(mutex);
        if (failure.empty()) failure = e.what();
        next_agent = n;
      }
    });
  for (auto& t : joiners) t.join();
  if (!failure.empty()) {
    std::fprintf(stderr, "agent_etcd_replay: %s\n", failure.c_str());
    std::_Exit(1);
  }
  const double joined_s = std::chrono::duration<double>(Clock::now() - start).count();

  // The round, naming every member and its registration's revision.
  std::string members, revisions;
  for (int i = 0; i < n; ++i) {
    if (i > 0) {
      members.push_back(',');
      revisions.push_back(',');
    }
    members.append("\"").append(node_id(i)).append("\"");
    revisions.append(std::to_string(agents[static_cast<std::size_t>(i)].revision));
  }
  const std::string round =
      "{\"round\":1,\"state\":\"running\",\"world_size\":" + std::to_string(n) + ",\"members\":[" +
      members + "],\"member_revisions\":[" + revisions +
      "],\"master_addr\":\"127.0.0.1\",\"master_port\":29500}";
  const auto written = Clock::now();
  agents[0].requests->put(kPrefix + "round", round);
  while (delivered < n && Clock::now() - written < std::chrono::seconds(120))
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const double delivered_s = std::chrono::duration<double>(Clock::now() - written).count();
  const double forming_cpu = cpu_seconds(etcd_pid) - cpu_start;
  if (delivered < n)
    std::fprintf(stderr, "agent_etcd_replay: %d of %d watches had the round after 120 s\n",
                 delivered.load(), n);

  // At rest: renewals only. Every lease has been renewed once (a period
  // after the last grant) before it is measured.
  std::this_thread::sleep_for(period + std::chrono::milliseconds(500));
  const long renewals_before = renewals;
  const double rest_start = cpu_seconds(etcd_pid);
  std::this_thread::sleep_for(std::chrono::seconds(rest_s));
  const double rest_cpu = cpu_seconds(etcd_pid) - rest_start;
  const long renewed = renewals - renewals_before;

  renewing = false;
  for (auto& t : renewers) t.join();
  for (auto& a : agents) {
    a.stop = true;
    if (a.watch) a.watch->interrupt_watch();
  }
  for (auto& a : agents)
    if (a.watcher.joinable()) a.watcher.join();
  if (!failure.empty()) std::fprintf(stderr, "agent_etcd_replay: %s\n", failure.c_str());
  std::printf(
      "replay agents=%d joined_s=%.3f delivered_s=%.3f forming_cpu_s=%.3f rest_cpu_s=%.3f "
      "rest_s=%d renewals=%ld delivered=%d\n",
      n, joined_s, delivered_s, forming_cpu, rest_cpu, rest_s, renewed, delivered.load());
  return delivered == n && failure.empty() ? 0 : 1;
}
