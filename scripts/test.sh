#!/usr/bin/env bash
# Set up a venv (if needed) and run everything CI checks: lint, format, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."

# The NAT lab and container tests (tests/natlab.py) need root, iproute2 and iptables. CI
# runs as root and must run them, so as root a failed install stops here; as another user
# those tests skip and say why. As root, a missing venv module is installed the same way.
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

missing=""
command -v iptables >/dev/null 2>&1 || missing="$missing iptables"
{ command -v ip && command -v tc; } >/dev/null 2>&1 || missing="$missing iproute2"
# A distribution's Python may come without venv's pip bootstrap (Debian: python3.X-venv).
"$PY" -c 'import ensurepip' >/dev/null 2>&1 \
    || missing="$missing $("$PY" -c 'import sys; print("python%d.%d-venv" % sys.version_info[:2])')"
if [ "$(id -u)" = 0 ] && [ -n "$missing" ]; then
    if command -v apt-get >/dev/null 2>&1; then
        echo "== installing$missing"
        export DEBIAN_FRONTEND=noninteractive
        log=$(mktemp)
        # shellcheck disable=SC2086 # one word per package
        apt-get install -y -qq $missing >"$log" 2>&1 \
            || { apt-get update -qq >>"$log" 2>&1 && apt-get install -y -qq $missing >>"$log" 2>&1; } \
            || { tail -n 20 "$log" >&2; echo "error: could not install$missing" >&2; exit 1; }
        rm -f "$log"
    else
        echo "error:$missing missing and no apt-get to install it" >&2
        exit 1
    fi
fi

# Open MPI is only the all-reduce benchmark's second reference (tests/test_benchmarks.py
# builds and runs it when present), so failing to install it is a warning, not an error.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
    && ! { command -v mpicc && command -v mpirun; } >/dev/null 2>&1; then
    echo "== installing openmpi-bin libopenmpi-dev (benchmark reference)"
    export DEBIAN_FRONTEND=noninteractive
    mpi="openmpi-bin libopenmpi-dev"
    # shellcheck disable=SC2086 # one word per package
    { apt-get install -y -qq $mpi || { apt-get update -qq && apt-get install -y -qq $mpi; }; } \
        >/dev/null 2>&1 \
        || echo "warning: could not install Open MPI; the benchmark test checks its skip note only" >&2
fi

# A venv whose pip is missing (an earlier attempt failed half way) is made again.
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    rm -rf .venv
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
