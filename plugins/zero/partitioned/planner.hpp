// The planner of the partitioned ZeRO-3 coordinator: every decision, none of
// the execution. It records and freezes the module-order trace, invalidates
// it on a deviation, decides which parameters to gather now (a fetch's own
// parameters, then prefetches in trace order) and which gathered copies to
// free, keeps the live-element accounting and checks its invariants.
//
// It has no MPI, no accelerator, no threads and no clock: it takes events
// (fetch, release, end of a pass, a gather observed complete) and returns a
// Plan, the ordered steps the machinery (gather_pipeline.hpp) executes:
// retire gathers (wait for them), issue a gather, free a copy. What it plans
// depends only on the sequence of calls, never on timing, so every rank that
// makes the same calls issues the same collectives.
//
// Protocol (the coordinator in coordinator.cpp follows it; the planner tests
// in tests/plugins/zero/partitioned/planner_test.cpp drive it directly):
//   fetch:    begin_fetch(m, plan) -> execute; if it returned true, agree the
//             call across ranks; missing(m) may be staged now; then
//             fetch(m, plan) -> execute (the first gather step, if any, is
//             the module's own, with exactly the parameters missing() gave).
//   release:  release(m, plan) -> execute.
//   end_step: begin_end_step(plan) -> execute; agree the pass across ranks;
//             end_step(plan) -> execute.
// A step that cannot be executed (an NVMe read failed before a gather was
// issued) is reported back with cancel_gather() for that gather and every
// later one of the plan, newest first.
//
// Threading: one thread at a time, like the coordinator. Errors: throws
// ductile::Error (invalid_argument for unknown ids and calls out of order,
// incompatible for a copy in use, internal for a broken invariant); a call
// that throws invalid_argument or incompatible has changed nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "ductile/parameter_coordinator.hpp"

namespace ductile::zero {

// Limits of the [zero] section, in elements (max_ongoing: gathers). No
// defaults here: they live in the plugin's schema (coordinator.cpp), whose
// validated values set every field; tests set every field themselves.
struct PlannerLimits {
  std::size_t prefetch_bucket;
  std::size_t max_live;
  std::size_t max_reuse;
  std::size_t persistence_threshold;
  std::size_t max_ongoing;  // >= 1
};

enum class StepKind : std::uint8_t {
  retire,  // wait for every outstanding gather with id <= `gather`; their copies are available
  gather,  // allocate the copies of the parameters and issue one coalesced gather `gather`
  free,    // free the gathered copy of `param`
};

struct Step {
  StepKind kind = StepKind::retire;
  bool prefetch = false;     // gather: ahead of use (false: the fetched module's own)
  std::uint32_t param = 0;   // free: parameter index
  std::uint64_t gather = 0;  // retire, gather: gather id (ascending from 1)
  std::uint32_t first = 0;   // gather: its parameters are Plan::params[first, first + count)
  std::uint32_t count = 0;
};

// What one call decided. Reused across calls (clear() keeps the capacity).
struct Plan {
  std::vector<Step> steps;
  std::vector<std::uint32_t> params;  // parameter indices of the gather steps
  bool invalidated = false;           // the complete trace was dropped
  std::string warning;                // a deviation not seen before (empty: none, or seen)

  void clear() {
    steps.clear();
    params.clear();
    invalidated = false;
    warning.clear();
  }
  std::span<const std::uint32_t> gather_params(const Step& s) const {
    return {params.data() + s.first, s.count};
  }
};

// One use of a parameter by the frozen trace.
struct TraceUse {
  std::uint32_t param;
  std::int64_t step;
};

// Counters of the planner (the coordinator's stats() adds time and NVMe).
struct PlannerCounters {
  std::size_t live_numel = 0;
  std::size_t idle_numel = 0;
  std::size_t active_numel = 0;
  std::size_t persistent_numel = 0;
  std::size_t peak_live_numel = 0;
  std::size_t peak_idle_numel = 0;
  std::size_t peak_inflight_gathers = 0;
  std::uint64_t passes = 0;
  std::uint64_t gathers = 0;
  std::uint64_t demand_gathered_params = 0;
  std::uint64_t prefetched_params = 0;
  std::uint64_t gathered_numel = 0;
  std::uint64_t released_params = 0;
  std::uint64_t retained_params = 0;
  std::uint64_t trace_invalidations = 0;
  std::uint64_t trace_warnings = 0;
};

class Planner {
 public:
  explicit Planner(const PlannerLimits& limits);

