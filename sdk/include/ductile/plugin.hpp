// The plugin boundary: plugin kinds, the base class of every plugin object,
// the context a plugin is created with, and the descriptor a plugin library
// exports.
//
// A plugin is a shared library named libductile_<kind>_<name>.so that exports
// exactly one symbol, `ductile_plugin_entry`, returning a pointer to a
// constant ductile_plugin_descriptor. Use DUCTILE_PLUGIN (below) to define it
// and the CMake function ductile_add_plugin() to build it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <spdlog/logger.h>

#include "ductile/error.hpp"
#include "ductile/export.hpp"
#include "ductile/params.hpp"
#include "ductile/version.hpp"

namespace ductile {

// The kinds of plugin. The short name is used in file names
// (libductile_<kind>_<name>.so) and as the configuration section name.
enum class PluginKind : std::uint32_t {
  elasticity = 0,   // ElasticityPolicy       ([elasticity] policy = "...")
  batching = 1,     // BatchSampler           ([batching] sampler = "...")
  lr = 2,           // LrScalingRule          ([lr] rule = "...")
  accelerator = 3,  // Accelerator            ([accelerator] backend = "...")
  zero = 4,         // ParameterCoordinator   ([zero] coordinator = "...")
  optimizer = 5,    // Optimizer              ([optimizer] name = "...")
};
inline constexpr std::uint32_t kPluginKindCount = 6;

DUCTILE_SDK_API inline const char* to_string(PluginKind kind) noexcept {
  switch (kind) {
    case PluginKind::elasticity:
      return "elasticity";
    case PluginKind::batching:
      return "batching";
    case PluginKind::lr:
      return "lr";
    case PluginKind::accelerator:
      return "accelerator";
    case PluginKind::zero:
      return "zero";
    case PluginKind::optimizer:
      return "optimizer";
  }
  return "unknown";
}

// The revision of a kind's interface this code was compiled against
// (DUCTILE_INTERFACE_REVISION_<KIND> in version.hpp).
constexpr std::uint32_t interface_revision(PluginKind kind) noexcept {
  switch (kind) {
    case PluginKind::elasticity:
      return DUCTILE_INTERFACE_REVISION_ELASTICITY;
    case PluginKind::batching:
      return DUCTILE_INTERFACE_REVISION_BATCHING;
    case PluginKind::lr:
      return DUCTILE_INTERFACE_REVISION_LR;
    case PluginKind::accelerator:
      return DUCTILE_INTERFACE_REVISION_ACCELERATOR;
    case PluginKind::zero:
      return DUCTILE_INTERFACE_REVISION_ZERO;
    case PluginKind::optimizer:
      return DUCTILE_INTERFACE_REVISION_OPTIMIZER;
  }
  return 0;
}

// Base of every object a plugin creates. The host owns each instance through
// a std::shared_ptr whose deleter also keeps the plugin's library loaded, so
// the object (and its vtable) never outlives its code.
class DUCTILE_SDK_API Plugin {
 public:
  virtual ~Plugin() = default;
};

// What the host gives a plugin's factory.
//
// Lifetime: the context is valid only during the factory call. Copy what you
// need: params() by value, logger() as a shared_ptr.
// Threading: the factory is called on the host's thread; the context's
// methods are not to be called from other threads.
class DUCTILE_SDK_API HostContext {
 public:
  virtual ~HostContext() = default;

  // The instance's name as configured, e.g. "v0.1".
  virtual std::string_view plugin_name() const = 0;

  // The validated parameters of this instance (schema defaults filled in).
  virtual const Params& params() const = 0;

  // The logger to use. Plugins must not create or register loggers of their
  // own, nor install sinks or formatters defined in plugin code into it
  // (they would dangle once the library is unloaded). Thread-safe.
  virtual std::shared_ptr<spdlog::logger> logger() const = 0;

  // The instance of another plugin kind configured for this run (created on
  // first use), for plugins that build on others: a parameter coordinator
  // requires the accelerator. Throws ductile::Error (ErrorKind::config) when
  // the configuration has no such section or the plugin cannot be created.
  // The returned object may be shared with other plugins and the host.
  virtual std::shared_ptr<Plugin> require(PluginKind kind) const = 0;

