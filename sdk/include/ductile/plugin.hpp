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
#include <cstring>
#include <exception>
#include <iterator>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>

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
};
inline constexpr std::uint32_t kPluginKindCount = 5;

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
  }
  return "unknown";
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

// Factory of a plugin: creates one instance. On success returns a new object
// the caller owns (deleted through the virtual destructor); on failure returns
// nullptr and writes a NUL-terminated message into error[0..error_size).
// Never throws.
typedef ductile::Plugin* (*ductile_plugin_factory)(const ductile::HostContext* context, char* error,
                                                   std::size_t error_size);

// What a plugin library exports. Layout frozen for an ABI major version;
// minor versions only append fields.
struct ductile_plugin_descriptor {
  std::uint32_t abi_major;
  std::uint32_t abi_minor;
  const char* build_tag;    // DUCTILE_BUILD_TAG of the plugin's build
  std::uint32_t kind;       // a ductile::PluginKind
  const char* name;         // e.g. "v0.1"; [A-Za-z0-9_.-]+
  const char* version;      // the plugin's own version, e.g. "1.0.0"
  const char* description;  // one line
  const ductile::ParamSpec* params;
  std::size_t param_count;
  ductile_plugin_factory create;
};

// The one exported symbol.
typedef const ductile_plugin_descriptor* (*ductile_plugin_entry_fn)(void);
}

#define DUCTILE_PLUGIN_ENTRY_SYMBOL "ductile_plugin_entry"

namespace ductile::detail {

inline void copy_error(char* error, std::size_t size, const char* what) noexcept {
  if (error == nullptr || size == 0) return;
  std::size_t n = std::strlen(what);
  if (n >= size) n = size - 1;
  std::memcpy(error, what, n);
  error[n] = '\0';
}

template <class Class>
Plugin* create_guarded(const HostContext* context, char* error, std::size_t size) noexcept {
  try {
    if (context == nullptr) {
      copy_error(error, size, "no host context given to the factory");
      return nullptr;
    }
    return new Class(*context);
  } catch (const std::exception& e) {
    copy_error(error, size, e.what());
  } catch (...) {
    copy_error(error, size, "unknown exception thrown by the plugin's constructor");
  }
  return nullptr;
}

}  // namespace ductile::detail

// Defines the entry point of a plugin library.
//   Class        the implementation; derives from one kind interface (which
//                provides Class::kind) and has a constructor
//                Class(const ductile::HostContext&).
//   Name         string literal, the plugin's name.
//   Version      string literal.
//   Description  string literal, one line.
//   Schema       a static array of ductile::ParamSpec (use
//                DUCTILE_PLUGIN_NO_PARAMS when there is none).
#define DUCTILE_PLUGIN(Class, Name, Version, Description, Schema) \
  DUCTILE_PLUGIN_IMPL_(Class, Name, Version, Description, (Schema), std::size(Schema))

#define DUCTILE_PLUGIN_NO_PARAMS(Class, Name, Version, Description) \
  DUCTILE_PLUGIN_IMPL_(Class, Name, Version, Description, nullptr, 0)

#define DUCTILE_PLUGIN_IMPL_(Class, Name, Version, Description, SchemaPtr, SchemaCount)        \
  static_assert(std::is_base_of_v<::ductile::Plugin, Class>,                                   \
                "a plugin class must derive from a ductile kind interface");                   \
  static ::ductile::Plugin* ductile_plugin_create_(const ::ductile::HostContext* context,      \
                                                   char* error, std::size_t size) noexcept {   \
    return ::ductile::detail::create_guarded<Class>(context, error, size);                     \
  }                                                                                            \
  extern "C" DUCTILE_SDK_API const ductile_plugin_descriptor* ductile_plugin_entry(void) {     \
    static const ductile_plugin_descriptor descriptor{DUCTILE_ABI_MAJOR,                       \
                                                      DUCTILE_ABI_MINOR,                       \
                                                      DUCTILE_BUILD_TAG,                       \
                                                      static_cast<std::uint32_t>(Class::kind), \
                                                      Name,                                    \
                                                      Version,                                 \
                                                      Description,                             \
                                                      SchemaPtr,                               \
                                                      SchemaCount,                             \
                                                      &ductile_plugin_create_};                \
    return &descriptor;                                                                        \
  }
