// The partitioned coordinator's parameter statuses around each module, on
// the real cpu backend under mpirun with 1, 2 and 3 ranks. Every rank runs the same test cases
// in the same order.
#include <algorithm>
#include <cstddef>
#include <memory>
#include <vector>

#include "zero_support.hpp"

using namespace zero_test;

// DeepSpeed's partitioning tests check the status of every parameter around
// each module; here with a fixed model whose expected statuses follow from
// the rules (see each case).
namespace {

// m_i uses a_i = 10 + i and b_i = 20 + i (100 elements each); m1 and m2 share
// s = 30 (100 elements); m0 and m3 share the persistent t = 40 (4 elements).
std::shared_ptr<ParameterCoordinator> status_model(ZeroConfig config) {
  config.param_persistence_threshold = 10;
  auto zero = make_coordinator(config);
  for (int i = 0; i < 4; ++i) {
    register_f32(*zero, 10 + i, 100);
    register_f32(*zero, 20 + i, 100);
  }
  register_f32(*zero, 30, 100);
  register_f32(*zero, 40, 4);
  zero->register_module(0, std::vector<ParameterId>{10, 20, 40});
  zero->register_module(1, std::vector<ParameterId>{11, 21, 30});
  zero->register_module(2, std::vector<ParameterId>{12, 22, 30});
  zero->register_module(3, std::vector<ParameterId>{13, 23, 40});
  return zero;
}

const std::vector<ParameterId> kStatusParams = {10, 11, 12, 13, 20, 21, 22, 23, 30, 40};

std::vector<ParameterId> params_of(ModuleId m) {
  std::vector<ParameterId> p = {10 + m, 20 + m};
  if (m == 1 || m == 2) p.push_back(30);
  if (m == 0 || m == 3) p.push_back(40);
  return p;
}

// Without prefetch and without reuse, only the fetched module's parameters
// (and the persistent t once fetched) are gathered, in every pass.
void check_plain_pass(ParameterCoordinator& zero, bool first_pass) {
  for (ModuleId m = 0; m < 4; ++m) {
    for (ParameterId id : kStatusParams) {
      bool expect = id == 40 && !(first_pass && m == 0);
      CHECK_MESSAGE(gathered(zero, id) == expect, "before fetch(" << m << ") parameter " << id);
    }
    zero.fetch(m);
    auto mine = params_of(m);
    for (ParameterId id : kStatusParams) {
      bool in_module = std::find(mine.begin(), mine.end(), id) != mine.end();
      if (in_module) {
        CHECK(zero.status(id) == ParameterStatus::available);
        CHECK(zero.active_modules(id) == std::vector<ModuleId>{m});
      } else {
        CHECK_MESSAGE(gathered(zero, id) == (id == 40),
                      "after fetch(" << m << ") parameter " << id);
        CHECK(zero.active_modules(id).empty());
      }
    }
    zero.release(m);
    zero.check_invariants();
    for (ParameterId id : mine) {
      CHECK_MESSAGE(gathered(zero, id) == (id == 40),
                    "after release(" << m << ") parameter " << id);
      CHECK(zero.active_modules(id).empty());
    }
  }
  zero.end_step();
}

}  // namespace

TEST_CASE("parameter status around each module: prefetch off, with and without a trace") {
  ZeroConfig config;
  config.prefetch_bucket_size = 0;
  config.max_reuse_distance = 0;
  auto zero = status_model(config);
  check_plain_pass(*zero, true);  // recording
  CHECK(zero->trace_mode() == TraceMode::complete);
  check_plain_pass(*zero, false);  // complete trace, nothing gathered ahead
  check_plain_pass(*zero, false);
  CHECK(zero->stats().prefetched_params == 0);
}

