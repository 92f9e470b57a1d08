#!/usr/bin/env bash
# ci/lint.sh: ruff (lint and format), mypy (strict on src/) and the docs (`mkdocs build
# --strict`: a broken link or anchor, an API object that no longer exists, a spec field or
# DDPKIT_* variable without its description fails it). ci/test.sh runs it in the background
# beside the tests; it needs the `dev` and `docs` extras installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo "== ruff"
ruff check src tests examples benchmarks docs/hooks
ruff format --check src tests examples benchmarks docs/hooks
echo "== mypy (strict on src/)"
mypy
echo "== docs (mkdocs build --strict)"
# into site/ (gitignored). NO_MKDOCS_2_WARNING: mkdocs-material's banner about MkDocs 2.0.
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict
