// The agent's mirror of its job's keys (agent/src/store_mirror.hpp)
// against a real etcd: reads under the prefix answered from the watch's
// mirror (its own writes seen at once, other clients' writes, deletes and
// lease expiries as they come), the same answers etcd gives, other keys
// read from etcd; records read with a compare-and-swap never answered
// older afterwards; an etcd stopped for a moment, and one restarted.
#include <doctest/doctest.h>

#include <poll.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../../agent/src/store_mirror.hpp"
#include "agent_support.hpp"
#include "temp_dir.hpp"

using namespace ductile::agent;
using namespace ductile::test;
using namespace std::chrono_literals;

// Not an anonymous namespace: a unity build puts this file beside other
// tests, whose helpers' names would clash.
namespace store_mirror_test {

std::vector<std::string> keys_of(const std::vector<KeyValue>& kvs) {
  std::vector<std::string> out;
  for (const auto& kv : kvs) out.push_back(kv.key + "=" + kv.value);
  return out;
}

// Waits (30 s at most) until `read` holds and was answered from the mirror.
bool answered_from_mirror(const MirroredStore& mirror, const std::function<bool()>& read) {
  return wait_until(
      [&] {
        const auto before = mirror.mirrored_reads();
        return read() && mirror.mirrored_reads() > before;
      },
      30s);
}

struct Mirrored {
  TempDir dir;
  EtcdServer etcd{dir.path()};
  std::unique_ptr<EtcdStore> make(std::chrono::milliseconds timeout = 2000ms) const {
    return std::make_unique<EtcdStore>(etcd.endpoint(), timeout);
  }
};

}  // namespace store_mirror_test

using namespace store_mirror_test;

TEST_CASE(
    "etcd mirror: the job's keys read from a watch - own writes at once, others' as they come") {
  Mirrored m;
  auto other = m.make();
  other->put("/job/a", "1");
  other->put("/elsewhere", "x");
  MirroredStore mirror(
      m.make(), [&] { return m.make(); }, std::vector<KeyRange>{prefix_range("/job/")}, 2000ms,
      [](const std::string&) {});
  // Once the watch runs, reads of the job's keys stop reaching etcd.
  REQUIRE(answered_from_mirror(mirror, [&] { return mirror.get("/job/a").has_value(); }));
  const auto direct = mirror.direct_reads();
  CHECK(mirror.get("/job/a")->value == "1");

  // Its own writes: the very next read shows them.
  for (int i = 0; i < 20; ++i) {
    mirror.put("/job/own", std::to_string(i));
    CHECK(mirror.get("/job/own")->value == std::to_string(i));
  }
  auto own = mirror.get("/job/own");
  REQUIRE(own);
  CHECK(mirror.compare_and_swap("/job/own", own->mod_revision, "swapped"));
  CHECK(mirror.get("/job/own")->value == "swapped");
  CHECK_FALSE(mirror.compare_and_swap("/job/own", own->mod_revision, "stale"));
  CHECK(mirror.get("/job/own")->value == "swapped");
  mirror.erase("/job/own");
  CHECK_FALSE(mirror.get("/job/own"));

  // Another client's writes, deletes and a lease's expiry arrive.
  other->put("/job/b", "2");
  CHECK(wait_until([&] { return mirror.get("/job/b").has_value(); }, 10s));
  other->erase("/job/a");
  CHECK(wait_until([&] { return !mirror.get("/job/a"); }, 10s));
  const auto lease = other->grant_lease(1);
  other->put("/job/leased", "l", lease);
  CHECK(wait_until([&] { return mirror.get("/job/leased").has_value(); }, 10s));
  CHECK(wait_until([&] { return !mirror.get("/job/leased"); }, 30s));
  CHECK(mirror.direct_reads() == direct);

  // The same answers as etcd's, range by range: prefixes, limits, the
  // oldest first.
  for (const char* name : {"c", "e", "d"}) other->put(std::string("/job/n/") + name, name);
  other->put("/job/n/c", "c2");  // rewritten: its create revision stays
  // The last of those writes arrived: every one before it did.
  CHECK(wait_until(
      [&] {
        const auto c = mirror.get("/job/n/c");
        return c && c->value == "c2";
      },
      10s));
  const std::vector<RangeRead> reads = {
      RangeRead{"/job/n/", true}, RangeRead{"/job/n/", true, 2, true},
      RangeRead{"/job/n/", true, 0, true}, RangeRead{"/job/n/d"}, RangeRead{"/job/missing"}};
  const auto mine = mirror.read(reads), theirs = other->read(reads);
  REQUIRE(mine.size() == theirs.size());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    INFO("read " << i);
    CHECK(keys_of(mine[i]) == keys_of(theirs[i]));
    for (std::size_t k = 0; k < mine[i].size() && k < theirs[i].size(); ++k) {
      CHECK(mine[i][k].create_revision == theirs[i][k].create_revision);
      CHECK(mine[i][k].mod_revision == theirs[i][k].mod_revision);
    }
  }
  CHECK(mirror.direct_reads() == direct);
  // Keys outside the prefix are etcd's to answer.
  CHECK(mirror.get("/elsewhere")->value == "x");
  CHECK(mirror.direct_reads() == direct + 1);
}

