#!/usr/bin/env bash
# The suite three times from a fresh clone of HEAD, with `stress-ng --cpu 2` beside it: a test that
# sleeps for readiness instead of waiting for it fails here. Installs stress-ng when missing (root).
set -euo pipefail
runs=${RUNS:-3}
if ! command -v stress-ng >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq stress-ng >/dev/null
  else
    echo "stress-ng is missing: apt-get install stress-ng" >&2
    exit 1
  fi
fi
top=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'kill "$hog" 2>/dev/null || true; rm -rf "$work"' EXIT
git clone -q "$top" "$work/clone"
stress-ng --cpu 2 --quiet &
hog=$!
for run in $(seq 1 "$runs"); do
  echo "== run $run of $runs (under stress-ng --cpu 2)"
  (cd "$work/clone" && make -s test)
done
echo "test-stress: $runs runs passed under load"
