// The partitioned coordinator's planner alone: no MPI, no accelerator, no
// threads. A model of the machinery executes every plan and checks it (a
// gather only of copies that do not exist, a retire only of outstanding
// gathers, a free only of retired copies nobody uses); random module graphs
// check the planner's rules after every call.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "ductile/error.hpp"
#include "planner.hpp"

using namespace ductile;
using namespace ductile::zero;

namespace {

// What the machinery would hold, driven only by plans.
struct MachineryModel {
  std::map<std::uint64_t, std::vector<std::uint32_t>> outstanding;  // gather id -> parameters
  std::vector<char> copy;                                           // gathered copy exists
  std::uint64_t last_gather = 0;
  std::size_t max_ongoing = 1;
  // Every prefetch gather of the last plan, in order.
  std::vector<std::uint32_t> prefetched;
  std::size_t own_gathers = 0;

  void apply(const Plan& plan, const Planner& planner) {
    if (copy.size() < planner.parameter_count()) copy.resize(planner.parameter_count(), 0);
    prefetched.clear();
    own_gathers = 0;
    for (const Step& s : plan.steps) {
      switch (s.kind) {
        case StepKind::retire:
          REQUIRE(!outstanding.empty());
          REQUIRE(outstanding.begin()->first <= s.gather);
          while (!outstanding.empty() && outstanding.begin()->first <= s.gather)
            outstanding.erase(outstanding.begin());
          break;
        case StepKind::gather: {
          REQUIRE(s.gather == last_gather + 1);  // ids ascend by one
          last_gather = s.gather;
          REQUIRE(outstanding.size() < max_ongoing);  // the limit holds at every issue
          REQUIRE(s.count > 0);
          std::vector<std::uint32_t> params;
          for (std::uint32_t pi : plan.gather_params(s)) {
            REQUIRE_FALSE(copy[pi]);
            copy[pi] = 1;
            params.push_back(pi);
            if (s.prefetch) prefetched.push_back(pi);
          }
          own_gathers += !s.prefetch;
          outstanding.emplace(s.gather, params);
          break;
        }
        case StepKind::free:
          REQUIRE(copy[s.param]);
          REQUIRE(planner.users(s.param).empty());
          for (const auto& [id, params] : outstanding)
            REQUIRE(std::find(params.begin(), params.end(), s.param) == params.end());
          copy[s.param] = 0;
          break;
      }
    }
  }

  // The planner's view equals what the plans did.
  void compare(const Planner& planner) const {
    REQUIRE(planner.outstanding_gathers() == outstanding.size());
    for (std::uint32_t pi = 0; pi < planner.parameter_count(); ++pi) {
      CAPTURE(pi);
      REQUIRE((planner.status(pi) != ParameterStatus::not_available) == (copy[pi] != 0));
    }
  }
};

struct Graph {
  std::vector<std::size_t> numel;
  std::vector<std::vector<ParameterId>> modules;
  std::vector<ModuleId> order;  // one pass: forward, then backward in reverse
  std::size_t largest = 0;
};

std::size_t pick(std::mt19937_64& rng, std::size_t lo, std::size_t hi) {
  return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
}

Graph random_graph(std::mt19937_64& rng, std::size_t scale) {
  Graph g;
  const std::size_t n_params = pick(rng, 3, 16);
  for (std::size_t p = 0; p < n_params; ++p)
    g.numel.push_back(pick(rng, 1, 60) * (pick(rng, 0, 3) == 0 ? 1 : scale));  // some persistent
  const std::size_t n_modules = pick(rng, 2, 8);
  for (std::size_t m = 0; m < n_modules; ++m) {
    std::vector<ParameterId> uses;
    for (std::size_t k = pick(rng, 1, 4); k > 0; --k)
      uses.push_back(pick(rng, 0, n_params - 1));  // shared parameters, repeats
    std::set<ParameterId> unique(uses.begin(), uses.end());
    std::size_t total = 0;
    for (auto p : unique) total += g.numel[p];
    g.largest = std::max(g.largest, total);
    g.modules.push_back(uses);
  }
  std::vector<ModuleId> forward(pick(rng, 2, 8));
  for (auto& m : forward) m = pick(rng, 0, n_modules - 1);  // modules called twice
  g.order = forward;
  g.order.insert(g.order.end(), forward.rbegin(), forward.rend());  // backward
  return g;
}

PlannerLimits random_limits(std::mt19937_64& rng, std::size_t scale) {
  PlannerLimits l;
  l.prefetch_bucket = pick(rng, 0, 3) == 0 ? 0 : scale * pick(rng, 1, 150);
  l.max_live = scale * pick(rng, 0, 200);
  l.max_reuse = pick(rng, 0, 2) == 0 ? 1'000'000'000 : scale * pick(rng, 0, 200);
  l.persistence_threshold = pick(rng, 0, 8);
  l.max_ongoing = pick(rng, 1, 4);
  return l;
}

Planner make_planner(const Graph& g, const PlannerLimits& limits) {
  Planner planner(limits);
  for (std::size_t p = 0; p < g.numel.size(); ++p) planner.add_parameter(p, g.numel[p]);
  for (std::size_t m = 0; m < g.modules.size(); ++m) planner.add_module(m, g.modules[m]);
  return planner;
}

// Drives one planner and checks every call; records every plan so that two
// runs can be compared.
class Driver {
 public:
  Driver(const Graph& g, const PlannerLimits& limits, std::uint64_t completion_seed)
      : graph_(g), limits_(limits), planner_(make_planner(g, limits)), rng_(completion_seed) {
    model_.max_ongoing = limits.max_ongoing;
  }

