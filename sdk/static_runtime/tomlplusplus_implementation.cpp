// TOML++'s compiled part (what libtomlplusplus.so holds), for the `ductile`
// program, which links it statically (DUCTILE_STATIC_RUNTIME). TOML++ defines
// it in the translation unit that sets TOML_IMPLEMENTATION.
#define TOML_IMPLEMENTATION
#include <toml++/toml.h>
