// What the loader refuses before any code of a file runs: files and
// directories another user owns or may write, libraries that are not
// plugins (or not for this machine), and files named like a built-in plugin.
// Each refusal is shown with a fixture whose library constructor leaves a
// marker file (fixtures/marker.hpp): the marker proves what ran.
#include <dlfcn.h>
#include <elf.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include <doctest/doctest.h>
#include <spdlog/sinks/ostream_sink.h>

#include "ductile/core/config.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/core/runtime.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using namespace ductile;
using namespace ductile::core;
using ductile::test::TempDir;

namespace {

const fs::path kRoot = FIXTURE_ROOT;
const fs::path kMarked = kRoot / "trust" / "libductile_lr_fixture_marked.so";
const fs::path kMarkedNoEntry = kRoot / "bad" / "libductile_lr_fixture_marked_noentry.so";
const fs::path kShadow = kRoot / "shadow" / "libductile_lr_linear.so";
constexpr uid_t kNobody = 65534;

// A fresh directory where the fixtures' constructors leave their markers.
struct Markers {
  TempDir dir;
  Markers() { setenv("DUCTILE_FIXTURE_MARKER_DIR", dir.path().c_str(), 1); }
  ~Markers() { unsetenv("DUCTILE_FIXTURE_MARKER_DIR"); }
  bool ran(const std::string& marker) const { return fs::exists(dir / (marker + ".ran")); }
};

struct CapturedLog {
  std::ostringstream stream;
  std::shared_ptr<spdlog::logger> logger;
  CapturedLog() {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(stream);
    logger = std::make_shared<spdlog::logger>("capture", sink);
    logger->set_level(spdlog::level::debug);
  }
};

bool library_loaded(const fs::path& file) {
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (!handle) return false;
  dlclose(handle);
  return true;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string load_error(const fs::path& file) {
  try {
    load_plugin_file(file);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::plugin);
    return e.what();
  }
  FAIL("loading " << file << " did not fail");
  return {};
}

// <tmp>/<dir name>/libductile_lr_fixture_marked.so, a copy of the marked
// plugin, with the given modes (owner unchanged: root, the caller).
struct PluginCopy {
  TempDir tmp;
  fs::path dir;
  fs::path file;
  explicit PluginCopy(mode_t dir_mode = 0755, mode_t file_mode = 0755,
                      const std::string& dir_name = "plugins") {
    dir = tmp / dir_name;
    fs::create_directories(dir);
    file = dir / kMarked.filename();
    fs::copy_file(kMarked, file);
    REQUIRE(chmod(file.c_str(), file_mode) == 0);
    REQUIRE(chmod(dir.c_str(), dir_mode) == 0);
  }
};

std::string bytes_of(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("the marked plugin in a trusted directory loads, and its constructor leaves the marker") {
  // The control for every refusal below: the same copy, trusted, does run.
  REQUIRE(geteuid() == 0);  // the suite runs as root; the owner tests chown
  Markers markers;
  PluginCopy copy;
  CHECK_FALSE(markers.ran("fixture_marked"));
  auto info = load_plugin_file(copy.file);
  CHECK(info.name == "fixture_marked");
  CHECK(markers.ran("fixture_marked"));
  CHECK(library_loaded(copy.file));
}

TEST_CASE("a plugin directory writable by others is refused, naming it, and none of it runs") {
  Markers markers;
  PluginCopy copy(0777);
  CapturedLog log;
  PluginRegistry registry({copy.dir}, log.logger);
  const std::string warning = log.stream.str();
  CHECK(contains(warning, "plugin directory '" + copy.dir.string() +
                              "' is refused: it is "
                              "writable by its group and others (mode 0777)"));
  CHECK(contains(warning, "chmod go-w '" + copy.dir.string() + "'"));
  try {
    registry.find(PluginKind::lr, "fixture_marked");
    FAIL("found");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::not_found);
    CHECK(contains(e.what(), "not searched: '" + copy.dir.string() +
                                 "' (refused: it is writable by its group and others"));
  }
  REQUIRE(registry.problems().size() == 1);
  CHECK(registry.problems()[0].file == copy.dir);
  // The file itself, named directly: its directory is named as the reason.
  auto message = load_error(copy.file);
  CHECK(contains(message, "'" + copy.file.string() + "' is refused: it lies in '" +
                              copy.dir.string() +
                              "', which is writable by its group and others "
                              "(mode 0777)"));
  CHECK(contains(message, "owns and no one else can write"));
  CHECK_FALSE(markers.ran("fixture_marked"));
  CHECK_FALSE(library_loaded(copy.file));
}

TEST_CASE("a plugin file writable by its group is refused") {
  Markers markers;
  PluginCopy copy(0755, 0775);
  auto message = load_error(copy.file);
  CHECK(contains(
      message, "'" + copy.file.string() + "' is refused: it is writable by its group (mode 0775)"));
  PluginRegistry registry({copy.dir}, nullptr);
  CHECK_THROWS_AS(registry.find(PluginKind::lr, "fixture_marked"), Error);
  CHECK_FALSE(markers.ran("fixture_marked"));
  CHECK_FALSE(library_loaded(copy.file));
}

TEST_CASE("a plugin file owned by another user is refused") {
  Markers markers;
  PluginCopy copy;
  REQUIRE(chown(copy.file.c_str(), kNobody, kNobody) == 0);
  auto message = load_error(copy.file);
  CHECK(contains(message, "'" + copy.file.string() +
                              "' is refused: it is owned by uid 65534, "
                              "neither root nor the caller (uid 0)"));
  PluginRegistry registry({copy.dir}, nullptr);
  try {
    registry.find(PluginKind::lr, "fixture_marked");
    FAIL("found");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::plugin);  // found, and refused
    CHECK(contains(e.what(), "owned by uid 65534"));
  }
  CHECK_FALSE(markers.ran("fixture_marked"));
  CHECK_FALSE(library_loaded(copy.file));
}

