#!/usr/bin/env bash
# Every program and shared library of the build tree finds what it links
# through run paths that are absolute or relative to $ORIGIN, never through
# an empty entry, which the dynamic loader reads as the current directory
# (CMake pads a build tree's run paths with them when the install run path
# differs; CMakeLists.txt builds with the install run paths instead).
# Usage: runpaths_test.sh BUILD_DIR
set -euo pipefail
build=$1
checked=0
failed=0
while IFS= read -r -d '' file; do
  [[ $(head -c 4 "$file" | od -An -c | tr -d ' ') == 177ELF ]] || continue
  checked=$((checked + 1))
  paths=$(readelf -d "$file" | sed -n 's/.*(\(RUNPATH\|RPATH\)).*\[\(.*\)\]/\2/p')
  [[ -n $paths ]] || continue
  IFS=: read -r -a entries <<<"$paths:"
  # "a:b:" splits into a, b: the appended ':' keeps a trailing empty entry.
  for entry in "${entries[@]}"; do
    if [[ -z $entry || ( $entry != /* && $entry != '$ORIGIN'* ) ]]; then
      echo "FAIL: $file: run path [$paths] has the entry '$entry' (empty or relative)"
      failed=$((failed + 1))
      break
    fi
  done
done < <(find "$build/bin" "$build/lib" "$build/python" -type f -print0 2>/dev/null)
echo "$checked ELF files checked, $failed with an empty or relative run path entry"
# The tree has the CLI, the core and the plugins at least.
[[ $checked -ge 10 && $failed -eq 0 ]]