  Planner& planner() { return planner_; }
  const std::vector<std::string>& log() const { return log_; }
  std::uint64_t warnings_seen = 0;

  // A fetch as the coordinator makes it. `expected` is the module the
  // frozen trace expects at this step (or none).
  void fetch(ModuleId module) {
    const std::uint32_t mi = planner_.module_index(module);
    maybe_complete();
    const auto before = planner_.counters();
    const bool complete = planner_.mode() == TraceMode::complete;
    const std::vector<std::uint32_t> trace = planner_.trace();
    const std::size_t step = planner_.step();
    plan_.clear();
    const bool recording = planner_.begin_fetch(mi, plan_);
    record("begin_fetch");
    model_.apply(plan_, planner_);
    const bool deviates = complete && (step >= trace.size() || trace[step] != mi);
    check_deviation(deviates, before, complete ? expectation(trace, step, module) : "");
    CHECK(recording == (planner_.mode() == TraceMode::record));
    const std::vector<std::uint32_t> missing = planner_.missing(mi);
    plan_.clear();
    planner_.fetch(mi, plan_);
    record("fetch");
    model_.apply(plan_, planner_);
    // The module's own gather, if any, holds exactly what missing() said.
    std::vector<std::uint32_t> own;
    for (const Step& s : plan_.steps)
      if (s.kind == StepKind::gather && !s.prefetch)
        for (auto pi : plan_.gather_params(s)) own.push_back(pi);
    CHECK(own == missing);
    CHECK(model_.own_gathers <= 1);
    // Its parameters are available once the plan ran; it is a user of each.
    for (std::uint32_t pi : planner_.module_params(mi)) {
      CHECK(planner_.status(pi) == ParameterStatus::available);
      const auto& users = planner_.users(pi);
      CHECK(std::count(users.begin(), users.end(), mi) == 1);
    }
    check_prefetch_follows_trace(step);
    after_call();
  }

  void release(ModuleId module) {
    const std::uint32_t mi = planner_.module_index(module);
    maybe_complete();
    plan_.clear();
    planner_.release(mi, plan_);
    record("release");
    model_.apply(plan_, planner_);
    for (const Step& s : plan_.steps) CHECK(s.kind == StepKind::free);
    for (std::uint32_t pi : planner_.module_params(mi)) {
      const auto& users = planner_.users(pi);
      CHECK(std::count(users.begin(), users.end(), mi) == 0);
      if (planner_.persistent(pi)) CHECK(planner_.status(pi) == ParameterStatus::available);
      if (planner_.mode() == TraceMode::record && users.empty() && !planner_.persistent(pi))
        CHECK(planner_.status(pi) == ParameterStatus::not_available);
    }
    after_call();
  }

