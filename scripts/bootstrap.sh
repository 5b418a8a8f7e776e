#!/usr/bin/env bash
# Create .venv (once) and install omni_trio with its test and dev extras into it.
# Torch is pinned to the CPU wheel first, so the package's torch>=2.4 range is met
# without pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
stamp=.venv/.omni-trio-installed
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
    .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,dev]'
    echo "$want" > "$stamp"
fi
