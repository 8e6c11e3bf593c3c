#!/usr/bin/env bash
# Set up a venv (if needed) and run everything CI checks: lint, format, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."

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
