// fmt's compiled part (what libfmt.so holds), for programs and plugins that
// link fmt statically (DUCTILE_STATIC_RUNTIME): format-inl.h defines it, and
// the templates fmt declares `extern template` are instantiated here for
// char, the only character type ductile formats.
//
// Without std::locale: the locale-aware formats ({:L}) read the C locale's
// separators, none, as every ductile process formats in (none calls
// std::locale::global), and a plugin does not carry and initialise
// libstdc++'s locales (about half its size and relocations) for them.
#define FMT_STATIC_THOUSANDS_SEPARATOR 0
#include <fmt/format-inl.h>

FMT_BEGIN_NAMESPACE
namespace detail {
template FMT_API auto thousands_sep_impl<char>(locale_ref) -> thousands_sep_result<char>;
template FMT_API auto decimal_point_impl(locale_ref) -> char;
template FMT_API void buffer<char>::append(const char*, const char*);
template FMT_API void vformat_to(buffer<char>&, string_view,
                                 basic_format_args<FMT_BUFFER_CONTEXT(char)>, locale_ref);
}  // namespace detail
FMT_END_NAMESPACE