  void end_step() {
    maybe_complete();
    const auto before = planner_.counters();
    const bool complete = planner_.mode() == TraceMode::complete;
    const std::size_t trace_length = planner_.trace().size(), step = planner_.step();
    std::string expect;
    if (complete && step != trace_length)
      expect = "end " + std::to_string(step) + " " + std::to_string(trace_length) + " " +
               std::to_string(planner_.trace()[step]);
    plan_.clear();
    planner_.begin_end_step(plan_);
    record("begin_end_step");
    model_.apply(plan_, planner_);
    check_deviation(complete && step != trace_length, before, expect);
    CHECK(planner_.outstanding_gathers() == 0);
    const std::vector<std::uint32_t> order = planner_.pass_order();
    const bool recording = planner_.mode() == TraceMode::record;
    const bool deviated = planner_.counters().trace_invalidations != pass_start_invalidations_;
    plan_.clear();
    planner_.end_step(plan_);
    record("end_step");
    model_.apply(plan_, planner_);
    // A recorded pass becomes the trace unless it deviated from the old one
    // (then the next pass records); everything but persistent copies is freed.
    if (deviated) {
      CHECK(planner_.mode() == TraceMode::record);
      CHECK(planner_.trace().empty());
    } else {
      CHECK(planner_.mode() == TraceMode::complete);
      if (recording) CHECK(planner_.trace() == order);
    }
    pass_start_invalidations_ = planner_.counters().trace_invalidations;
    CHECK(planner_.step() == 0);
    const auto& c = planner_.counters();
    CHECK(c.live_numel == 0);
    CHECK(c.idle_numel == 0);
    CHECK(c.active_numel == 0);
    CHECK(planner_.outstanding_gathers() == 0);
    for (std::uint32_t pi = 0; pi < planner_.parameter_count(); ++pi)
      if (!planner_.persistent(pi)) CHECK(planner_.status(pi) == ParameterStatus::not_available);
    after_call();
  }

  void release_all(bool include_persistent) {
    plan_.clear();
    planner_.release_all(include_persistent, plan_);
    model_.apply(plan_, planner_);
    after_call();
  }

 private:
  static std::string expectation(const std::vector<std::uint32_t>& trace, std::size_t step,
                                 ModuleId module) {
    return "fetch " + std::to_string(step) + " " +
           (step < trace.size() ? std::to_string(trace[step])
                                : "end of " + std::to_string(trace.size())) +
           " " + std::to_string(module);
  }

  // A deviation counts one invalidation; it warns iff this deviation (by
  // step, expected and actual module) was not seen before.
  void check_deviation(bool deviates, const PlannerCounters& before, const std::string& key) {
    const auto& c = planner_.counters();
    CHECK(c.trace_invalidations - before.trace_invalidations == (deviates ? 1u : 0u));
    CHECK(plan_.invalidated == deviates);
    if (!deviates) {
      CHECK(plan_.warning.empty());
      return;
    }
    const bool fresh = seen_.insert(key).second;
    CHECK(plan_.warning.empty() == !fresh);
    CHECK(c.trace_warnings - before.trace_warnings == (fresh ? 1u : 0u));
    CHECK(planner_.mode() == TraceMode::record);
    CHECK(planner_.outstanding_gathers() == 0);
    if (fresh) ++warnings_seen;
  }

  // Prefetched parameters are upcoming uses of the trace, in trace order.
  void check_prefetch_follows_trace(std::size_t step) {
    if (model_.prefetched.empty()) return;
    REQUIRE(planner_.mode() == TraceMode::complete);
    CHECK(limits_.prefetch_bucket > 0);
    const auto& trace = planner_.trace();
    std::size_t at = step + 1;  // the trace position the next prefetched parameter is used at
    for (std::uint32_t pi : model_.prefetched) {
      while (at < trace.size()) {
        const auto& params = planner_.module_params(trace[at]);
        if (std::find(params.begin(), params.end(), pi) != params.end()) break;
        ++at;
      }
      CAPTURE(pi);
      CHECK(at < trace.size());
    }
  }

