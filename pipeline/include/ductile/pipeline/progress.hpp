// Progress of a long pipeline call (pack_plan, a plan's to_json): the call
// says which stage it is in and how far that stage got; a front end shows it
// (the CLI's progress bar on a terminal). The pipeline includes no front
// end: the caller hands it an implementation of ProgressSink, or nothing, and
// the calls without a sink work as they always did.
//
// Ownership: the caller owns the sink; a pipeline call borrows it for the
// duration of the call only and keeps no reference after it returns (or
// throws).
// Threading: a pipeline call reports from the thread it runs on, in order.
// A sink that shows the progress from another thread (a redraw timer) must
// synchronise with these calls itself.
// Errors: the calls are noexcept: a report never aborts the work, so a sink
// must not throw (it drops what it cannot show).
// Cost: loops report once per kProgressChunk items, never per item: with a
// sink a report costs a few atomic stores, without one (nullptr) a loop pays
// one untaken branch per chunk.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace ductile::pipeline {

class ProgressSink {
 public:
  virtual ~ProgressSink() = default;

  // A new stage begins; the previous one, if any, is over. `name` is a short
  // phrase ("packing", "writing JSON") with static storage duration (a string
  // literal): the sink may keep the pointer. `total` is the stage's units of
  // work; 0 when the amount is not known (the stage then reports no advance:
  // a call into a plugin, for example).
  virtual void begin_stage(const char* name, std::uint64_t total) noexcept = 0;

  // `done` of the current stage's `total` units are done; non-decreasing
  // within a stage, at most `total`.
  virtual void advance(std::uint64_t done) noexcept = 0;
};

// Items a pipeline loop processes between two reports.
inline constexpr std::size_t kProgressChunk = std::size_t{1} << 16;

// The same calls for an optional sink (nullptr: nothing happens).
inline void report_stage(ProgressSink* sink, const char* name, std::uint64_t total) noexcept {
  if (sink) sink->begin_stage(name, total);
}
inline void report_progress(ProgressSink* sink, std::uint64_t done) noexcept {
  if (sink) sink->advance(done);
}

// Calls body(i) for every i in [0, count), in order, reporting the items
// done after each chunk of kProgressChunk (the stage, with its total, is
// the caller's to begin). An exception of `body` ends the loop and
// propagates; nothing more is reported.
template <class Body>
void for_each_reporting(std::size_t count, ProgressSink* sink, Body&& body) {
  for (std::size_t begin = 0; begin < count; begin += kProgressChunk) {
    const std::size_t end = std::min(count, begin + kProgressChunk);
    for (std::size_t i = begin; i < end; ++i) body(i);
    report_progress(sink, end);
  }
}

}  // namespace ductile::pipeline
