#!/usr/bin/env bash
# The designs wing's promise, checked: with one design's folder and its registration line
# removed, every test that is not that design's own passes. A copy of the working tree lacks
# tbp/nn/designs/NAME and its line in tbp/nn/designs/__init__.py; the test files that import the
# design's code (its own) are left out, and TBP_WITHOUT=NAME deselects the tests that spell its
# names or are marked as needing it (tests/conftest.py).
# Usage: tests/without_design.sh NAME [pytest arguments]. Every design:
#   for d in $(ls tbp/nn/designs | grep -v __); do tests/without_design.sh $d || echo "$d: FAILED"; done
set -euo pipefail
name=$1; shift
root=$(cd "$(dirname "$0")/.." && pwd)
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
(cd "$root" && git ls-files -co --exclude-standard | tar -cf - -T -) | (cd "$copy" && tar -xf -)
test -d "$copy/tbp/nn/designs/$name" || { echo "no design called $name" >&2; exit 2; }
rm -r "$copy/tbp/nn/designs/$name"
sed -i "/^from \. import $name  /d" "$copy/tbp/nn/designs/__init__.py"
cd "$copy"
own=$(grep -lE "designs[./]$name\b" tests/*.py | tr "\n" " " || true)
echo "without $name; its own test files: ${own:-none}" >&2
args=()
for a in "$@"; do                      # a test file asked for by name that is the design's own is left out too
    case " $own " in *" $a "*) ;; *) args+=("$a") ;; esac
done
PYTHONPATH="$copy" TBP_WITHOUT="$name" python -m pytest -q -p no:cacheprovider \
    $(for f in $own; do echo "--ignore=$f"; done) "${args[@]}"
