#!/usr/bin/env bash
# The one check: formatting, lint, types, tests. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff format --check omni_trio tests examples benchmarks
.venv/bin/ruff check omni_trio tests examples benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
