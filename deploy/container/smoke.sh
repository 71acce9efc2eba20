#!/usr/bin/env bash
# The image as a user runs it: built from this checkout (build.sh), its Containerfile
# linted (hadolint, from target/deploy-check), then run with podman (--network host) in
# front of `tokentap sim`: ready on /readyz, a streamed request through it, /metrics, and
# SIGTERM: it drains and exits 0. Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
bin=${TOKENTAP_BIN:-$root/target/debug/tokentap}
[ -x "$bin" ] || { echo "build tokentap first (cargo build): $bin is missing" >&2; exit 1; }
hadolint=$root/target/deploy-check/venv/bin/hadolint
[ -x "$hadolint" ] || { echo "run deploy/kubernetes/check.sh first (it installs hadolint)" >&2; exit 1; }
"$hadolint" deploy/container/Containerfile
deploy/container/build.sh
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
image=${IMAGE:-localhost/tokentap}:$version

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
sim=$(free_port); proxy=$(free_port); admin=$(free_port)
work=$(mktemp -d)
name=tokentap-smoke-$$
runtime=()
cleanup() {
  podman "${runtime[@]}" rm -f "$name" >/dev/null 2>&1 || true
  kill "$sim_pid" 2>/dev/null || true
  rm -rf "$work"
}
"$bin" sim --listen "127.0.0.1:$sim" --ttft-ms 5 --tpot-curve 1:5 --max-tokens 16 >/dev/null 2>&1 &
sim_pid=$!
trap cleanup EXIT
mkdir -p "$work/config"
cat > "$work/config/tokentap.toml" <<TOML
[listen]
proxy = "127.0.0.1:$proxy"
admin = "127.0.0.1:$admin"
[[upstream]]
name = "sim"
url = "http://127.0.0.1:$sim"
TOML
chmod -R a+rX "$work"
# runc where installed: crun refuses a host whose cgroups are mounted hybrid (v1 and v2).
# Limits below the caller's own: a container that asks for its runtime's defaults is
# refused where they exceed what this (unprivileged) namespace may set.
runtime=()
command -v runc >/dev/null 2>&1 && runtime=(--runtime runc)
podman "${runtime[@]}" run -d --name "$name" --network host \
  --ulimit nofile=16384:16384 --ulimit nproc=4096:4096 \
  -v "$work/config:/etc/tokentap:ro" "$image" >/dev/null
ready=
for _ in $(seq 1 100); do
  if curl -fsS "http://127.0.0.1:$admin/readyz" >/dev/null 2>&1; then ready=1; break; fi
  sleep 0.1
done
[ -n "$ready" ] || { podman "${runtime[@]}" logs "$name" >&2; echo "the image never became ready" >&2; exit 1; }
body=$(curl -fsSN "http://127.0.0.1:$proxy/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model":"m","stream":true,"max_tokens":16,"messages":[{"role":"user","content":"hi"}]}')
echo "$body" | grep -q 'data: \[DONE\]' || { echo "no whole stream through the image: $body" >&2; exit 1; }
curl -fsS "http://127.0.0.1:$admin/metrics" | grep -q '^tokentap_output_tokens_total{upstream="sim"} 16' || {
  echo "/metrics does not count the stream" >&2; exit 1; }
podman "${runtime[@]}" kill --signal TERM "$name" >/dev/null
code=$(podman "${runtime[@]}" wait "$name")
[ "$code" = 0 ] || { podman "${runtime[@]}" logs "$name" >&2; echo "exit status $code after SIGTERM" >&2; exit 1; }
echo "image $image: ready, streamed, metered, drained on SIGTERM, exit 0"
