#!/usr/bin/env bash
# Set up a venv (if needed) and run everything CI checks: lint, format, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."

# The NAT lab and container tests (tests/natlab.py) need root, iproute2, iptables and
# procps (sysctl). CI runs as root and must run them, so as root a failed install stops
# here; as another user those tests skip and say why. As root, a missing venv module is installed the same way.
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

# apt_install LOG PACKAGE...: install with apt-get (updating the package lists once if the
# first try fails), its output in LOG.
apt_install() {
    local log=$1
    shift
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >"$log" 2>&1 \
        || { apt-get update -qq >>"$log" 2>&1 \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >>"$log" 2>&1; }
}
root_with_apt=false
[ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && root_with_apt=true
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# No Python at all (a bare image): as root, install Debian's python3 with its venv module
# (otherwise the venv below is made with what PYTHON names, or an existing one is used).
if $root_with_apt && ! command -v "$PY" >/dev/null 2>&1; then
    echo "== installing python3 python3-venv"
    apt_install "$log" python3 python3-venv \
        || { tail -n 20 "$log" >&2; echo "error: could not install python3" >&2; exit 1; }
    PY=python3
fi

missing=""
command -v iptables >/dev/null 2>&1 || missing="$missing iptables"
# The lab sets each router's sysctls with `ip netns exec ROUTER sysctl -qw ...`.
command -v sysctl >/dev/null 2>&1 || missing="$missing procps"
{ command -v ip && command -v tc; } >/dev/null 2>&1 || missing="$missing iproute2"
# tests/test_relay_websocket.py puts a real nginx (TLS-terminating reverse proxy) in front
# of a relay process.
command -v nginx >/dev/null 2>&1 || missing="$missing nginx-light"
# A distribution's Python may come without venv's pip bootstrap (Debian: python3.X-venv).
"$PY" -c 'import ensurepip' >/dev/null 2>&1 \
    || missing="$missing $("$PY" -c 'import sys; print("python%d.%d-venv" % sys.version_info[:2])')"
if [ "$(id -u)" = 0 ] && [ -n "$missing" ]; then
    if ! $root_with_apt; then
        echo "error:$missing missing and no apt-get to install it" >&2
        exit 1
    fi
    echo "== installing$missing"
    # shellcheck disable=SC2086 # one word per package
    apt_install "$log" $missing \
        || { tail -n 20 "$log" >&2; echo "error: could not install$missing" >&2; exit 1; }
fi

# Open MPI is only the all-reduce benchmark's second reference (tests/test_benchmarks.py
# builds and runs it when present), so failing to install it is a warning, not an error.
if $root_with_apt && ! { command -v mpicc && command -v mpirun; } >/dev/null 2>&1; then
    # mpicc is only a wrapper: it needs a C compiler.
    echo "== installing openmpi-bin libopenmpi-dev gcc (benchmark reference)"
    apt_install "$log" openmpi-bin libopenmpi-dev gcc \
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
# Two workers (pytest-xdist): most tests wait on sockets, timers and child processes, so
# one worker left both cores mostly idle. The NAT lab's and the benchmarks' modules all run
# on one worker, one test at a time (tests/conftest.py). P2PDIST_TEST_WORKERS=0 runs the
# suite in this process alone.
.venv/bin/python -m pytest -q -n "${P2PDIST_TEST_WORKERS:-2}" --dist loadgroup "$@"
