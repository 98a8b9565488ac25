// The partitioned ZeRO-3 coordinator on the real cpu backend under mpirun with
// 1, 2 and 3 ranks. Every rank runs the same test cases in the same order.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>

#include "zero_support.hpp"

using namespace zero_test;

namespace {

std::size_t count_of(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// Captures what this process writes to standard error (the core's log sink).
class StderrCapture {
 public:
  StderrCapture() : file_(std::tmpfile()) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    ::dup2(::fileno(file_), 2);
  }
  std::string finish() {
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    std::string text;
    std::rewind(file_);
    char buffer[4096];
    std::size_t n;
    while ((n = std::fread(buffer, 1, sizeof buffer, file_)) > 0) text.append(buffer, n);
    std::fclose(file_);
    return text;
  }

 private:
  std::FILE* file_;
  int saved_ = -1;
};

}  // namespace

TEST_CASE("gathered parameters equal the originals for sizes not divisible by the rank count") {
  auto& e = env();
  ZeroConfig config;
  config.param_persistence_threshold = 3;  // sizes 1 and 2 stay gathered once fetched
  auto zero = make_coordinator(config);
  const std::vector<std::size_t> sizes = {1, 2, 5, 7, 13, 100, 1001, 4099};
  const std::vector<DataType> types = {DataType::f32, DataType::f64, DataType::i32,  DataType::f16,
                                       DataType::u8,  DataType::i64, DataType::bf16, DataType::f32};
  std::vector<ParameterId> all;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    ParameterId id = 100 + k;
    zero->register_parameter({id, sizes[k], types[k]});
    auto bytes = param_bytes(id, sizes[k] * size_of(types[k]), 0);
    zero->set_full(id, bytes.data(), bytes.size());
    zero->register_module(k, std::vector<ParameterId>{id});
    all.push_back(id);
  }
  zero->register_module(99, all);

  // Each rank's shard is its slice, the last one zero-padded.
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const std::size_t esize = size_of(types[k]);
    const std::size_t shard = zero->shard_numel(100 + k);
    CHECK(shard == (sizes[k] + e.size - 1) / e.size);
    std::vector<std::uint8_t> got(shard * esize), full = param_bytes(100 + k, sizes[k] * esize, 0),
                                                  want(shard * esize, 0);
    const std::size_t first = static_cast<std::size_t>(e.rank) * shard;
    for (std::size_t i = first; i < std::min(first + shard, sizes[k]); ++i)
      std::memcpy(want.data() + (i - first) * esize, full.data() + i * esize, esize);
    zero->read_shard(100 + k, got.data(), got.size());
    CHECK(got == want);
  }

  std::vector<ModuleId> order = {0, 1, 2, 3, 4, 5, 6, 7, 99, 7, 3};
  for (int pass = 0; pass < 3; ++pass) {
    for (ModuleId m : order) {
      zero->fetch(m);
      std::vector<ParameterId> ids = m == 99 ? all : std::vector<ParameterId>{100 + m};
      for (ParameterId id : ids) {
        const std::size_t k = id - 100, esize = size_of(types[k]);
        CHECK(zero->status(id) == ParameterStatus::available);
        CHECK(gathered_matches(*zero, id, sizes[k] * esize, 0));
        // The device copy (host memory on the cpu backend): the parameter,
        // then zero padding up to size * shard elements.
        if (e.accel->backend() == "cpu") {
          const auto* full = static_cast<const std::uint8_t*>(zero->full_data(id));
          auto want = param_bytes(id, sizes[k] * esize, 0);
          CHECK(std::memcmp(full, want.data(), want.size()) == 0);
          const std::size_t padded =
              zero->shard_numel(id) * static_cast<std::size_t>(e.size) * esize;
          CHECK(std::all_of(full + want.size(), full + padded,
                            [](std::uint8_t b) { return b == 0; }));
        }
      }
      zero->release(m);
      zero->check_invariants();
    }
    zero->end_step();
    CHECK(zero->trace_mode() == TraceMode::complete);
    CHECK(zero->stats().live_numel == 0);
  }
  CHECK(zero->is_persistent(100));
  CHECK(zero->is_persistent(101));
  CHECK_FALSE(zero->is_persistent(102));
  CHECK(zero->status(100) == ParameterStatus::available);  // persistent
  CHECK(zero->status(104) == ParameterStatus::not_available);
  CHECK(zero->trace() == order);
}

