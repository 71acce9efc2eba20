#!/usr/bin/env bash
# Seeds each target's corpus (fuzz/corpus/<target>, not committed) from tests/fixtures and
# fuzz/seeds. Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")"
for t in sse ndjson dialects usage; do
  mkdir -p "corpus/$t"
  for f in ../tests/fixtures/*; do
    # The first byte picks the split points; the fixture follows it.
    { printf '\x2a'; cat "$f"; } > "corpus/$t/$(basename "$f")"
  done
done
for t in h1_request h1_response chunked config; do
  mkdir -p "corpus/$t"
  cp seeds/$t/* "corpus/$t/"
done
