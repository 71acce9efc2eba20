#!/usr/bin/env bash
# Checks deploy/systemd/tokentap.service as systemd reads it: `systemd-analyze verify`
# (with ExecStart pointed at the binary this checkout built, since none is installed) and
# its hardening score (`systemd-analyze security --offline=true`), which must stay "OK"
# (2.0 or lower). Run by .ci/run after the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${TOKENTAP_BIN:-$PWD/target/debug/tokentap}
[ -x "$bin" ] || { echo "build tokentap first (cargo build): $bin is missing" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sed "s|/usr/local/bin/tokentap|$bin|g" deploy/systemd/tokentap.service > "$work/tokentap.service"
out=$(systemd-analyze verify "$work/tokentap.service" 2>&1 || true)
if [ -n "$out" ]; then
  echo "systemd-analyze verify: $out" >&2
  exit 1
fi
score=$(systemd-analyze security --offline=true "$work/tokentap.service" 2>/dev/null \
  | sed -n 's/.*Overall exposure level for tokentap.service: \([0-9.]*\).*/\1/p')
echo "tokentap.service: verified; exposure $score"
awk -v s="$score" 'BEGIN { exit !(s != "" && s <= 2.0) }' || {
  echo "tokentap.service: exposure $score is above 2.0" >&2
  exit 1
}
