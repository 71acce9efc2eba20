#!/usr/bin/env bash
# Checks the Kubernetes manifests offline, as a cluster would take them: each of base,
# overlays/sidecar, overlays/redis and overlays/keda through `kubectl kustomize`, then every
# resource against the Kubernetes schemas (`kubernetes-validate --strict`, PyPI), the
# ServiceMonitor against the Prometheus Operator CRD's schema (npm's
# @kubernetes-models/prometheus-operator), KEDA's ScaledObject against KEDA's own CRD
# (check/keda, kept with its source), and the tokentap.toml of each ConfigMap through
# `tokentap check`. The tools go in target/deploy-check (pinned in check/). Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")"
root=$(cd ../.. && pwd)
bin=${TOKENTAP_BIN:-$root/target/debug/tokentap}
[ -x "$bin" ] || { echo "build tokentap first (cargo build): $bin is missing" >&2; exit 1; }
tools=$root/target/deploy-check
key=$(cat check/requirements.txt check/package.json | sha256sum | cut -c1-16)
if [ "$(cat "$tools/key" 2>/dev/null)" != "$key" ]; then
  rm -rf "$tools"
  python3 -m venv "$tools/venv"
  "$tools/venv/bin/pip" install -q -r check/requirements.txt
  cp check/package.json "$tools/package.json"
  (cd "$tools" && npm install --no-audit --no-fund --silent)
  echo "$key" > "$tools/key"
fi
cp check/servicemonitor.mjs "$tools/servicemonitor.mjs"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
version=1.33.0
for overlay in base overlays/sidecar overlays/redis overlays/keda; do
  out=$work/$(basename "$overlay").yaml
  kubectl kustomize "$overlay" > "$out"
  report=$("$tools/venv/bin/kubernetes-validate" --strict -k "$version" "$out" 2>&1) || {
    echo "$report" >&2
    exit 1
  }
  # Every kind but the CRDs' (checked below) must have been checked against a schema.
  if echo "$report" | grep -vE "kind (ServiceMonitor|ScaledObject)" | grep -qE "WARN|ERROR"; then
    echo "$report" >&2
    exit 1
  fi
  node "$tools/servicemonitor.mjs" "$out"
  if grep -q "^kind: ScaledObject" "$out"; then
    "$tools/venv/bin/python" check/keda.py "$out"
    grep -q "tokentap_capacity_endpoints_needed" "$out" || { echo "$overlay: the ScaledObject's query does not name tokentap_capacity_endpoints_needed" >&2; exit 1; }
  fi
  # The ConfigMap's tokentap.toml, its Secret's token where the pod mounts it.
  "$tools/venv/bin/python" - "$out" "$work/$(basename "$overlay")" <<'PY'
import base64, os, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
dest = sys.argv[2]
os.makedirs(dest, exist_ok=True)
for d in docs:
    if d["kind"] == "Secret" and d["metadata"]["name"].startswith("tokentap-admin"):
        open(os.path.join(dest, "admin-token"), "wb").write(base64.b64decode(d["data"]["admin-token"]))
for d in docs:
    if d["kind"] == "ConfigMap" and "tokentap.toml" in d.get("data", {}):
        text = d["data"]["tokentap.toml"].replace("/etc/tokentap-secret/", dest + "/")
        open(os.path.join(dest, "tokentap.toml"), "w").write(text)
PY
  "$bin" check --config "$work/$(basename "$overlay")/tokentap.toml"
  echo "$overlay: every resource valid against Kubernetes $version; its tokentap.toml passes check"
done