TEST_CASE("parameter status around each module: prefetch on, with and without a trace") {
  ZeroConfig config;
  config.prefetch_bucket_size = 200;  // two parameters of 100 elements
  config.max_reuse_distance = 0;
  auto zero = status_model(config);
  check_plain_pass(*zero, true);  // while recording nothing is prefetched
  CHECK(zero->stats().prefetched_params == 0);

  // Complete trace. Queue: m0 {10,20,40}, m1 {11,21,30}, m2 {12,22,30}, m3 {13,23,40}.
  zero->fetch(0);  // prefetches 11 and 21 (200 elements); 30 would exceed the bucket
  CHECK(gathered(*zero, 11));
  CHECK(gathered(*zero, 21));
  CHECK_FALSE(gathered(*zero, 30));
  CHECK_FALSE(gathered(*zero, 12));
  CHECK(zero->active_modules(11).empty());
  zero->release(0);
  CHECK_FALSE(gathered(*zero, 10));
  CHECK_FALSE(gathered(*zero, 20));
  CHECK(gathered(*zero, 40));  // persistent
  zero->check_invariants();

  zero->fetch(1);  // 30 on demand; prefetches 12 and 22; skips 30 (available) and stops at 13
  for (ParameterId id : {11, 21, 30}) CHECK(zero->status(id) == ParameterStatus::available);
  CHECK(gathered(*zero, 12));
  CHECK(gathered(*zero, 22));
  CHECK_FALSE(gathered(*zero, 13));
  CHECK_FALSE(gathered(*zero, 23));
  zero->release(1);
  CHECK_FALSE(gathered(*zero, 11));
  CHECK_FALSE(gathered(*zero, 21));
  // Reuse distance 0, but the prefetch scan already passed 30's use in m2:
  // freeing it would lose that use, so it is kept.
  CHECK(zero->status(30) == ParameterStatus::available);
  zero->check_invariants();

  zero->fetch(2);  // prefetches 13 and 23
  CHECK(gathered(*zero, 13));
  CHECK(gathered(*zero, 23));
  CHECK(zero->active_modules(30) == std::vector<ModuleId>{2});
  zero->release(2);
  for (ParameterId id : {12, 22, 30}) CHECK_FALSE(gathered(*zero, id));
  zero->check_invariants();

  zero->fetch(3);
  zero->release(3);
  for (ParameterId id : kStatusParams) CHECK(gathered(*zero, id) == (id == 40));
  auto stats = zero->stats();
  CHECK(stats.prefetched_params == 6);
  CHECK(stats.demand_gathered_params >= 1);
  zero->end_step();
  CHECK(zero->stats().live_numel == 0);
}

TEST_CASE("parameter status: reuse distance keeps copies within max_live_parameters") {
  // Forward then backward: every block is used again later.
  const std::vector<ModuleId> order = {0, 1, 2, 3, 3, 2, 1, 0};
  for (double max_live : {1e9, 100.0}) {
    CAPTURE(max_live);
    ZeroConfig config;
    config.prefetch_bucket_size = 0;
    config.max_reuse_distance = 1e9;
    config.max_live_parameters = max_live;
    auto zero = status_model(config);
    for (int pass = 0; pass < 3; ++pass) {
      for (std::size_t s = 0; s < order.size(); ++s) {
        ModuleId m = order[s];
        zero->fetch(m);
        zero->release(m);
        zero->check_invariants();
        auto st = zero->stats();
        CHECK(st.idle_numel <= st.max_live_numel);
        bool used_later = std::find(order.begin() + static_cast<std::ptrdiff_t>(s) + 1, order.end(),
                                    m) != order.end();
        if (pass == 0) {
          // Recording: nothing kept.
          CHECK_FALSE(gathered(*zero, 10 + m));
          CHECK_FALSE(gathered(*zero, 20 + m));
        } else if (max_live >= 1e9) {
          CHECK(gathered(*zero, 10 + m) == used_later);
          CHECK(gathered(*zero, 20 + m) == used_later);
        } else {
          // Room for one 100-element copy not used by a fetched module.
          int idle_copies = 0;
          for (ParameterId id : kStatusParams)
            idle_copies += id != 40 && gathered(*zero, id) && zero->active_modules(id).empty();
          CHECK(idle_copies <= 1);
          if (!used_later) {
            CHECK_FALSE(gathered(*zero, 10 + m));
            CHECK_FALSE(gathered(*zero, 20 + m));
          }
        }
      }
      zero->end_step();
      CHECK(zero->stats().live_numel == 0);
    }
    CHECK(zero->stats().retained_params > 0);
  }
}
