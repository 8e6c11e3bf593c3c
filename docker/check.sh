#!/usr/bin/env bash
# Build the relay image and run the compose demo on a Docker engine; exit 0 when both
# ranks printed the right sum through the relay. Run from anywhere:
#
#   bash docker/check.sh            # needs `docker` with the compose plugin (v2)
#
# It uses its own compose project name and removes its containers, networks and
# volumes afterwards, so it does not touch a demo you run by hand.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
project=p2pdist-check-$$
log=$(mktemp)
compose() { docker compose -p "$project" -f "$here/compose.yaml" "$@"; }
trap 'compose down -v --remove-orphans >/dev/null 2>&1 || true; rm -f "$log"' EXIT

docker compose version >/dev/null 2>&1 || {
    echo "docker/check.sh: needs Docker Compose v2 ('docker compose')" >&2
    exit 2
}

export P2PDIST_SEED="${P2PDIST_SEED:-check-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
status=0
timeout 600 docker compose -p "$project" -f "$here/compose.yaml" \
    up --build --abort-on-container-exit --exit-code-from rank0 >"$log" 2>&1 || status=$?

sums=$(grep -cE 'rank[01].*all_reduce sum = \[3\. 3\. 3\. 3\.\]' "$log" || true)
if [ "$status" -ne 0 ] || [ "$sums" -ne 2 ]; then
    tail -40 "$log" >&2
    echo "docker/check.sh: FAILED (compose exit $status, $sums of 2 ranks printed the sum)" >&2
    exit 1
fi
grep -E 'relay url:|all_reduce sum' "$log"
echo "docker/check.sh: ok (relay image built, two ranks summed through the relay)"
