"""The benchmarks run and write complete JSON (figures are not asserted: see docs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SUMMARY_KEYS = {
    "overhead": {"ratio_engine_over_raw", "per_step_overhead_us"},
    "abort": {"running_p99_steps", "waiting_p99_ms"},
    "pipeline": {"ratio_engine_over_pipeline"},
    "batching": {"throughput_ratio_b4_over_b1"},
}


@pytest.mark.parametrize("name", sorted(SUMMARY_KEYS))
def test_bench_quick_writes_summary(name: str, tmp_path: Path) -> None:
    """python -m omni_trio.bench NAME --quick writes NAME.json with its headline figures."""
    result = subprocess.run(
        [sys.executable, "-m", "omni_trio.bench", name, "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert SUMMARY_KEYS[name] <= set(data["summary"])
    assert all(isinstance(data["summary"][key], float) for key in SUMMARY_KEYS[name])
    assert data["machine"]["torch_threads"] == 1
