// Visibility and build-tag macros shared by the core and by plugins.
#pragma once

// Plugins are compiled with -fvisibility=hidden. Types that cross the plugin
// boundary (interfaces, exceptions, the host context) are marked with
// DUCTILE_SDK_API so that their vtables and type_info stay unique per process.
#define DUCTILE_SDK_API __attribute__((visibility("default")))

#define DUCTILE_STRINGIFY_IMPL(x) #x
#define DUCTILE_STRINGIFY(x) DUCTILE_STRINGIFY_IMPL(x)
