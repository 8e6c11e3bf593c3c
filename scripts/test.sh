#!/usr/bin/env bash
# Set up a venv (if needed) and run everything CI checks: lint, format, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."

# The NAT lab and container tests (tests/natlab.py) need root, iproute2 and iptables. CI
# runs as root and must run them, so as root a failed install stops here; as another user
# those tests skip and say why.
missing=""
command -v iptables >/dev/null 2>&1 || missing="$missing iptables"
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
if [ "$(id -u)" = 0 ] && [ -n "$missing" ]; then
    if command -v apt-get >/dev/null 2>&1; then
        echo "== installing$missing (NAT lab)"
        export DEBIAN_FRONTEND=noninteractive
        # shellcheck disable=SC2086 # one word per package
        apt-get install -y -qq $missing >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $missing >/dev/null 2>&1; } \
            || { echo "error: could not install$missing (needed by the NAT lab tests)" >&2; exit 1; }
    else
        echo "error:$missing missing and no apt-get to install it (needed by the NAT lab tests)" >&2
        exit 1
    fi
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test]'

echo "== ruff"
.venv/bin/ruff check p2pdist relay tests benchmarks examples
.venv/bin/ruff format --check p2pdist relay tests benchmarks examples
echo "== mypy --strict"
.venv/bin/mypy --strict p2pdist relay
echo "== pytest"
.venv/bin/python -m pytest -q "$@"