TEST_CASE("etcd mirror: several ranges on one watch, and other ranges followed from then on") {
  Mirrored m;
  auto other = m.make();
  for (const char* key : {"/job/a/1", "/job/b/1", "/job/c/1", "/job/own"}) other->put(key, "v");
  MirroredStore mirror(
      m.make(), [&] { return m.make(); },
      std::vector<KeyRange>{prefix_range("/job/a/"), single_key("/job/own")}, 2000ms,
      [](const std::string&) {});
  REQUIRE(answered_from_mirror(mirror, [&] { return mirror.get("/job/own").has_value(); }));
  auto direct = mirror.direct_reads();
  // Both ranges from the mirror, in one read; its own writes in either seen
  // at once, others' as they come.
  auto both = mirror.read({RangeRead{"/job/a/", true}, RangeRead{"/job/own"}});
  CHECK(keys_of(both[0]) == std::vector<std::string>{"/job/a/1=v"});
  CHECK(keys_of(both[1]) == std::vector<std::string>{"/job/own=v"});
  mirror.put("/job/own", "mine");
  CHECK(mirror.get("/job/own")->value == "mine");
  mirror.put("/job/a/2", "mine");
  CHECK(mirror.get_prefix("/job/a/").size() == 2);
  other->put("/job/a/3", "theirs");
  CHECK(wait_until([&] { return mirror.get_prefix("/job/a/").size() == 3; }, 10s));
  other->erase("/job/own");
  CHECK(wait_until([&] { return !mirror.get("/job/own"); }, 10s));
  CHECK(mirror.direct_reads() == direct);
  // A key beside the ranges (a longer key that starts with a followed
  // single key, a range not followed) is etcd's to answer, and a write
  // there does not hold back the mirror's reads.
  other->put("/job/own2", "x");
  CHECK(mirror.get("/job/own2")->value == "x");
  mirror.put("/job/b/2", "w");
  CHECK(mirror.get_prefix("/job/b/").size() == 2);
  CHECK(mirror.direct_reads() == direct + 2);
  direct = mirror.direct_reads();
  CHECK_FALSE(mirror.get("/job/own"));
  CHECK(mirror.direct_reads() == direct);

  // A change of ranges: the new ones are read afresh and followed; the old
  // ones go to etcd.
  mirror.follow({prefix_range("/job/b/"), prefix_range("/job/c/")});
  REQUIRE(answered_from_mirror(mirror, [&] { return mirror.get_prefix("/job/b/").size() == 2; }));
  direct = mirror.direct_reads();
  other->put("/job/c/2", "theirs");
  CHECK(wait_until([&] { return mirror.get_prefix("/job/c/").size() == 2; }, 10s));
  CHECK(mirror.direct_reads() == direct);
  CHECK(mirror.get_prefix("/job/a/").size() == 3);
  CHECK(mirror.direct_reads() == direct + 1);
  // A wait for changes wakes on a followed range's change only.
  (void)mirror.get_prefix("/job/c/");
  const int fd = mirror.changes_fd({"/job/c/"});
  REQUIRE(fd >= 0);
  other->put("/job/c/3", "theirs");
  pollfd ready{fd, POLLIN, 0};
  CHECK(::poll(&ready, 1, 10000) == 1);
}

TEST_CASE("etcd mirror: an etcd stopped for a moment, then restarted") {
  Mirrored m;
  MirroredStore mirror(
      m.make(500ms), [&] { return m.make(500ms); }, std::vector<KeyRange>{prefix_range("/job/")},
      500ms, [](const std::string&) {});
  mirror.put("/job/a", "1");
  REQUIRE(answered_from_mirror(mirror, [&] { return mirror.get("/job/a").has_value(); }));
  // Stopped (SIGSTOP): nothing can change meanwhile, so the mirror answers;
  // a write times out, as a slow store's does.
  REQUIRE(::kill(m.etcd.pid(), SIGSTOP) == 0);
  CHECK(mirror.get("/job/a")->value == "1");
  CHECK_THROWS_AS(mirror.put("/job/b", "2"), StoreTimeout);
  REQUIRE(::kill(m.etcd.pid(), SIGCONT) == 0);
  // The next write is taken. The one that timed out may be taken too, and
  // after it: etcd resumes with both in hand, on two connections, and
  // takes them in its own order. The mirror shows what etcd holds.
  CHECK(wait_until(
      [&] {
        try {
          mirror.put("/job/b", "3");
          return true;
        } catch (const StoreUnavailable&) {
          return false;
        }
      },
      30s));
  const auto direct = m.make();
  CHECK(wait_until(
      [&] {
        const auto held = direct->get("/job/b");
        const auto seen = mirror.get("/job/b");
        return held && seen && held->value == seen->value &&
               held->mod_revision == seen->mod_revision;
      },
      10s));
  const std::string taken = mirror.get("/job/b")->value;
  CHECK((taken == "3" || taken == "2"));

  // Restarted: the watch ends, reads go to etcd (and fail while it is down),
  // and the mirror follows again from the revision it held.
  m.etcd.stop();
  CHECK(wait_until(
      [&] {
        try {
          mirror.get("/job/a");
          return false;
        } catch (const StoreUnavailable&) {
          return true;
        }
      },
      30s));
  m.etcd.start();
  auto other = m.make();
  other->put("/job/c", "after the restart");
  CHECK(wait_until(
      [&] {
        try {
          const auto before = mirror.mirrored_reads();
          const auto c = mirror.get("/job/c");
          return c && mirror.mirrored_reads() > before;
        } catch (const StoreUnavailable&) {
          return false;
        }
      },
      30s));
  CHECK(mirror.get("/job/a")->value == "1");
  CHECK(mirror.get("/job/c")->value == "after the restart");
}

