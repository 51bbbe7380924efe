#!/usr/bin/env bash
# `just book-render`: the built book in a real browser (headless Chromium).
# Every chapter must load with no script error and no failed resource, and
# every figure must render with a non-zero size. A screenshot of each
# chapter's first screen goes to out/book-render/.
set -euo pipefail
cd "$(dirname "$0")/.."
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$browser" ] || { echo "error: no chromium: run \`just setup\` (it installs Debian's chromium)" >&2; exit 2; }
[ -f book/build/index.html ] || { echo "error: book/build is empty: run \`just book\` first" >&2; exit 2; }
shots=out/book-render
mkdir -p "$shots"
rm -f "$shots"/*.png   # a screenshot left from an earlier run must not pass for a new one
profile=$(mktemp -d)
# Served over HTTP, as readers get it (on file:// mdBook's own fetches fail).
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server "$port" --bind 127.0.0.1 --directory book/build >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$profile"' EXIT
for _ in $(seq 50); do python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && break; sleep 0.1; done
flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
       --disable-component-update --disable-sync --hide-scrollbars --user-data-dir="$profile"
       --enable-logging=stderr --v=0)
fail=0
pages=0
# Every page of SUMMARY.md, in its order.
for name in $(grep -o '([a-z0-9-]*\.md)' book/src/SUMMARY.md | tr -d '()' | sed 's/\.md$//'); do
    url="http://127.0.0.1:$port/$name.html"
    pages=$((pages + 1))
    dom=$(timeout 60 "$browser" "${flags[@]}" --virtual-time-budget=5000 --dump-dom "$url?render-check" 2>"$profile/console.log" || true)
    # Console messages the page printed (script errors, failed fetches) — Chromium logs them as CONSOLE.
    console=$(grep -o 'CONSOLE[^]]*\] "[^"]*"' "$profile/console.log" | sed 's/^[^"]*"//; s/"$//' | tr '\n' '|' || true)
    json=$(echo "$dom" | sed -n 's:.*<pre id="render-check">\(.*\)</pre>.*:\1:p' | sed 's/&quot;/"/g; s/&amp;/\&/g; s/&lt;/</g; s/&gt;/>/g')
    if [ -z "$json" ]; then
        echo "✗ $name: the page did not finish loading"; fail=1; continue
    fi
    verdict=$(python3 - "$json" "$console" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
bad = [f"script error: {e}" for e in r["errors"]]
bad += [f"console: {m}" for m in sys.argv[2].split("|") if m]
# mdBook shows each figure twice (a click-to-zoom copy stays hidden until
# clicked): a figure passes when one of its copies has a rendered size.
seen = {}
for f in r["figures"]:
    ok = f["width"] > 0 and f["height"] > 0 and f["natural"] > 0
    seen[f["src"]] = seen.get(f["src"], False) or ok
bad += [f"figure {src} does not render" for src, ok in seen.items() if not ok]
print(("FAIL " + "; ".join(bad)) if bad else f"OK {len(seen)} figure(s) rendered, no errors")
PY
)
    timeout 60 "$browser" "${flags[@]}" --window-size=1280,900 --screenshot="$PWD/$shots/$name.png" "$url" >/dev/null 2>&1 || true
    [ -s "$shots/$name.png" ] || verdict="FAIL no screenshot"
    status=${verdict%% *}; message=${verdict#* }
    if [ "$status" = OK ]; then echo "✓ $name: $message → $shots/$name.png"; else echo "✗ $name: $message"; fail=1; fi
done
echo "book-render: $pages pages checked"
[ $fail -eq 0 ] || { echo "book-render: FAILED"; exit 1; }
