// Which pages of a buffer are resident (mincore), for the tests of the
// pool of gathered copies (gather_memory_test.cpp, copy_pool_test.cpp).
#pragma once

#include <doctest/doctest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zero_test {

// Resident pages among the whole pages inside [pointer, pointer + bytes),
// the first of which starts at `first`.
struct Residency {
  std::size_t pages = 0;
  std::size_t resident = 0;
  std::uintptr_t first = 0;
};

inline Residency residency(const void* pointer, std::size_t bytes) {
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto start = reinterpret_cast<std::uintptr_t>(pointer);
  const std::uintptr_t first = (start + page - 1) / page * page;
  const std::uintptr_t last = (start + bytes) / page * page;
  Residency r;
  r.first = first;
  if (last <= first) return r;
  r.pages = (last - first) / page;
  std::vector<unsigned char> map(r.pages);
  REQUIRE(mincore(reinterpret_cast<void*>(first), last - first, map.data()) == 0);
  for (unsigned char m : map) r.resident += m & 1;
  return r;
}

}  // namespace zero_test