TEST_CASE("an order change between steps invalidates the trace once per distinct deviation") {
  auto& e = env();
  ZeroConfig config;
  config.prefetch_bucket_size = 150;
  auto zero = make_coordinator(config);
  for (ParameterId id = 0; id < 6; ++id) register_f32(*zero, id, 60 + 7 * id);
  for (ModuleId m = 0; m < 4; ++m) zero->register_module(m, std::vector<ParameterId>{m, m + 1, 5});
  const std::vector<ModuleId> x = {0, 1, 2, 3}, y = {0, 2, 1, 3};
  const std::vector<const std::vector<ModuleId>*> passes = {&x, &x, &y, &y, &x, &y, &x, &y, &x, &x};
  StderrCapture capture;
  int version = 0;
  for (const auto* order : passes) {
    for (ModuleId m : *order) {
      zero->fetch(m);
      for (ParameterId id : {m, m + 1, ParameterId{5}})
        CHECK(gathered_matches(*zero, id, (60 + 7 * id) * 4, version));
      zero->release(m);
      zero->check_invariants();
    }
    zero->end_step();
    CHECK(zero->stats().live_numel == 0);
    // New values each pass: a stale copy would show.
    ++version;
    for (ParameterId id = 0; id < 6; ++id) {
      auto bytes = param_bytes(id, (60 + 7 * id) * 4, version);
      zero->set_full(id, bytes.data(), bytes.size());
    }
  }
  std::string log = capture.finish();
  auto stats = zero->stats();
  // A deviating pass is not frozen; the next one is recorded. Traces: x
  // after pass 1; pass 3 (y) deviates, pass 4 records y; pass 5 (x)
  // deviates, 6 records y; 7 deviates, 8 records y; 9 deviates, 10 records
  // x: four invalidations, two distinct deviations.
  CHECK(stats.trace_invalidations == 4);
  CHECK(stats.trace_warnings == 2);
  CHECK(zero->trace() == x);
  CHECK(stats.prefetched_params > 0);
  const std::size_t warned = count_of(log, "deviates from the recorded trace");
  if (e.rank == 0)
    CHECK(warned == 2);
  else
    CHECK(warned == 0);
  std::fputs(log.c_str(), stderr);
}

TEST_CASE("a rank-order mismatch while recording is an error on every rank, without a hang") {
  auto& e = env();
  if (e.size < 2) {
    MESSAGE("needs at least 2 ranks: a single rank cannot disagree with itself");
    return;
  }
  {
    auto zero = make_coordinator({});
    register_f32(*zero, 0, 100);
    register_f32(*zero, 1, 37);
    zero->register_module(0, std::vector<ParameterId>{0});
    zero->register_module(1, std::vector<ParameterId>{1});
    // Rank 0 runs 0 then 1; the others 1 then 0 (gathers of different sizes).
    ModuleId first = e.rank == 0 ? 0 : 1;
    try {
      zero->fetch(first);
      FAIL("fetch() with different modules on different ranks did not throw");
    } catch (const Error& error) {
      CHECK(error.kind() == ErrorKind::communication);
      std::string what = error.what();
      CHECK(what.find("rank-order mismatch") != std::string::npos);
      CHECK(what.find("rank 0 fetch(module 0) at step 0") != std::string::npos);
      CHECK(what.find("rank 1 fetch(module 1) at step 0") != std::string::npos);
    }
    CHECK(zero->active_modules(first).empty());
  }
  {
    // Different pass lengths: rank 0 ends the pass while the others fetch more.
    auto zero = make_coordinator({});
    register_f32(*zero, 0, 10);
    register_f32(*zero, 1, 11);
    zero->register_module(0, std::vector<ParameterId>{0});
    zero->register_module(1, std::vector<ParameterId>{1});
    zero->fetch(0);
    zero->release(0);
    try {
      if (e.rank == 0)
        zero->end_step();
      else
        zero->fetch(1);
      FAIL("a pass of different length on different ranks did not throw");
    } catch (const Error& error) {
      CHECK(error.kind() == ErrorKind::communication);
      std::string what = error.what();
      CHECK(what.find("rank 0 end_step() after 1 modules") != std::string::npos);
      CHECK(what.find("rank 1 fetch(module 1) at step 1") != std::string::npos);
    }
  }
  // The communicator is still in step on every rank.
  std::int64_t mine = e.rank, all[3] = {};
  auto stream = e.accel->create_stream();
  e.world->all_gather(&mine, all, 1, DataType::i64, *stream)->wait();
  for (int r = 0; r < e.size; ++r) CHECK(all[r] == r);
}