  const PlannerLimits& limits() const { return limits_; }

  // --- Registration (indices are dense, in registration order) ---

  // Throws invalid_argument for a duplicate id or numel 0.
  std::uint32_t add_parameter(ParameterId id, std::size_t numel);
  // The checks of add_parameter() alone (nothing changes).
  void check_new_parameter(ParameterId id, std::size_t numel) const;
  // Duplicates in `parameters` are ignored. Throws invalid_argument for a
  // duplicate module or an unknown parameter.
  std::uint32_t add_module(ModuleId id, std::span<const ParameterId> parameters);

  std::uint32_t parameter_index(ParameterId id) const;  // throws invalid_argument
  std::uint32_t module_index(ModuleId id) const;        // throws invalid_argument
  std::size_t parameter_count() const { return params_.size(); }
  ParameterId parameter_id(std::uint32_t pi) const { return params_[pi].id; }
  ModuleId module_id(std::uint32_t mi) const { return modules_[mi].id; }
  std::size_t numel(std::uint32_t pi) const { return params_[pi].numel; }
  bool persistent(std::uint32_t pi) const { return params_[pi].persistent; }
  std::size_t largest_module_numel() const { return largest_module_; }

  // --- Events ---

  // Checks the call (invalid_argument: the module is fetched) and, with a
  // complete trace, whether the module is the expected one; a deviation
  // drains, frees the idle copies and drops the trace (the rest of the pass
  // runs without one, the next pass records a new one). Returns true
  // when recording: the machinery must agree the call across ranks before
  // fetch().
  bool begin_fetch(std::uint32_t mi, Plan& plan);
  // The module's parameters that fetch() will gather itself (no copy), in
  // the order of its gather step. Valid between begin_fetch() and fetch().
  const std::vector<std::uint32_t>& missing(std::uint32_t mi);
  // Marks the module fetched, gathers what it misses (after retiring the
  // oldest gathers at the max_ongoing limit), retires the gathers holding
  // its parameters and, with a complete trace, prefetches in trace order.
  void fetch(std::uint32_t mi, Plan& plan);
  // Frees the module's copies that no rule keeps (see parameter_coordinator.hpp).
  void release(std::uint32_t mi, Plan& plan);
  // Throws invalid_argument while a module is fetched; a pass shorter than
  // a complete trace deviates; then retires every gather.
  void begin_end_step(Plan& plan);
  // Freezes a recorded trace (unless the pass deviated from the old one),
  // frees every non-persistent copy, starts a pass.
  void end_step(Plan& plan);
  // Retires every gather, frees every unused copy (persistent ones too if asked).
  void release_all(bool include_persistent, Plan& plan);
  // Retires every outstanding gather.
  void drain(Plan& plan);
  // Before the shard changes: retires its gather and frees its copy. Throws
  // incompatible while a fetched module uses it, naming `call`.
  void drop_copy(const char* call, std::uint32_t pi, Plan& plan);
  // The machinery saw gather `id` complete before a call retired it: its
  // parameters are available now. Changes no decision.
  void complete(std::uint64_t id);
  // The machinery could not issue gather `id`: if it is the newest
  // outstanding one, its parameters are not gathered after all (true);
  // false when a later call of the plan already retired it (the state is
  // then unspecified, as after any failed fetch).
  bool cancel_gather(std::uint64_t id);

  // --- Queries ---