// A compare-and-swap that reads in the same request (an agent registering
// and joining): the mirror's next answers show what those reads found, or
// newer, though the write was in another range.
TEST_CASE("etcd mirror: records read with a compare-and-swap are never answered older after") {
  Mirrored m;
  auto other = m.make();
  MirroredStore mirror(
      m.make(), [&] { return m.make(); },
      std::vector<KeyRange>{prefix_range("/job/a/"), prefix_range("/job/b/")}, 2000ms,
      [](const std::string&) {});
  other->put("/job/b/first", "1");
  REQUIRE(answered_from_mirror(mirror, [&] { return mirror.get("/job/b/first").has_value(); }));
  for (int i = 0; i < 20; ++i) {
    // A large record first: the watch takes a while to bring it, and the
    // record after it.
    other->put("/job/b/large", std::string(std::size_t{1} << 20, char('a' + i)));
    const std::string fresh = "/job/b/new" + std::to_string(i);
    other->put(fresh, "y");
    const auto seen = mirror.compare_and_swap_then_read("/job/a/own" + std::to_string(i), 0, "mine",
                                                        0, {RangeRead{"/job/b/", true}});
    REQUIRE(seen);
    const auto listed = keys_of((*seen)[0]);
    CHECK(std::find(listed.begin(), listed.end(), fresh + "=y") != listed.end());
    const auto large = mirror.get("/job/b/large");
    REQUIRE(large);
    CHECK(large->value[0] == char('a' + i));
    CHECK(mirror.get(fresh));
  }
}

TEST_CASE(
    "etcd mirror: the first read carried by a compare-and-swap - no read of the watch's own") {
  Mirrored m;
  auto other = m.make();
  other->put("/job/a/old", "1");
  other->put("/job/b", "outside");
  // Reads wait for the watch to start (up to 30 s on a loaded machine).
  MirroredStore mirror(
      m.make(), [&] { return m.make(); }, std::vector<KeyRange>{}, 30000ms,
      [](const std::string&) {});
  mirror.follow_with_next_swap({prefix_range("/job/a/"), single_key("/job/own")});
  // Nothing followed yet: reads go to etcd.
  CHECK(mirror.get("/job/a/old")->value == "1");
  CHECK(mirror.direct_reads() == 1);
  // A swap that fails carries nothing.
  CHECK_FALSE(mirror.compare_and_swap_then_read("/job/b", 0, "x", 0, {}));
  const auto joined =
      mirror.compare_and_swap_then_read("/job/own", 0, "mine", 0, {RangeRead{"/job/b"}});
  REQUIRE(joined);
  REQUIRE(joined->size() == 1);
  CHECK(keys_of((*joined)[0]) == std::vector<std::string>{"/job/b=outside"});
  // At once from the mirror: the keys as the swap's transaction read them,
  // its own write among them, with no read of the watch's.
  const auto direct = mirror.direct_reads();
  const auto read = mirror.read({RangeRead{"/job/a/", true}, RangeRead{"/job/own"}});
  CHECK(keys_of(read[0]) == std::vector<std::string>{"/job/a/old=1"});
  CHECK(keys_of(read[1]) == std::vector<std::string>{"/job/own=mine"});
  CHECK(mirror.direct_reads() == direct);
  CHECK(mirror.mirrored_reads() >= 1);
  // Changes after the swap's revision arrive by the watch.
  other->put("/job/a/new", "2");
  other->erase("/job/a/old");
  CHECK(wait_until(
      [&] {
        return keys_of(mirror.read({RangeRead{"/job/a/", true}}).front()) ==
               std::vector<std::string>{"/job/a/new=2"};
      },
      10s));
  CHECK(mirror.direct_reads() == direct);
  CHECK(mirror.range_reads() == 0);
  // A later swap is a plain one; follow() reads afresh.
  CHECK(mirror.compare_and_swap_then_read("/job/own2", 0, "x", 0, {}));
  mirror.follow({prefix_range("/job/")});
  REQUIRE(answered_from_mirror(mirror, [&] { return mirror.get("/job/b").has_value(); }));
  CHECK(mirror.range_reads() == 1);
}