  // Typed form of require(): Interface is one of the kind interfaces.
  template <class Interface>
  std::shared_ptr<Interface> require() const {
    return std::static_pointer_cast<Interface>(require(Interface::kind));
  }
};

}  // namespace ductile

extern "C" {

// Where a plugin's factory or validate hook reports why it failed. The host
// owns it and fills it through `report`, which copies the strings: they need
// only live during the call. `kind` is a ductile::ErrorKind, `type` the
// Error::type() ("" for none), `key` the parameter at fault ("" for none).
// Valid only during the call it is passed to; not thread-safe.
struct ductile_plugin_error {
  void* host;
  void (*report)(void* host, std::uint32_t kind, const char* type, const char* message,
                 const char* key);
};

// Factory of a plugin: creates one instance. On success returns a new object
// the caller owns (deleted through the virtual destructor); on failure
// returns nullptr after reporting the error through `error`. Never throws.
typedef ductile::Plugin* (*ductile_plugin_factory)(const ductile::HostContext* context,
                                                   ductile_plugin_error* error);

// Optional check of a plugin's parameters (schema-valid, defaults filled in)
// without creating anything: every error the plugin can know from its
// parameters alone. Returns true when they are valid; otherwise reports the
// first error through `error` and returns false. The host runs it at
// `ductile config check` and before every creation. Never throws; must be
// safe to call from any thread (it sees only its arguments).
typedef bool (*ductile_plugin_validate)(const ductile::Params* params, const char* plugin_name,
                                        ductile_plugin_error* error);

// What a plugin library exports.
//
// Compatibility rule (version.hpp): the host loads a plugin only when its
// abi_version, build_tag, layout_fingerprint and interface_revision (of its
// kind) equal the host's; a plugin is rebuilt against the SDK of the host
// that loads it. The layout of this struct is fixed by the ABI version:
// abi_version is its first field in every version, so that a host can read
// it, and refuse, whatever the rest of a plugin's descriptor looks like.
struct ductile_plugin_descriptor {
  std::uint32_t abi_version;         // DUCTILE_ABI_VERSION of the plugin's SDK
  std::uint32_t kind;                // a ductile::PluginKind
  std::uint32_t interface_revision;  // interface_revision(kind) of the plugin's SDK
  std::uint32_t layout_fingerprint;  // detail::shared_layout_fingerprint() of its build
  const char* build_tag;             // DUCTILE_BUILD_TAG of the plugin's build
  const char* name;                  // e.g. "v0.1"; [A-Za-z0-9_.-]+
  const char* version;               // the plugin's own version, e.g. "1.0.0"
  const char* description;           // one line
  const ductile::ParamSpec* params;
  std::size_t param_count;
  ductile_plugin_factory create;
  ductile_plugin_validate validate;  // nullptr: parameters checked by the schema only
};

// The one exported symbol.
typedef const ductile_plugin_descriptor* (*ductile_plugin_entry_fn)(void);
}

#define DUCTILE_PLUGIN_ENTRY_SYMBOL "ductile_plugin_entry"

namespace ductile::detail {

// A digest of the sizes and alignments of the types every plugin shares with
// the host, as this compiler and these flags lay them out: two builds that
// disagree on any of them (a standard library in debug mode, another
// std::string) cannot pass Params or errors to each other. Not a
// substitute for the ABI version: a change of meaning keeps the sizes.
constexpr std::uint32_t shared_layout_fingerprint() noexcept {
  std::uint32_t hash = 2166136261u;  // FNV-1a over 8 bytes of each value
  for (std::size_t value :
       {sizeof(Params), alignof(Params), sizeof(ParamValue), alignof(ParamValue), sizeof(ParamSpec),
        alignof(ParamSpec), sizeof(Error), alignof(Error), sizeof(std::string),
        sizeof(std::vector<std::int64_t>), sizeof(std::shared_ptr<spdlog::logger>),
        sizeof(std::string_view), sizeof(ductile_plugin_error), sizeof(ductile_plugin_descriptor)})
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= static_cast<std::uint32_t>((static_cast<std::uint64_t>(value) >> (8 * byte)) & 0xff);
      hash *= 16777619u;
    }
  return hash;
}