TEST_CASE("usage errors name the call, the id and what is valid") {
  auto zero = make_coordinator({});
  register_f32(*zero, 1, 8);
  zero->register_module(1, std::vector<ParameterId>{1});
  auto message_of = [](auto&& call, ErrorKind kind) {
    try {
      call();
    } catch (const Error& e) {
      CHECK(e.kind() == kind);
      return std::string(e.what());
    }
    FAIL("no error");
    return std::string();
  };
  CHECK(message_of(
            [&] {
              zero->register_parameter({1, 4, DataType::f32});
            },
            ErrorKind::invalid_argument)
            .find("parameter 1 is already registered") != std::string::npos);
  CHECK(message_of(
            [&] {
              zero->register_parameter({2, 0, DataType::f32});
            },
            ErrorKind::invalid_argument)
            .find("0 elements") != std::string::npos);
  CHECK(message_of([&] { zero->register_module(2, std::vector<ParameterId>{7}); },
                   ErrorKind::invalid_argument)
            .find("parameter 7, which is not registered") != std::string::npos);
  CHECK(message_of([&] { zero->fetch(5); }, ErrorKind::invalid_argument)
            .find("module 5 is not registered") != std::string::npos);
  CHECK(message_of([&] { zero->release(1); }, ErrorKind::invalid_argument).find("not fetched") !=
        std::string::npos);
  float four[4] = {};
  CHECK(message_of([&] { zero->read_full(1, four, sizeof four); }, ErrorKind::invalid_argument)
            .find("got 16 bytes, expected 32") != std::string::npos);
  float eight[8] = {};
  CHECK(message_of([&] { zero->read_full(1, eight, sizeof eight); }, ErrorKind::incompatible)
            .find("not_available") != std::string::npos);
  CHECK(message_of([&] { zero->set_shard(1, four, 3); }, ErrorKind::invalid_argument)
            .find("got 3 bytes") != std::string::npos);
  zero->fetch(1);
  CHECK(message_of([&] { zero->fetch(1); }, ErrorKind::invalid_argument).find("already fetched") !=
        std::string::npos);
  CHECK(message_of([&] { zero->set_full(1, eight, sizeof eight); }, ErrorKind::incompatible)
            .find("in use by fetched module 1") != std::string::npos);
  CHECK(message_of([&] { zero->end_step(); }, ErrorKind::invalid_argument)
            .find("module(s) 1 are still fetched") != std::string::npos);
  zero->release(1);
  zero->end_step();
}

TEST_CASE("shard_data: shards written in place are what the next gather returns") {
  auto& e = env();
  ZeroConfig config;
  config.param_persistence_threshold = 4;  // parameter 2 stays gathered once fetched
  auto zero = make_coordinator(config);
  register_f32(*zero, 1, 11);
  register_f32(*zero, 2, 3);
  zero->register_module(1, std::vector<ParameterId>{1, 2});
  zero->register_module(2, std::vector<ParameterId>{2});
  REQUIRE(zero->is_persistent(2));
  REQUIRE_FALSE(zero->is_persistent(1));

  // The pointer is the shard read_shard() copies out.
  for (ParameterId id : {1, 2}) {
    std::vector<float> copy(zero->shard_numel(id));
    zero->read_shard(id, copy.data(), copy.size() * sizeof(float));
    CHECK(std::memcmp(zero->shard_data(id), copy.data(), copy.size() * sizeof(float)) == 0);
  }
  zero->fetch(1);
  zero->release(1);
  zero->end_step();
  REQUIRE(zero->status(2) == ParameterStatus::available);  // persistent: still gathered

  // An optimizer's in-place update: every element becomes its global index
  // + 1000 * rank-independent offset; the padding stays 0.
  for (ParameterId id : {1, 2}) {
    const std::size_t shard = zero->shard_numel(id), numel = id == 1 ? 11 : 3;
    auto* data = static_cast<float*>(zero->shard_data(id));
    for (std::size_t i = 0; i < shard; ++i) {
      const std::size_t global = static_cast<std::size_t>(e.rank) * shard + i;
      data[i] = global < numel ? static_cast<float>(1000 * id + global) : 0.0f;
    }
    zero->shard_written(id);
  }
  CHECK(zero->status(2) == ParameterStatus::not_available);  // the stale copy was dropped
  zero->fetch(1);
  for (ParameterId id : {1, 2}) {
    const std::size_t numel = id == 1 ? 11 : 3;
    std::vector<float> got(numel);
    zero->read_full(id, got.data(), got.size() * sizeof(float));
    for (std::size_t i = 0; i < numel; ++i) CHECK(got[i] == static_cast<float>(1000 * id + i));
  }
  // Not while a fetched module uses it; unknown ids are refused.
  try {
    zero->shard_written(1);
    FAIL("no error");
  } catch (const Error& err) {
    CHECK(err.kind() == ErrorKind::incompatible);
    CHECK(std::string(err.what()).find("shard_written(1)") != std::string::npos);
  }
  zero->release(1);
  zero->end_step();
  CHECK_THROWS_AS(zero->shard_data(77), Error);
  zero->check_invariants();
}

