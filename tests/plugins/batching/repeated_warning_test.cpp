// RepeatedWarnings: the first warning of a text is logged, repeats are
// counted and reported once with their count.
#include <doctest/doctest.h>

#include <sstream>
#include <string>

#include <spdlog/sinks/ostream_sink.h>

#include "ductile_batching/repeated_warning.hpp"

using ductile::batching::RepeatedWarnings;

namespace {

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("a repeated warning is logged once, then once more with its count") {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto logger = std::make_shared<spdlog::logger>("test", sink);
  logger->set_pattern("%v");
  {
    RepeatedWarnings warnings(logger);
    for (int i = 0; i < 5; ++i) warnings.warn("same text");
    warnings.warn("another text");
    CHECK(warnings.repeats("same text") == 4);
    CHECK(warnings.repeats("another text") == 0);
    CHECK(out.str() == "same text\nanother text\n");
  }
  // At destruction: the count of each repeated text, nothing for the others.
  CHECK(out.str() ==
        "same text\nanother text\nsame text [the warning above was repeated 4 more times]\n");
}

TEST_CASE("past kMaxTracked distinct texts, new texts are logged every time") {
  std::ostringstream out;
  auto logger = std::make_shared<spdlog::logger>(
      "test", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
  logger->set_pattern("%v");
  RepeatedWarnings warnings(logger);
  for (std::size_t i = 0; i < RepeatedWarnings::kMaxTracked; ++i)
    warnings.warn("text " + std::to_string(i));
  warnings.warn("one more");
  warnings.warn("one more");
  warnings.warn("text 0");
  CHECK(count_of(out.str(), "one more\n") == 2);
  CHECK(count_of(out.str(), "text 0\n") == 1);
  CHECK(warnings.repeats("text 0") == 1);
}
