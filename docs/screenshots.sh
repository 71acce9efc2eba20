#!/usr/bin/env bash
# Remakes docs/dashboard.png and docs/top.png from a default `tokentap demo` in its
# 128-client phase (small-fast capped by its SLO). Needs a release build, Debian's chromium
# and chromedriver, `script` (util-linux) and python3 with venv (pyte replays top's
# terminal output).
#
#   cargo build --release && docs/screenshots.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/tokentap
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

"$bin" demo --listen 127.0.0.1:18080 --admin 127.0.0.1:19191 > "$work/demo.out" &
chromedriver --port=19515 > /dev/null 2>&1 &
sleep 36

# The dashboard, once the page holds a snapshot with a verdict.
python3 - "$work/profile" <<'PY'
import base64, json, sys, time, urllib.request
def wd(method, path, body=None):
    req = urllib.request.Request("http://127.0.0.1:19515" + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))["value"]
args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--window-size=1400,1750", "--user-data-dir=" + sys.argv[1]]
s = wd("POST", "/session", {"capabilities": {"alwaysMatch": {"browserName": "chrome",
      "goog:chromeOptions": {"binary": "/usr/bin/chromium", "args": args}}}})["sessionId"]
wd("POST", f"/session/{s}/url", {"url": "http://127.0.0.1:19191/"})
for _ in range(100):
    if wd("POST", f"/session/{s}/execute/sync", {"args": [], "script":
          "return !!(window.tokentap && tokentap.snap && tokentap.snap.compare"
          " && tokentap.snap.compare.reason === null)"}):
        break
    time.sleep(0.1)
time.sleep(1.5)
open("docs/dashboard.png", "wb").write(base64.b64decode(wd("GET", f"/session/{s}/screenshot")))
wd("DELETE", f"/session/{s}")
PY

# top in a 150×36 pseudo-terminal for 5 s, its output kept to replay.
script -qfec "stty cols 150 rows 36; timeout 5 $bin top --admin http://127.0.0.1:19191" \
  "$work/top.tty" > /dev/null 2>&1 || true

python3 -m venv "$work/venv" && "$work/venv/bin/pip" -q install pyte==0.8.2
"$work/venv/bin/python" - "$work/top.tty" "$work/top.html" <<'PY'
import html, sys, pyte
screen = pyte.Screen(150, 36)
stream = pyte.ByteStream(screen)
tty = open(sys.argv[1], "rb").read()
# The alternate screen only: from entering it to the last frame before leaving it.
tty = tty[tty.find(b"\x1b[?1049h"):]
for end in (b"\x1b[?1049l", b"Script done"):
    if end in tty:
        tty = tty[:tty.rfind(end)]
stream.feed(tty)
colours = {"cyan": "#22d3ee", "magenta": "#e879f9", "green": "#4ade80", "yellow": "#facc15",
           "blue": "#60a5fa", "red": "#f87171", "brightblack": "#6b7280"}
rows = []
for y in range(screen.lines):
    line = screen.buffer[y]
    out = []
    for x in range(screen.columns):
        ch = line[x]
        style = f"color:{colours.get(ch.fg, '#e5e7eb')}" + (";font-weight:bold" if ch.bold else "")
        out.append(f'<span style="{style}">{html.escape(ch.data)}</span>')
    rows.append("".join(out))
page = ("<html><body style='margin:0;background:#111827'><pre style='margin:12px;font:14px/1.25 "
        "DejaVu Sans Mono,monospace;color:#e5e7eb'>" + "\n".join(rows) + "</pre></body></html>")
open(sys.argv[2], "w").write(page)
PY
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$work/profile2" --window-size=1300,500 \
  --screenshot=docs/top.png "file://$work/top.html" 2> /dev/null
wait %1
echo "docs/dashboard.png and docs/top.png written"
