#!/usr/bin/env bash
# The one check: formatting, lint, types, tests, and the core's coverage floor.
# CI runs exactly this. Arguments go to pytest (a subset of tests skips the floor).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff format --check omni_trio tests examples benchmarks
.venv/bin/ruff check omni_trio tests examples benchmarks
.venv/bin/mypy
# Code written twice: the pairs of places that share six or more lines, at most the
# ceiling (lower it as pairs are merged; never raise it). Skipped where the
# `duplicates` command is not installed.
DUPLICATES_CEILING=45
if command -v duplicates >/dev/null 2>&1; then
    pairs=$(duplicates --repo omni_trio --seconds 60 | head -n 1)
    count=${pairs%% *}
    case "$count" in
        ''|*[!0-9]*) echo "duplicates: $pairs" ;;
        *) if [ "$count" -gt "$DUPLICATES_CEILING" ]; then
               echo "duplicates: $count pairs in omni_trio, over the ceiling of $DUPLICATES_CEILING:"
               duplicates --repo omni_trio --seconds 60 --most 200
               exit 1
           fi ;;
    esac
fi
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