TEST_CASE("a plugin directory owned by another user is refused, and so is every file in it") {
  Markers markers;
  PluginCopy copy;
  REQUIRE(chown(copy.dir.c_str(), kNobody, kNobody) == 0);
  PluginRegistry registry({copy.dir}, nullptr);
  CHECK(registry.names(PluginKind::lr).empty());
  CHECK(contains(registry.problems().at(0).message, "is owned by uid 65534"));
  auto message = load_error(copy.file);
  CHECK(contains(message, "it lies in '" + copy.dir.string() + "', which is owned by uid 65534"));
  CHECK_FALSE(markers.ran("fixture_marked"));
}

TEST_CASE("a link in a trusted directory to a plugin in an untrusted one is refused") {
  Markers markers;
  PluginCopy untrusted(0777, 0755, "open");
  TempDir trusted;
  const fs::path link = trusted.path() / kMarked.filename();
  fs::create_symlink(untrusted.file, link);
  auto message = load_error(link);
  CHECK(contains(message, "'" + link.string() + "' is refused: it lies in '" +
                              untrusted.dir.string() + "', which is writable"));
  PluginRegistry registry({trusted.path()}, nullptr);
  CHECK_THROWS_AS(registry.find(PluginKind::lr, "fixture_marked"), Error);
  CHECK_FALSE(markers.ran("fixture_marked"));
}

TEST_CASE("a sticky directory above a plugin may be writable by others, a plugin directory not") {
  Markers markers;
  // <tmp>/sticky (1777, like /tmp) / plugins (0755): others cannot replace
  // what root owns in a sticky directory.
  PluginCopy above(0755, 0755, "sticky/plugins");
  REQUIRE(chmod(above.dir.parent_path().c_str(), 01777) == 0);
  CHECK(load_plugin_file(above.file).name == "fixture_marked");
  CHECK(markers.ran("fixture_marked"));

  // A sticky plugin directory writable by others would take their files:
  // it is not searched. (A file of root's in it, named directly, is safe:
  // no one else can replace it.)
  PluginCopy sticky(01777);
  PluginRegistry registry({sticky.dir}, nullptr);
  CHECK(registry.names(PluginKind::lr).empty());
  REQUIRE(registry.skipped().size() == 1);
  CHECK(contains(registry.skipped()[0].reason,
                 "refused: it is writable by its group and others (mode 1777)"));
  CHECK(load_plugin_file(sticky.file).name == "fixture_marked");
}