  void after_call() {
    model_.compare(planner_);
    planner_.check_invariants();
    const auto& c = planner_.counters();
    std::size_t fetched = 0;
    for (std::uint32_t mi = 0; mi < graph_.modules.size(); ++mi) fetched += planner_.fetched(mi);
    if (fetched <= 1) {
      CHECK(c.live_numel <= limits_.max_live + graph_.largest);
      CHECK(c.active_numel <= graph_.largest);
    }
    // Nested: the fetched modules' elements bound the active ones.
    CHECK(c.live_numel <= limits_.max_live + c.active_numel);
    CHECK(c.active_numel <= fetched * graph_.largest);
    CHECK(c.idle_numel <= limits_.max_live);
    CHECK(planner_.outstanding_gathers() <= limits_.max_ongoing);
  }

  // Timing: a gather may be seen complete at any moment; it must change no
  // decision (the plans of every run are compared).
  void maybe_complete() {
    if (pick(rng_, 0, 1) == 0 || model_.outstanding.empty()) return;
    auto it = model_.outstanding.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(pick(rng_, 0, model_.outstanding.size() - 1)));
    // Completion is in order: every older gather has completed too.
    for (auto k = model_.outstanding.begin();; ++k) {
      planner_.complete(k->first);
      if (k == it) break;
    }
  }

  void record(const char* call) {
    std::string line = call;
    for (const Step& s : plan_.steps) {
      line += s.kind == StepKind::retire ? " r" : s.kind == StepKind::gather ? " g" : " f";
      line += std::to_string(s.kind == StepKind::free ? s.param : s.gather);
      if (s.kind == StepKind::gather) {
        line += s.prefetch ? "p[" : "[";
        for (auto pi : plan_.gather_params(s)) line += std::to_string(pi) + ",";
        line += "]";
      }
    }
    log_.push_back(line);
  }

  const Graph& graph_;
  PlannerLimits limits_;
  Planner planner_;
  std::uint64_t pass_start_invalidations_ = 0;
  MachineryModel model_;
  Plan plan_;
  std::mt19937_64 rng_;
  std::set<std::string> seen_;
  std::vector<std::string> log_;
};

// One pass in `order`, each module fetched and released in turn, except
// where `nest[i]` is set: module i is then fetched around module i + 1 (a
// parent's hooks enclosing a child's, as PyTorch runs them).
void run_pass(Driver& d, const std::vector<ModuleId>& order, const std::vector<char>& nest = {}) {
  for (std::size_t i = 0; i < order.size(); ++i) {
    const bool nested =
        i < nest.size() && nest[i] && i + 1 < order.size() && order[i] != order[i + 1];
    d.fetch(order[i]);
    if (nested) {
      d.fetch(order[i + 1]);
      d.release(order[i + 1]);
      d.release(order[i]);
      ++i;
      continue;
    }
    d.release(order[i]);
  }
  d.end_step();
}

std::vector<ModuleId> deviated(const std::vector<ModuleId>& order, std::size_t kind,
                               std::size_t n_modules) {
  std::vector<ModuleId> out = order;
  switch (kind) {
    case 0:  // shorter (an evaluation pass: forward only)
      out.resize(order.size() / 2);
      break;
    case 1:  // longer
      out.push_back(static_cast<ModuleId>(n_modules - 1));
      break;
    default:  // another module in the middle
      out[out.size() / 2] = (out[out.size() / 2] + 1) % n_modules;
      break;
  }
  return out;
}

}  // namespace

TEST_CASE("property: random module graphs keep every rule at every call") {
  for (int iteration = 0; iteration < 300; ++iteration) {
    CAPTURE(iteration);
    std::mt19937_64 rng(9100 + static_cast<std::uint64_t>(iteration));
    const std::size_t scale = iteration % 2 ? 1000 : 1;  // past the per-module gather size
    const Graph g = random_graph(rng, scale);
    const PlannerLimits limits = random_limits(rng, scale);
    CAPTURE(limits.prefetch_bucket);
    CAPTURE(limits.max_live);
    CAPTURE(limits.max_reuse);
    CAPTURE(limits.max_ongoing);
    // Passes: record, follow, deviate (the trace is dropped), record the
    // new order, deviate back, deviate the same way again (no second
    // warning), and record the first order again.
    const auto other = deviated(g.order, pick(rng, 0, 2), g.modules.size());
    const std::vector<const std::vector<ModuleId>*> passes = {
        &g.order, &g.order, &other, &other, &g.order, &other, &g.order, &g.order};
    // Every third graph nests some modules inside the previous one.
    std::vector<char> nest(g.order.size() + 1, 0);
    if (iteration % 3 == 0)
      for (auto& n : nest) n = pick(rng, 0, 2) == 0;
    Driver a(g, limits, 1 + static_cast<std::uint64_t>(iteration));
    Driver b(g, limits, 7777 + static_cast<std::uint64_t>(iteration));  // other timing
    for (const auto* pass : passes) {
      run_pass(a, *pass, nest);
      run_pass(b, *pass, nest);
    }
    a.release_all(true);
    CHECK(a.planner().counters().persistent_numel == 0);
    // Same calls, different completion times: the same plans.
    CHECK(a.log() == b.log());
    CHECK(a.planner().counters().trace_warnings == a.warnings_seen);
  }
}