  ParameterStatus status(std::uint32_t pi) const { return params_[pi].status; }
  const std::vector<std::uint32_t>& users(std::uint32_t pi) const { return params_[pi].users; }
  const std::vector<std::uint32_t>& module_params(std::uint32_t mi) const {
    return modules_[mi].params;
  }
  bool fetched(std::uint32_t mi) const { return modules_[mi].active; }
  TraceMode mode() const { return mode_; }
  const std::vector<std::uint32_t>& trace() const { return trace_; }
  // This pass's modules so far (recording) or the trace (complete).
  const std::vector<std::uint32_t>& pass_order() const {
    return mode_ == TraceMode::record ? recorded_ : trace_;
  }
  std::size_t step() const { return step_; }
  std::uint64_t pass_hash() const { return pass_hash_; }
  // Trace uses not yet covered by a gather, in trace order (complete trace).
  std::span<const TraceUse> upcoming() const {
    return {queue_.data() + queue_pos_, queue_.size() - queue_pos_};
  }
  std::size_t outstanding_gathers() const { return gathers_.size(); }
  const PlannerCounters& counters() const { return counters_; }

  // Recomputes the accounting from scratch and checks every invariant of
  // parameter_coordinator.hpp's check_invariants() that the planner owns.
  // Throws internal naming the first violation.
  void check_invariants() const;

 private:
  struct Parameter {
    ParameterId id = 0;
    std::size_t numel = 0;
    bool persistent = false;
    ParameterStatus status = ParameterStatus::not_available;
    std::uint64_t gather = 0;           // outstanding gather that brought it (0: none)
    std::vector<std::uint32_t> users;   // fetched modules using it
    std::vector<std::int64_t> uses;     // trace steps using it, ascending (complete trace)
    std::int64_t fetched_through = -1;  // latest trace step whose use a gather covers
    std::uint64_t chosen = 0;           // prefetch round that picked it
  };
  struct Module {
    ModuleId id = 0;
    std::vector<std::uint32_t> params;  // indices, sorted by parameter id
    std::size_t numel = 0;
    bool active = false;
  };
  struct Gather {
    std::uint64_t id = 0;
    bool done = false;  // completed, not yet retired
    std::vector<std::uint32_t> params;
  };

  void deviate(const std::string& what, Plan& plan);
  void freeze_trace();
  void use_module(std::uint32_t mi);
  void unuse_module(std::uint32_t mi);
  void issue(std::span<const std::uint32_t> which, bool prefetch, Plan& plan);
  void retire_through(std::uint64_t id, Plan& plan);
  void free_copy(std::uint32_t pi, Plan& plan);
  void free_idle(bool include_persistent, Plan& plan);
  void prefetch(Plan& plan);
  void note_peaks();
  std::int64_t next_use_of(const Parameter& p, std::int64_t from) const;

  PlannerLimits limits_;
  std::vector<Parameter> params_;
  std::unordered_map<ParameterId, std::uint32_t> param_index_;
  std::vector<Module> modules_;
  std::unordered_map<ModuleId, std::uint32_t> module_index_;
  std::size_t largest_module_ = 0;
  std::size_t active_modules_ = 0;

  TraceMode mode_ = TraceMode::record;
  // This pass left the complete trace: it is not frozen as the next trace
  // (an evaluation pass between training passes would otherwise become it).
  bool deviated_pass_ = false;
  std::vector<std::uint32_t> recorded_;
  std::vector<std::uint32_t> trace_;
  std::vector<TraceUse> queue_;            // every use of the trace, in order
  std::size_t queue_pos_ = 0;              // first use not yet covered
  std::vector<std::size_t> prefix_numel_;  // elements of trace modules before each step
  std::size_t step_ = 0;
  std::uint64_t pass_hash_ = 0;
  std::set<std::string> warned_;

  std::deque<Gather> gathers_;                     // outstanding, oldest first
  std::vector<std::vector<std::uint32_t>> spare_;  // parameter lists of retired gathers
  std::uint64_t next_gather_ = 1;
  std::uint64_t prefetch_round_ = 0;

  // Scratch (no allocation on the hot path).
  std::vector<std::uint32_t> missing_;
  std::vector<std::uint32_t> prefetch_;
  std::vector<std::pair<std::int64_t, std::uint32_t>> keep_;

  PlannerCounters counters_;
};

}  // namespace ductile::zero
