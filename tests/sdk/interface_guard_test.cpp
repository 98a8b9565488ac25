// The ABI rule of version.hpp, enforced on the SDK's own headers: each header
// that plugins compile against is pinned here by a fingerprint of its text
// (comments and whitespace aside) next to the version it was last checked
// at. Any other change to it fails this test until a person decides, by the
// rule, whether it bumps the ABI version or a kind's interface revision, and
// pins the new fingerprint with the (possibly bumped) version.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "ductile/version.hpp"

namespace fs = std::filesystem;

namespace {

const fs::path kSdk = fs::path(DUCTILE_SOURCE_DIR) / "sdk/include/ductile";

// The text the compiler sees, as far as layout and vtables go: comments
// removed (string and character literals kept whole), every run of
// whitespace one space.
std::string normalized(const std::string& text) {
  std::string out;
  bool space = false;
  auto put = [&](char c) {
    if (space && !out.empty()) out += ' ';
    space = false;
    out += c;
  };
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      while (i < text.size() && text[i] != '\n') ++i;
      space = true;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '*') {
      const auto end = text.find("*/", i + 2);
      i = end == std::string::npos ? text.size() : end + 1;
      space = true;
    } else if (c == '"' || c == '\'') {
      put(c);
      for (++i; i < text.size() && text[i] != c; ++i) {
        if (text[i] == '\\' && i + 1 < text.size()) out += text[i++];
        out += text[i];
      }
      if (i < text.size()) out += c;
    } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      space = true;
    } else {
      put(c);
    }
  }
  return out;
}

std::uint64_t fingerprint_of(const std::string& text) {
  std::uint64_t hash = 14695981039346656037ull;  // FNV-1a
  for (unsigned char c : normalized(text)) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

std::string read(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  REQUIRE_MESSAGE(in, "cannot read " << file);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct Pin {
  std::vector<const char*> headers;  // fingerprinted together
  const char* version_name;          // what the rule may bump
  std::uint32_t version_now;         // its value in version.hpp
  std::uint32_t version_pinned;      // its value when the fingerprint was pinned
  std::uint64_t fingerprint;
};

// Re-pin after deciding by the rule in version.hpp: the printed fingerprint
// and the version it was decided at.
const std::vector<Pin> kPins = {
    // Version 3: one ABI version in place of major and minor, and the
    // descriptor's fields reordered (the ABI version first).
    {{"plugin.hpp", "params.hpp", "error.hpp", "export.hpp"},
     "DUCTILE_ABI_VERSION",
     DUCTILE_ABI_VERSION,
     3,
     0x64436681941a61a9ull},
    {{"elasticity_policy.hpp"},
     "DUCTILE_INTERFACE_REVISION_ELASTICITY",
     DUCTILE_INTERFACE_REVISION_ELASTICITY,
     1,
     0x9742b101526f035aull},
    {{"batch_sampler.hpp"},
     "DUCTILE_INTERFACE_REVISION_BATCHING",
     DUCTILE_INTERFACE_REVISION_BATCHING,
     1,
     0xafbe6438d5eef1c8ull},
    {{"lr_scaling_rule.hpp"},
     "DUCTILE_INTERFACE_REVISION_LR",
     DUCTILE_INTERFACE_REVISION_LR,
     1,
     0xaa2a53b79a416067ull},
    // Re-pinned without a bump for HostWorld, NativeStreams and
    // NativeStreamHandles: new optional interfaces found by dynamic_cast (a
    // new kind of interface).
    {{"accelerator.hpp"},
     "DUCTILE_INTERFACE_REVISION_ACCELERATOR",
     DUCTILE_INTERFACE_REVISION_ACCELERATOR,
     1,
     0x5d305d5670853aedull},
    // Revision 2: the optional shard, group, placement and gather-memory
    // interfaces folded into ParameterCoordinator, and staging_bytes_bound()
    // added to it.
    {{"parameter_coordinator.hpp", "accelerator.hpp"},
     "DUCTILE_INTERFACE_REVISION_ZERO",
     DUCTILE_INTERFACE_REVISION_ZERO,
     2,
     0x393c12b221e16517ull},
    // Revision 2: OptimizerBuffers::threads (a step's thread count) changed
    // the layout of a type passed through step().
    {{"optimizer.hpp"},
     "DUCTILE_INTERFACE_REVISION_OPTIMIZER",
     DUCTILE_INTERFACE_REVISION_OPTIMIZER,
     2,
     0x8815ab85082ab21bull},
};

}  // namespace

TEST_CASE("every SDK header is pinned at the version it was last checked at") {
  std::vector<std::string> pinned;
  for (const auto& pin : kPins) {
    std::string text;
    for (const char* header : pin.headers) {
      text += read(kSdk / header);
      pinned.emplace_back(header);
    }
    const std::uint64_t now = fingerprint_of(text);
    const std::string files = fmt::format("{}", fmt::join(pin.headers, " + "));
    CHECK_MESSAGE(now == pin.fingerprint,
                  fmt::format("{} changed since it was pinned at {} = {}: if the change alters an "
                              "interface class or the layout or meaning of a type that crosses "
                              "the plugin boundary, bump as version.hpp says; then pin "
                              "fingerprint {:#018x} with the version in "
                              "tests/sdk/interface_guard_test.cpp",
                              files, pin.version_name, pin.version_pinned, now));
    CHECK_MESSAGE(pin.version_now == pin.version_pinned,
                  fmt::format("{} is now {} but {} was pinned at {}: pin its fingerprint again",
                              pin.version_name, pin.version_now, files, pin.version_pinned));
  }
  // A new header must be pinned too (version.hpp holds the versions).
  for (const auto& entry : fs::directory_iterator(kSdk)) {
    const std::string name = entry.path().filename().string();
    if (name == "version.hpp") continue;
    CHECK_MESSAGE(std::find(pinned.begin(), pinned.end(), name) != pinned.end(),
                  "sdk/include/ductile/" << name << " is not pinned in interface_guard_test.cpp");
  }
}

TEST_CASE("the fingerprint ignores comments and layout, and sees an appended virtual") {
  const std::string header = read(kSdk / "lr_scaling_rule.hpp");
  const std::string anchor = "virtual double scale(";
  const auto at = header.find(anchor);
  REQUIRE(at != std::string::npos);
  std::string reflowed = header;
  reflowed.insert(at, "// a new comment line\n  /* and a block */\n\n      ");
  CHECK(fingerprint_of(reflowed) == fingerprint_of(header));
  std::string appended = header;
  appended.insert(appended.find(';', at) + 1,
                  "\n  virtual double warmup_scale(double lr, double step) const { return lr; }");
  CHECK(fingerprint_of(appended) != fingerprint_of(header));
  // A string literal is text, not a comment.
  CHECK(normalized("f(\"a // b\"); // c") == "f(\"a // b\");");
}
