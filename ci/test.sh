#!/usr/bin/env bash
# The project's test command (the README quotes it, .ci/run calls it): installs what the suite
# needs on a bare machine, then runs the linters, the type checker and the whole test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

echo "== install (torch pinned by ci/constraints.txt)"
python3 -m pip install --quiet --disable-pip-version-check -c ci/constraints.txt -e ".[dev]"

echo "== ruff"
ruff check src tests examples benchmarks
ruff format --check src tests examples benchmarks

echo "== mypy (strict on src/)"
mypy

echo "== pytest"
python3 -m pytest "$@"