TEST_CASE("property: with room to prefetch, most gathers of a traced pass are prefetches") {
  for (int iteration = 0; iteration < 200; ++iteration) {
    CAPTURE(iteration);
    std::mt19937_64 rng(4200 + static_cast<std::uint64_t>(iteration));
    const std::size_t scale = iteration % 2 ? 1000 : 1;
    const Graph g = random_graph(rng, scale);
    std::size_t total = 0;
    for (auto n : g.numel) total += n;
    PlannerLimits limits;
    limits.prefetch_bucket = total;
    limits.max_live = 2 * total;  // room for a module and every prefetch
    limits.max_reuse = pick(rng, 0, 1) ? 0 : total;
    limits.persistence_threshold = pick(rng, 0, 8);
    limits.max_ongoing = pick(rng, 1, 4);
    Driver d(g, limits, static_cast<std::uint64_t>(iteration));
    run_pass(d, g.order);  // records
    // Does the pass use a gathered parameter outside its first module?
    const auto& first = g.modules[g.order[0]];
    bool others = false;
    for (ModuleId m : g.order)
      for (ParameterId p : g.modules[m])
        others = others || (g.numel[p] > limits.persistence_threshold &&
                            std::find(first.begin(), first.end(), p) == first.end());
    for (int pass = 0; pass < 3; ++pass) {
      const auto before = d.planner().counters();
      run_pass(d, g.order);
      const auto& after = d.planner().counters();
      const auto demand = after.demand_gathered_params - before.demand_gathered_params;
      const auto prefetched = after.prefetched_params - before.prefetched_params;
      // Only the first module's parameters are gathered on demand.
      CHECK(demand <= d.planner().module_params(d.planner().module_index(g.order[0])).size());
      CHECK(after.trace_invalidations == before.trace_invalidations);
      if (others) CHECK(prefetched > 0);
    }
  }
}

