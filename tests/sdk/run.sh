#!/usr/bin/env bash
# The SDK conformance suite (tests/sdk/conformance.py): a venv with the pinned official
# SDKs (kept in target/sdk-venv), tokentap built, the suite run. In CI (CI=true) a missing
# Python is a failure; elsewhere the suite is skipped with a message saying what to install.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  if [ "${CI:-}" = "true" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y python3 python3-venv || (apt-get update && apt-get install -y python3 python3-venv))
  else
    echo "sdk conformance: skipped: needs python3 with venv (apt-get install python3 python3-venv)" >&2
    [ "${CI:-}" = "true" ] && exit 1
    exit 0
  fi
fi

venv=target/sdk-venv
if [ ! -x "$venv/bin/python" ] || ! cmp -s tests/sdk/requirements.txt "$venv/requirements.txt"; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/sdk/requirements.txt
  cp tests/sdk/requirements.txt "$venv/requirements.txt"
fi

cargo build --quiet
TOKENTAP_BIN="$PWD/target/debug/tokentap" "$venv/bin/python" tests/sdk/conformance.py