TEST_CASE("property: random module graphs and limits keep every invariant at every call") {
  auto& e = env();
  const int iterations = 24;
  for (int iteration = 0; iteration < iterations; ++iteration) {
    CAPTURE(iteration);
    std::mt19937_64 rng(7000 + static_cast<std::uint64_t>(iteration));  // same on every rank
    auto pick = [&](std::size_t lo, std::size_t hi) {
      return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
    };
    // Every other iteration scales sizes and limits up, past the size at
    // which prefetches of consecutive modules get separate gathers.
    const std::size_t scale = iteration % 2 ? 1000 : 1;
    const double dscale = static_cast<double>(scale);
    ZeroConfig config;
    config.prefetch_bucket_size =
        pick(0, 2) == 0 ? 0.0 : dscale * static_cast<double>(pick(1, 150));
    config.max_live_parameters = dscale * static_cast<double>(pick(0, 200));
    config.max_reuse_distance = pick(0, 2) == 0 ? 1e9 : dscale * static_cast<double>(pick(0, 200));
    config.param_persistence_threshold = static_cast<double>(pick(0, 8));
    config.max_ongoing_fetch_events = static_cast<std::int64_t>(pick(1, 3));
    auto zero = make_coordinator(config);

    const std::size_t n_params = pick(3, 12);
    std::vector<std::size_t> numel(n_params);
    for (std::size_t p = 0; p < n_params; ++p) {
      numel[p] = pick(1, 60) * (pick(0, 3) == 0 ? 1 : scale);  // small ones stay persistent
      register_f32(*zero, p, numel[p], 0);
    }
    const std::size_t n_modules = pick(2, 6);
    std::vector<std::vector<ParameterId>> modules(n_modules);
    std::size_t largest = 0;
    for (std::size_t m = 0; m < n_modules; ++m) {
      std::size_t k = pick(1, 4);
      for (std::size_t j = 0; j < k; ++j)
        modules[m].push_back(pick(0, n_params - 1));  // may repeat
      zero->register_module(m, modules[m]);
      std::set<ParameterId> unique(modules[m].begin(), modules[m].end());
      std::size_t total = 0;
      for (auto p : unique) total += numel[p];
      largest = std::max(largest, total);
    }
    std::vector<ModuleId> order(pick(3, 12));
    for (auto& m : order) m = pick(0, n_modules - 1);  // repeated modules

    for (int pass = 0; pass < 5; ++pass) {
      std::vector<ModuleId> this_pass = order;
      if (pass == 3 && this_pass.size() > 1) this_pass.pop_back();    // deviation: shorter
      if (pass == 4) std::swap(this_pass.front(), this_pass.back());  // deviation or same
      for (ModuleId m : this_pass) {
        zero->fetch(m);
        zero->check_invariants();
        auto st = zero->stats();
        CHECK(st.live_numel <= st.max_live_numel + largest);
        CHECK(st.active_numel <= largest);
        CHECK(st.inflight_gathers <= static_cast<std::size_t>(config.max_ongoing_fetch_events));
        for (ParameterId p : modules[m]) {
          CHECK(zero->status(p) == ParameterStatus::available);
          CHECK(zero->active_modules(p) == std::vector<ModuleId>{m});
          CHECK(gathered_matches(*zero, p, numel[p] * 4, pass));
        }
        if (pick(0, 3) == 0) zero->progress();
        zero->release(m);
        zero->check_invariants();
        st = zero->stats();
        CHECK(st.active_numel == 0);
        CHECK(st.idle_numel <= st.max_live_numel);
        for (ParameterId p : modules[m]) {
          CHECK(zero->active_modules(p).empty());
          if (zero->is_persistent(p))
            CHECK(zero->status(p) == ParameterStatus::available);
          else if (zero->trace_mode() == TraceMode::record)
            CHECK(zero->status(p) == ParameterStatus::not_available);
        }
      }
      zero->end_step();
      zero->check_invariants();
      auto st = zero->stats();
      CHECK(st.live_numel == 0);
      CHECK(st.inflight_gathers == 0);
      for (std::size_t p = 0; p < n_params; ++p)
        if (!zero->is_persistent(p)) CHECK(zero->status(p) == ParameterStatus::not_available);
      for (std::size_t p = 0; p < n_params; ++p) {
        auto bytes = param_bytes(p, numel[p] * 4, pass + 1);
        zero->set_full(p, bytes.data(), bytes.size());
      }
    }
    zero->release_all(true);
    zero->check_invariants();
    CHECK(zero->stats().persistent_numel == 0);
    for (std::size_t p = 0; p < n_params; ++p)
      CHECK(zero->status(p) == ParameterStatus::not_available);
  }
  (void)e;
}