TEST_CASE(
    "a library without the entry symbol is refused before it is loaded: its constructor "
    "never runs") {
  Markers markers;
  auto message = load_error(kMarkedNoEntry);
  CHECK(contains(message, "does not export the entry symbol 'ductile_plugin_entry'"));
  CHECK(contains(message, "it was not loaded"));
  CHECK_FALSE(markers.ran("marked_no_entry"));
  CHECK_FALSE(library_loaded(kMarkedNoEntry));
  // The control: opened by hand, the same library's constructor does run.
  void* handle = dlopen(kMarkedNoEntry.c_str(), RTLD_NOW | RTLD_LOCAL);
  REQUIRE(handle != nullptr);
  CHECK(markers.ran("marked_no_entry"));
  dlclose(handle);
}

TEST_CASE("ELF files the host cannot load are refused with the reason, before dlopen") {
  TempDir dir;
  const std::string plugin = bytes_of(kMarked);
  REQUIRE(plugin.size() > sizeof(Elf64_Ehdr));
  auto variant = [&](const std::string& name, auto&& edit) {
    std::string bytes = plugin;
    edit(bytes);
    const fs::path file = dir / name;
    std::ofstream(file, std::ios::binary) << bytes;
    return load_error(file);
  };
  Elf64_Half host_machine;
  std::memcpy(&host_machine, plugin.data() + offsetof(Elf64_Ehdr, e_machine), sizeof host_machine);
  const Elf64_Half other_machine = host_machine == EM_X86_64 ? EM_AARCH64 : EM_X86_64;
  CHECK(contains(variant("libductile_lr_other.so",
                         [&](std::string& b) {
                           std::memcpy(b.data() + offsetof(Elf64_Ehdr, e_machine), &other_machine,
                                       sizeof other_machine);
                         }),
                 "is not a loadable shared library: it is a shared library for another machine "
                 "(e_machine " +
                     std::to_string(other_machine) + "; this process runs on " +
                     std::to_string(host_machine) + ")"));
  CHECK(contains(variant("libductile_lr_i386.so", [](std::string& b) { b[EI_CLASS] = ELFCLASS32; }),
                 "it is a 32-bit ELF file; this process is 64-bit"));
  CHECK(contains(variant("libductile_lr_exec.so",
                         [](std::string& b) {
                           Elf64_Half type = ET_EXEC;
                           std::memcpy(b.data() + offsetof(Elf64_Ehdr, e_type), &type, sizeof type);
                         }),
                 "it is an ELF file but not a shared library (e_type 2: an executable)"));
  CHECK(contains(variant("libductile_lr_cut.so", [](std::string& b) { b.resize(4096); }),
                 "is a malformed ELF file: its section header table"));
  CHECK(contains(variant("libductile_lr_empty.so", [](std::string& b) { b.clear(); }),
                 "it is not an ELF file (it is empty)"));
}

TEST_CASE("a file named like a built-in plugin does not replace it without leave") {
  Markers markers;
  const fs::path builtin_dir = PluginRegistry::builtin_plugin_dir();
  CapturedLog log;
  PluginRegistry registry({kRoot / "shadow", builtin_dir}, log.logger);
  const PluginInfo& linear = registry.find(PluginKind::lr, "linear");
  CHECK(linear.file == builtin_dir / "libductile_lr_linear.so");
  CHECK(linear.version != "9.9.9-fixture");
  CHECK_FALSE(markers.ran("shadow_linear"));
  CHECK_FALSE(library_loaded(kShadow));
  const std::string expected =
      "'" + kShadow.string() + "' is not used: it has the name of the built-in lr plugin 'linear'";
  CHECK(contains(log.stream.str(), expected));
  CHECK(contains(log.stream.str(), "[plugins] override_builtin = [\"lr/linear\"]"));
  bool listed = false;
  for (const auto& problem : registry.problems())
    listed = listed || (problem.file == kShadow && contains(problem.message, expected));
  CHECK(listed);
}

