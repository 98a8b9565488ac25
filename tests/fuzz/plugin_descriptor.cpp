// Fuzz target: the checks the host makes of a plugin's descriptor
// (core::check_plugin_descriptor), then filling the schema's defaults
// (core::complete_params) as config validation does. The input describes a
// descriptor field by field; a flags byte lets the fuzzer use the host's own
// ABI version and build tag so that it reaches the later checks; a second
// one, at the end, the interface revision and shared layout.
#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "ductile/core/registry.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/plugin.hpp"
#include "fuzz_support.hpp"

namespace {

class Reader {
 public:
  Reader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(byte()) << (8 * i);
    return v;
  }
  double f64() {
    std::uint64_t bits = 0;
    for (int i = 0; i < 8; ++i) bits |= static_cast<std::uint64_t>(byte()) << (8 * i);
    double v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  // A length byte, then that many bytes (a NUL inside ends the C string early).
  std::string text() {
    std::string s;
    for (std::size_t n = byte(); n > 0 && pos_ < size_; --n) s.push_back(static_cast<char>(byte()));
    return s;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

ductile::Plugin* never_created(const ductile::HostContext*, ductile_plugin_error*) {
  __builtin_trap();  // the checks must not call the factory
}
bool never_validated(const ductile::Params*, const char*, ductile_plugin_error*) {
  __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::quiet_logging();
  Reader in(data, size);
  std::deque<std::string> strings;  // stable addresses for the C strings
  auto text_or_null = [&](bool null) -> const char* {
    std::string s = in.text();
    if (null) return nullptr;
    return strings.emplace_back(std::move(s)).c_str();
  };

  const std::uint8_t flags = in.byte();
  ductile_plugin_descriptor d{};
  d.abi_version = flags & 1 ? DUCTILE_ABI_VERSION : in.u32();
  d.build_tag = flags & 2 ? DUCTILE_BUILD_TAG : text_or_null(in.byte() & 1);
  d.kind = in.u32() % 8;
  d.name = text_or_null(flags & 4);
  d.version = text_or_null(in.byte() & 1);
  d.description = text_or_null(in.byte() & 1);
  d.create = flags & 8 ? nullptr : &never_created;
  d.validate = flags & 16 ? &never_validated : nullptr;

  std::vector<ductile::ParamSpec> params(in.byte() % 9);
  std::deque<std::vector<const char*>> allowed_lists;
  for (auto& p : params) {
    const std::uint8_t nulls = in.byte();
    p.key = text_or_null(nulls & 1);
    p.type = static_cast<ductile::ParamType>(in.byte() % 9);  // two past the last type
    p.flags = in.u32();
    p.default_value = text_or_null(nulls & 2);
    p.min_value = in.f64();
    p.max_value = in.f64();
    if (nulls & 4) {
      auto& list = allowed_lists.emplace_back();
      for (std::size_t n = in.byte() % 4; n > 0; --n) list.push_back(text_or_null(false));
      list.push_back(nullptr);
      p.allowed_values = list.data();
    }
    p.doc = text_or_null(nulls & 8);
  }
  d.params = flags & 32 && !params.empty() ? nullptr : params.data();
  d.param_count = params.size();

  // The file name the registry would have found it under.
  std::string file =
      flags & 64 ? in.text()
                 : "libductile_" +
                       std::string(ductile::to_string(static_cast<ductile::PluginKind>(d.kind))) +
                       "_" + (d.name ? d.name : "") + ".so";
  // From the input's end (shorter inputs: the host's values).
  const std::uint8_t later = in.byte();
  d.interface_revision =
      later & 1 ? in.u32()
                : ductile::interface_revision(static_cast<ductile::PluginKind>(d.kind % 5));
  d.layout_fingerprint = later & 2 ? in.u32() : ductile::detail::shared_layout_fingerprint();
  fuzz::expect_clean([&] {
    auto info = ductile::core::check_plugin_descriptor(&d, file);
    auto filled = ductile::core::complete_params(info, ductile::Params{});
    (void)filled;
  });
  return 0;
}