TEST_CASE("prefetch gives large upcoming modules a gather each, within max_ongoing_fetch_events") {
  for (std::int64_t ongoing : {2, 3}) {
    CAPTURE(ongoing);
    ZeroConfig config;
    config.max_ongoing_fetch_events = ongoing;
    auto zero = make_coordinator(config);
    for (ParameterId id = 0; id < 4; ++id) {
      register_f32(*zero, id, 40000 + id);
      zero->register_module(id, std::vector<ParameterId>{id});
    }
    for (int pass = 0; pass < 2; ++pass) {
      const auto before = zero->stats();
      zero->fetch(0);
      auto after = zero->stats();
      if (pass == 0) {
        CHECK(after.gathers - before.gathers == 1);  // recording: no prefetch
      } else {
        // One demand gather, then one gather per upcoming module until the
        // limit of outstanding gathers.
        CHECK(after.gathers - before.gathers == static_cast<std::uint64_t>(1 + ongoing));
        CHECK(after.inflight_gathers == static_cast<std::size_t>(ongoing));
        CHECK(gathered(*zero, 1));
        CHECK(gathered(*zero, 2));
        CHECK(gathered(*zero, 3) == (ongoing == 3));
      }
      zero->release(0);
      for (ModuleId m = 1; m < 4; ++m) {
        zero->fetch(m);
        CHECK(gathered_matches(*zero, m, (40000 + m) * 4, 0));
        CHECK(zero->stats().inflight_gathers <= static_cast<std::size_t>(ongoing));
        zero->release(m);
        zero->check_invariants();
      }
      if (pass == 1)
        CHECK(zero->stats().demand_gathered_params - before.demand_gathered_params == 1);
      zero->end_step();
    }
  }
}

TEST_CASE("with a compute stream: gathers are ordered before compute, frees after it") {
  auto& e = env();
  ZeroConfig config;
  config.prefetch_bucket_size = 300;
  config.max_reuse_distance = 0;
  auto zero = make_coordinator(config);
  auto compute = e.accel->create_stream();
  zero->set_compute_stream(compute);
  for (ParameterId id = 0; id < 5; ++id) register_f32(*zero, id, 101 + 50 * id);
  for (ModuleId m = 0; m < 4; ++m) zero->register_module(m, std::vector<ParameterId>{m, m + 1});
  std::vector<std::uint8_t> copy;
  for (int pass = 0; pass < 3; ++pass) {
    for (ModuleId m : {0, 1, 2, 3, 3, 2, 1, 0}) {
      zero->fetch(static_cast<ModuleId>(m));
      for (ParameterId id : {static_cast<ParameterId>(m), static_cast<ParameterId>(m) + 1}) {
        // Work on the compute stream reads the gathered copy.
        const std::size_t bytes = (101 + 50 * id) * 4;
        copy.assign(bytes, 0);
        e.accel->copy_async(copy.data(), zero->full_data(id), bytes, CopyKind::device_to_host,
                            *compute);
        compute->synchronize();
        CHECK(copy == param_bytes(id, bytes, 0));
      }
      zero->release(static_cast<ModuleId>(m));
      zero->progress();
      zero->check_invariants();
    }
    zero->end_step();
  }
  CHECK(zero->stats().prefetched_params > 0);
  zero->set_compute_stream(nullptr);
}