TEST_CASE("a file named like a built-in plugin replaces it when the options name it") {
  Markers markers;
  RegistryOptions options;
  options.builtin_overrides.push_back({PluginKind::lr, "linear"});
  PluginRegistry registry({kRoot / "shadow", PluginRegistry::builtin_plugin_dir()}, nullptr,
                          options);
  const PluginInfo& linear = registry.find(PluginKind::lr, "linear");
  CHECK(linear.file == kShadow);
  CHECK(linear.version == "9.9.9-fixture");
  CHECK(markers.ran("shadow_linear"));
}

TEST_CASE(
    "[plugins] override_builtin: kind/name entries let a configuration's plugin replace one") {
  const std::string path = "[plugins]\npath = [\"" + (kRoot / "shadow").string() + "\"]\n";
  auto builtin = Runtime::from_string(path + "[lr]\nrule = \"linear\"\n", "job.toml");
  CHECK(builtin.registry().find(PluginKind::lr, "linear").version != "9.9.9-fixture");

  auto replaced = Runtime::from_string(
      path + "override_builtin = [\"lr/linear\"]\n[lr]\nrule = \"linear\"\n", "job.toml");
  CHECK(replaced.registry().find(PluginKind::lr, "linear").version == "9.9.9-fixture");

  try {
    Runtime::from_string(path + "override_builtin = [\"lr/linear\", \"linear\", \"gpu/x\"]\n",
                         "job.toml");
    FAIL("accepted");
  } catch (const ConfigError& e) {
    REQUIRE(e.diagnostics().size() == 2);
    CHECK(e.diagnostics()[0].format() ==
          "job.toml:3:34: [plugins] override_builtin: 'linear' is not kind/name (kinds: "
          "elasticity, batching, lr, accelerator, zero, optimizer), as in \"batching/greedy\"");
    CHECK(contains(e.diagnostics()[1].message, "'gpu/x' is not kind/name"));
  }
}

TEST_CASE(
    "a runtime that does not search the file's [plugins] path names it when a plugin is "
    "missing") {
  Markers markers;
  PluginCopy copy;
  const std::string text =
      "[plugins]\npath = [\"" + copy.dir.string() + "\"]\n[lr]\nrule = \"fixture_marked\"\n";
  RuntimeOptions options;
  options.search_config_plugin_dirs = false;
  options.config_dirs_note = "not searched in this test";
  try {
    Runtime::from_string(text, "bundle.toml", options);
    FAIL("accepted");
  } catch (const ConfigError& e) {
    CHECK(contains(e.what(), "no lr plugin named 'fixture_marked'"));
    CHECK(contains(e.what(),
                   "not searched: '" + copy.dir.string() + "' (not searched in this test)"));
  }
  CHECK_FALSE(markers.ran("fixture_marked"));
  // A directory on the search path anyway (the built-in one) is not skipped.
  const std::string builtin_text = "[plugins]\npath = [\"" +
                                   PluginRegistry::builtin_plugin_dir().string() +
                                   "\"]\n[lr]\nrule = \"linear\"\n";
  auto checked = Runtime::from_string(builtin_text, "builtin.toml", options);
  CHECK(checked.registry().skipped().empty());
  // Searched (the default), it loads.
  auto runtime = Runtime::from_string(text, "bundle.toml");
  CHECK(runtime.registry().find(PluginKind::lr, "fixture_marked").file == copy.file);
  CHECK(markers.ran("fixture_marked"));
}
