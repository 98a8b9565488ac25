// The pool of gathered copies alone (plugins/zero/partitioned/copy_pool.cpp,
// compiled into this test) over the real cpu accelerator: resting gives an
// idle buffer's pages back, and a rested buffer taken again comes back with
// its pages mapped before anything writes it (MADV_POPULATE_WRITE), so that
// the gather into it does not fault page by page.
#include <doctest/doctest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "copy_pool.hpp"
#include "ductile/accelerator.hpp"
#include "ductile/core/runtime.hpp"
#include "residency.hpp"

using namespace ductile;
using zero_test::Residency;
using zero_test::residency;

namespace {

std::shared_ptr<Accelerator> cpu_accelerator() {
  static core::Runtime runtime =
      core::Runtime::from_string(std::string("[plugins]\npath = [\"") + DUCTILE_PLUGIN_DIR +
                                     "\"]\n[accelerator]\nbackend = \"cpu\"\n",
                                 "copy_pool_test.toml");
  return runtime.get<Accelerator>();
}

// Whether this kernel populates on request (Linux 5.14 and later).
bool kernel_populates() {
#if defined(MADV_POPULATE_WRITE)
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  void* probe = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(probe != MAP_FAILED);
  const bool ok = madvise(probe, page, MADV_POPULATE_WRITE) == 0;
  munmap(probe, page);
  return ok;
#else
  return false;
#endif
}

}  // namespace

TEST_CASE("CopyPool: a rested buffer is taken back with its pages mapped, and zeroed") {
  const std::size_t bytes = 8 << 20;
  zero::CopyPool pool(cpu_accelerator());
  void* a = pool.take(bytes);
  void* b = pool.take(bytes);
  std::memset(a, 0x5a, bytes);
  std::memset(b, 0x5a, bytes);
  pool.give(a, bytes);
  pool.rest();
  pool.give(b, bytes);  // given while resting: rests too
  CHECK(residency(a, bytes).resident == 0);
  CHECK(residency(b, bytes).resident == 0);
  REQUIRE(residency(a, bytes).pages > 0);

  // Taken again, before anything writes it.
  void* first = pool.take(bytes);
  void* second = pool.take(bytes);
  CHECK(pool.stats().allocations == 2);
  CHECK(pool.stats().reuses == 2);
  const bool populates = kernel_populates();
  CAPTURE(populates);
  for (void* p : {first, second}) {
    CHECK((p == a || p == b));
    const auto [pages, resident, first_page] = residency(p, bytes);
    CHECK(resident == (populates ? pages : 0));
    // The whole pages were given back: they read as zero, not as 0x5a.
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    const auto* at = reinterpret_cast<const unsigned char*>(first_page);
    CHECK(at[0] == 0);
    CHECK(at[pages * page - 1] == 0);
  }
  pool.give(first, bytes);
  pool.give(second, bytes);
}

TEST_CASE("CopyPool: a buffer that did not rest is taken back as it was") {
  const std::size_t bytes = 4 << 20;
  zero::CopyPool pool(cpu_accelerator());
  void* a = pool.take(bytes);
  std::memset(a, 0x33, bytes);
  pool.give(a, bytes);
  void* again = pool.take(bytes);
  REQUIRE(again == a);
  const Residency kept = residency(a, bytes);
  CHECK(kept.resident == kept.pages);
  CHECK(static_cast<const unsigned char*>(a)[bytes / 2] == 0x33);
  pool.give(again, bytes);
}
