#!/usr/bin/env bash
# Render an HTML report (e.g. bench-out/trajectory.html) to a PNG with headless Chromium
# (Debian package `chromium`), to check that it displays as intended.
#   scripts/screenshot.sh bench-out/trajectory.html bench-out/trajectory.png
set -euo pipefail
page=$(realpath "$1"); shot=$(realpath -m "${2:-${1%.html}.png}")
profile=$(mktemp -d)
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --window-size=1200,1400 --screenshot="$shot" "file://$page" 2>/dev/null
rm -rf "$profile"
echo "$shot"