TEST_CASE("a fixed model: prefetch in trace order, one warning per distinct deviation") {
  const PlannerLimits limits{.prefetch_bucket = 150,
                             .max_live = 1000,
                             .max_reuse = 1'000'000'000,
                             .persistence_threshold = 0,
                             .max_ongoing = 2};
  Planner planner(limits);
  for (ParameterId id = 0; id < 6; ++id) planner.add_parameter(id, 60 + 7 * id);
  for (ModuleId m = 0; m < 4; ++m) planner.add_module(m, std::vector<ParameterId>{m, m + 1, 5});
  Plan plan;
  auto pass = [&](const std::vector<ModuleId>& order) {
    std::vector<std::string> warnings;
    for (ModuleId m : order) {
      plan.clear();
      planner.begin_fetch(planner.module_index(m), plan);
      if (!plan.warning.empty()) warnings.push_back(plan.warning);
      plan.clear();
      planner.fetch(planner.module_index(m), plan);
      plan.clear();
      planner.release(planner.module_index(m), plan);
      planner.check_invariants();
    }
    plan.clear();
    planner.begin_end_step(plan);
    if (!plan.warning.empty()) warnings.push_back(plan.warning);
    plan.clear();
    planner.end_step(plan);
    return warnings;
  };
  const std::vector<ModuleId> x = {0, 1, 2, 3}, y = {0, 2, 1, 3};
  CHECK(pass(x).empty());
  CHECK(planner.trace() == std::vector<std::uint32_t>{0, 1, 2, 3});

  // The first fetch of a traced pass prefetches the next module within the
  // bucket: module 1 uses 1 (67) and 2 (74); 5 is already there.
  plan.clear();
  planner.begin_fetch(0, plan);
  plan.clear();
  planner.fetch(0, plan);
  std::vector<std::uint32_t> prefetched;
  for (const Step& s : plan.steps)
    if (s.kind == StepKind::gather && s.prefetch)
      for (auto pi : plan.gather_params(s)) prefetched.push_back(pi);
  CHECK(prefetched == std::vector<std::uint32_t>{2});  // 1 is module 0's own; 2 fits the bucket
  plan.clear();
  planner.release(0, plan);
  for (ModuleId m : {1, 2, 3}) {
    plan.clear();
    planner.begin_fetch(static_cast<std::uint32_t>(m), plan);
    plan.clear();
    planner.fetch(static_cast<std::uint32_t>(m), plan);
    plan.clear();
    planner.release(static_cast<std::uint32_t>(m), plan);
  }
  plan.clear();
  planner.begin_end_step(plan);
  plan.clear();
  planner.end_step(plan);

  const std::vector<std::uint32_t> x_trace = {0, 1, 2, 3}, y_trace = {0, 2, 1, 3};
  const auto w1 = pass(y);
  REQUIRE(w1.size() == 1);
  CHECK(w1[0] == "step 1: expected module 1 but module 2 was fetched");
  // A deviating pass is not frozen as the trace; the next pass records.
  CHECK(planner.mode() == TraceMode::record);
  CHECK(planner.trace().empty());
  CHECK(pass(y).empty());
  CHECK(planner.trace() == y_trace);
  CHECK(pass(y).empty());      // the new trace holds
  CHECK(pass(x).size() == 1);  // a new deviation
  CHECK(pass(x).empty());      // recorded
  CHECK(pass(y).empty());      // a deviation seen before: no second warning
  CHECK(planner.counters().trace_invalidations == 3);
  CHECK(planner.counters().trace_warnings == 2);
  CHECK(pass(y).empty());
  CHECK(planner.trace() == y_trace);
  // An evaluation pass (shorter) between training passes costs one
  // invalidation, and training records its own order again, not the
  // evaluation's.
  CHECK(pass({0, 2}).size() == 1);
  CHECK(planner.trace().empty());
  CHECK(pass(y).empty());
  CHECK(planner.trace() == y_trace);
  CHECK(pass(y).empty());
  CHECK(planner.counters().trace_invalidations == 4);
  CHECK(x_trace != y_trace);
}

TEST_CASE("calls out of order and unknown ids are errors that change nothing") {
  Planner planner(PlannerLimits{.prefetch_bucket = 50'000'000,
                                .max_live = 1'000'000'000,
                                .max_reuse = 1'000'000'000,
                                .persistence_threshold = 100'000,
                                .max_ongoing = 2});
  planner.add_parameter(1, 10);
  planner.add_module(7, std::vector<ParameterId>{1});
  auto kind_of = [](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return e.kind();
    }
    return ErrorKind::internal;
  };
  CHECK(kind_of([&] { planner.add_parameter(1, 5); }) == ErrorKind::invalid_argument);
  CHECK(kind_of([&] { planner.add_parameter(2, 0); }) == ErrorKind::invalid_argument);
  CHECK(kind_of([&] { planner.add_module(7, std::vector<ParameterId>{1}); }) ==
        ErrorKind::invalid_argument);
  CHECK(kind_of([&] { planner.add_module(8, std::vector<ParameterId>{3}); }) ==
        ErrorKind::invalid_argument);
  CHECK(kind_of([&] { planner.module_index(9); }) == ErrorKind::invalid_argument);
  Plan plan;
  CHECK(kind_of([&] { planner.release(0, plan); }) == ErrorKind::invalid_argument);
  planner.begin_fetch(0, plan);
  planner.fetch(0, plan);
  CHECK(kind_of([&] { planner.begin_fetch(0, plan); }) == ErrorKind::invalid_argument);
  CHECK(kind_of([&] { planner.begin_end_step(plan); }) == ErrorKind::invalid_argument);
  CHECK(kind_of([&] { planner.drop_copy("set_shard", 0, plan); }) == ErrorKind::incompatible);
  planner.check_invariants();
  plan.clear();
  planner.release(0, plan);
  planner.begin_end_step(plan);
  planner.end_step(plan);
  planner.check_invariants();
  CHECK(planner.parameter_count() == 1);
}
