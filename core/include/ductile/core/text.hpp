// Small text helpers used for error messages.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ductile::core {

// Levenshtein distance between a and b.
std::size_t edit_distance(std::string_view a, std::string_view b);

// The candidate closest to `word` when it is close enough to be a plausible
// typo (distance at most max(2, |word| / 3)); empty otherwise.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

// " (did you mean 'x'?)" or "".
std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates);

// `text` itself when at most `max` bytes long, else its first bytes (cut at a
// UTF-8 character boundary) followed by "... (N bytes)": user values are
// quoted in messages through this, never whole. Printable (below), newlines
// escaped too: a value stays on its line.
std::string excerpt(std::string_view text, std::size_t max = 64);

// `text` with what a terminal would act on, rather than show, escaped: the
// C0 controls (NUL included) but tab and, with `keep_newlines`, newline; DEL;
// the C1 controls; the bidirectional controls (U+061C, U+200E, U+200F,
// U+202A..U+202E, U+2066..U+2069); and bytes that are not UTF-8. A byte is
// written \xNN, a character \u{NNNN}. Every message a user sees goes
// through it (error output, the log, the Python exceptions).
std::string printable(std::string_view text, bool keep_newlines = true);

// "a, b, c" (or "(none)").
std::string join(const std::vector<std::string>& items, std::string_view separator = ", ");

}  // namespace ductile::core