// Reports the exception being handled: its kind, type and message when it is
// a ductile::Error (and key for a ParamError), else ErrorKind::plugin.
inline void report_current_exception(ductile_plugin_error* error) noexcept {
  if (error == nullptr || error->report == nullptr) return;
  auto report = [&](ErrorKind kind, const char* type, const char* message, const char* key) {
    error->report(error->host, static_cast<std::uint32_t>(kind), type, message, key);
  };
  try {
    throw;
  } catch (const ParamError& e) {
    report(e.kind(), e.type().c_str(), e.what(), e.key().c_str());
  } catch (const Error& e) {
    report(e.kind(), e.type().c_str(), e.what(), "");
  } catch (const std::exception& e) {
    report(ErrorKind::plugin, "", e.what(), "");
  } catch (...) {
    report(ErrorKind::plugin, "", "unknown exception thrown by the plugin", "");
  }
}

template <class Class>
Plugin* create_guarded(const HostContext* context, ductile_plugin_error* error) noexcept {
  try {
    if (context == nullptr)
      throw Error(ErrorKind::internal, "no host context given to the factory");
    return new Class(*context);
  } catch (...) {
    report_current_exception(error);
  }
  return nullptr;
}

// A plugin class opts into validation with
//   static void validate(const ductile::Params& params, std::string_view plugin_name);
// which throws ductile::Error (or ParamError naming the key) when invalid.
template <class Class>
concept HasValidate = requires(const Params& params, std::string_view name) {
  Class::validate(params, name);
};

template <class Class>
bool validate_guarded(const Params* params, const char* name,
                      ductile_plugin_error* error) noexcept {
  try {
    if (params == nullptr) throw Error(ErrorKind::internal, "no parameters given to validate");
    Class::validate(*params, name ? std::string_view(name) : std::string_view());
    return true;
  } catch (...) {
    report_current_exception(error);
  }
  return false;
}

template <class Class>
constexpr ductile_plugin_validate validate_entry() noexcept {
  if constexpr (HasValidate<Class>)
    return &validate_guarded<Class>;
  else
    return nullptr;
}

}  // namespace ductile::detail

// Defines the entry point of a plugin library.
//   Class        the implementation; derives from one kind interface (which
//                provides Class::kind) and has a constructor
//                Class(const ductile::HostContext&). Optionally a static
//                validate(const ductile::Params&, std::string_view name)
//                that throws for invalid parameters (see HasValidate).
//   Name         string literal, the plugin's name.
//   Version      string literal.
//   Description  string literal, one line.
//   Schema       a static array of ductile::ParamSpec (use
//                DUCTILE_PLUGIN_NO_PARAMS when there is none).
#define DUCTILE_PLUGIN(Class, Name, Version, Description, Schema) \
  DUCTILE_PLUGIN_IMPL_(Class, Name, Version, Description, (Schema), std::size(Schema))

#define DUCTILE_PLUGIN_NO_PARAMS(Class, Name, Version, Description) \
  DUCTILE_PLUGIN_IMPL_(Class, Name, Version, Description, nullptr, 0)

#define DUCTILE_PLUGIN_IMPL_(Class, Name, Version, Description, SchemaPtr, SchemaCount)    \
  static_assert(std::is_base_of_v<::ductile::Plugin, Class>,                               \
                "a plugin class must derive from a ductile kind interface");               \
  static ::ductile::Plugin* ductile_plugin_create_(const ::ductile::HostContext* context,  \
                                                   ductile_plugin_error* error) noexcept { \
    return ::ductile::detail::create_guarded<Class>(context, error);                       \
  }                                                                                        \
  extern "C" DUCTILE_SDK_API const ductile_plugin_descriptor* ductile_plugin_entry(void) { \
    static const ductile_plugin_descriptor descriptor{                                     \
        DUCTILE_ABI_VERSION,                                                               \
        static_cast<std::uint32_t>(Class::kind),                                           \
        ::ductile::interface_revision(Class::kind),                                        \
        ::ductile::detail::shared_layout_fingerprint(),                                    \
        DUCTILE_BUILD_TAG,                                                                 \
        Name,                                                                              \
        Version,                                                                           \
        Description,                                                                       \
        SchemaPtr,                                                                         \
        SchemaCount,                                                                       \
        &ductile_plugin_create_,                                                           \
        ::ductile::detail::validate_entry<Class>()};                                       \
    return &descriptor;                                                                    \
  }
