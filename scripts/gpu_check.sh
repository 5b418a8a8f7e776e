#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA and PyTorch but none of our pure-Python
# dependencies: they travel as wheels in .whl/ (see docs/runners.md). Writes logs to $OUT.
set -uo pipefail
out=${OUT:-/tmp/omni-trio-gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    -W ignore::DeprecationWarning -W ignore::FutureWarning -W ignore::UserWarning \
    tests/runners/test_diffusers_runner.py tests/test_contract_abort.py 2>&1 | tee "$out/pytest.log" | tail -15
python3 -m benchmarks pipeline --device cuda --out "$out" > /dev/null && \
    python3 -c "import json; d=json.load(open('$out/pipeline.json')); print('pipeline', d['summary'], d['direct_s'], d['engine_s'])"
python3 -m benchmarks batching --device cuda --requests 8 --out "$out" > /dev/null && \
    python3 -c "import json; d=json.load(open('$out/batching.json')); print('batching', d['summary'], d['batches'])"
# Adapters (issue 24's target: a mixed batch of 4 >= 2.5x four set_adapters calls).
python3 -m benchmarks adapters --device cuda --out "$out" > /dev/null && \
    python3 -c "import json; d=json.load(open('$out/adapters.json')); print('adapters', d['summary'], d['wall_s'])"
# The fast path (issue 43): FLUX.1-dev's transformer at full size with random bf16 weights,
# 1024 px, in bf16, bf16 with compiled blocks and fp8 with compiled blocks (torchao in
# .whl/), each through the engine and through the pipeline's own call (diffusers'
# compile_repeated_blocks, the same quantizer), then the churn after the warm-up and the
# seal. About ten minutes: 24 GB loaded eight times, five compiles. Its wiring runs on a
# CPU in seconds: python -m benchmarks.compiled --dry.
timeout 660 python3 -m benchmarks fastpath --device cuda --out "$out" > /dev/null && \
    python3 -c "import json; d=json.load(open('$out/fastpath.json')); print('fastpath', json.dumps(d['summary']))" && \
    tail -n 25 "$out/fastpath.md"
