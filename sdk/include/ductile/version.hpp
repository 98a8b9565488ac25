// SDK version and the ABI identity of a build.
//
// A plugin records, in its descriptor, the ABI version, build tag, shared
// layout and kind interface revision it was compiled with; the loader
// refuses a plugin of which any differs from the host's (the rule below).
// The tag pins everything that makes C++ objects passed across the boundary
// layout-compatible: compiler family and major version, the libstdc++ dual
// ABI setting, the C++ standard, and the fmt and spdlog versions (a logger
// and its formatting cross the boundary). The SDK version is not in the tag:
// the ABI version covers it.
#pragma once

#include <fmt/core.h>
#include <spdlog/version.h>

#include "ductile/export.hpp"

#define DUCTILE_SDK_VERSION_MAJOR 0
#define DUCTILE_SDK_VERSION_MINOR 1
#define DUCTILE_SDK_VERSION_PATCH 0
#define DUCTILE_SDK_VERSION_STRING             \
  DUCTILE_STRINGIFY(DUCTILE_SDK_VERSION_MAJOR) \
  "." DUCTILE_STRINGIFY(DUCTILE_SDK_VERSION_MINOR) "." DUCTILE_STRINGIFY(DUCTILE_SDK_VERSION_PATCH)

// The plugin ABI: one rule. Every plugin is built against the SDK of the
// host that loads it, and the loader refuses a plugin unless each of these,
// as its descriptor records them, equals the host's: DUCTILE_ABI_VERSION,
// DUCTILE_BUILD_TAG, the shared layout fingerprint (plugin.hpp) and its
// kind's DUCTILE_INTERFACE_REVISION_<KIND>. The refusal names the plugin
// file and both values and asks for the plugin to be rebuilt against this
// SDK. A plugin and the host share C++ classes, not just the descriptor: the
// host calls a plugin object through the vtable of its kind interface, and
// hands it a HostContext, Params and errors laid out as the host's headers
// say. What a change to the SDK must bump:
//
// - DUCTILE_ABI_VERSION, for any change to what every plugin shares: Plugin,
//   HostContext (a virtual added anywhere, even last, removed, reordered or
//   re-typed), Params, ParamValue, ParamSpec, ParamType, ParamFlags, Error
//   and ErrorKind (a member, a layout, a meaning), the factory and validate
//   signatures, ductile_plugin_error, or the descriptor (a field added,
//   removed, moved or re-typed: its layout is fixed by the ABI version, whose
//   field stays the first). The loader refuses every plugin of another
//   version.
// - DUCTILE_INTERFACE_REVISION_<KIND>, for a change to one kind's interface
//   header: a virtual added to its interface class (at the end too: the host
//   would call past the end of an older plugin's vtable), removed, reordered
//   or re-typed, or the layout or meaning of a type passed through it
//   (PackOptions, PackResult, ElasticityRequest, the accelerator's Stream,
//   Communicator, ...). The loader refuses plugins of that kind built
//   against another revision; plugins of the other kinds still load.
//   parameter_coordinator.hpp uses accelerator.hpp's types, so a change
//   there bumps both the accelerator and the zero revisions.
//
// Nothing bumps for a new free inline function, a comment, or a new kind of
// interface. tests/sdk/interface_guard_test.cpp pins a fingerprint of each
// header beside the version it was last checked at, and fails when a header
// changes until a person decides whether the change bumps and re-pins it.
// The build tag and the layout fingerprint need no bump: they are computed
// by the compiler, and the fingerprint (sizes and alignments of Params,
// ParamSpec, Error, std::string, ...) catches a plugin built with other
// flags (such as _GLIBCXX_DEBUG) under the same build tag.
#define DUCTILE_ABI_VERSION 3

// The revision of each kind's interface (see above).
#define DUCTILE_INTERFACE_REVISION_ELASTICITY 1   // elasticity_policy.hpp
#define DUCTILE_INTERFACE_REVISION_BATCHING 1     // batch_sampler.hpp
#define DUCTILE_INTERFACE_REVISION_LR 1           // lr_scaling_rule.hpp
#define DUCTILE_INTERFACE_REVISION_ACCELERATOR 1  // accelerator.hpp
#define DUCTILE_INTERFACE_REVISION_ZERO 2         // parameter_coordinator.hpp, accelerator.hpp
#define DUCTILE_INTERFACE_REVISION_OPTIMIZER 2    // optimizer.hpp

#if defined(__clang__)
#define DUCTILE_COMPILER_TAG "clang-" DUCTILE_STRINGIFY(__clang_major__)
#elif defined(__GNUC__)
#define DUCTILE_COMPILER_TAG "gcc-" DUCTILE_STRINGIFY(__GNUC__)
#else
#define DUCTILE_COMPILER_TAG "unknown"
#endif

#if defined(_GLIBCXX_USE_CXX11_ABI) && _GLIBCXX_USE_CXX11_ABI
#define DUCTILE_STDLIB_TAG "libstdc++-cxx11"
#elif defined(__GLIBCXX__)
#define DUCTILE_STDLIB_TAG "libstdc++-old"
#elif defined(_LIBCPP_VERSION)
#define DUCTILE_STDLIB_TAG "libc++"
#else
#define DUCTILE_STDLIB_TAG "unknown-stdlib"
#endif

#define DUCTILE_FMT_TAG "fmt-" DUCTILE_STRINGIFY(FMT_VERSION)
#define DUCTILE_SPDLOG_TAG                                             \
  "spdlog-" DUCTILE_STRINGIFY(SPDLOG_VER_MAJOR) "." DUCTILE_STRINGIFY( \
      SPDLOG_VER_MINOR) "." DUCTILE_STRINGIFY(SPDLOG_VER_PATCH)

// Example: "gcc-12/libstdc++-cxx11/c++202002L/fmt-90100/spdlog-1.10.0"
#define DUCTILE_BUILD_TAG                                                        \
  DUCTILE_COMPILER_TAG "/" DUCTILE_STDLIB_TAG                                    \
                       "/c++" DUCTILE_STRINGIFY(__cplusplus) "/" DUCTILE_FMT_TAG \
                                                             "/" DUCTILE_SPDLOG_TAG
