#!/usr/bin/env bash
# The one check: formatting, lint, types, tests, and the core's coverage floor.
# CI runs exactly this. Arguments go to pytest (a subset of tests skips the floor).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff format --check omni_trio tests examples benchmarks
.venv/bin/ruff check omni_trio tests examples benchmarks
.venv/bin/mypy
.venv/bin/python -m coverage erase
# Two workers, scheduled by the tests' groups (tests/conftest.py: what must not
# overlap runs on one worker); coverage follows them into the workers.
# OMNI_TRIO_TEST_WORKERS=0 runs in one process.
.venv/bin/python -m pytest -n "${OMNI_TRIO_TEST_WORKERS:-2}" --cov=omni_trio --cov-report= "$@"
if [ $# -eq 0 ]; then
    # The core (the engine's own modules, omni_trio/_*.py) keeps a floor: see CONTRIBUTING.md.
    .venv/bin/python -m coverage report --include='omni_trio/_*.py' \
        --omit='omni_trio/__main__.py' --fail-under=95
fi
