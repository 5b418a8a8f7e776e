"""The benchmarks run and write complete output (figures are not asserted: see docs).

One run of ``python -m benchmarks all --quick`` from the repository root, in a
subprocess (one torch thread, seconds per benchmark), writes every NAME.json,
NAME.md and NAME.png; the test checks their shape only. No timing is asserted,
and ``docs/`` is never written: only ``--docs`` would regenerate
docs/performance.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.docs import load_results, render_page

#: The headline figures of each benchmark, the ones its targets read (benchmarks/targets.py).
SUMMARY_KEYS = {
    "overhead": {"ratio_engine_over_raw", "per_step_overhead_us"},
    "abort": {"running_p99_steps", "waiting_p99_ms"},
    "post-abort": {
        "omni_trio_overhead_pct",
        "naive_overhead_pct",
        "interrupt_overhead_pct",
        "video_work_after_abort_ms_cancel_points",
        "video_blocks_after_abort_cancel_points",
    },
    "substep": {"substep_abort_p99_ms", "block_ms", "hook_cost_pct"},
    "leak": {"live_tensors", "rss_growth_mib"},
    "batching": {"throughput_ratio_b4_over_b1"},
    "join": {"first_step_wait_steps"},
    "scale": {"admit_us_per_request", "abort_us_per_request"},
    "preview": {"step_time_ratio_preview_over_off"},
    "pipeline": {"ratio_engine_over_pipeline"},
    "priority": {"high_priority_p99_wait_steps", "resume_max_abs_diff"},
    "devices": {"fake_throughput_ratio", "sd_throughput_ratio_2_over_1"},
    "serve": {"goodput_ratio_over_naive"},
    "deadline": {"goodput_ratio_over_fifo", "steps_wasted_per_missed", "refused_startable"},
    "jobs": {"default_interval_cost_pct_of_step", "restart_to_first_step_ms", "lost_s_max"},
    "cache": {"differing_decisions", "best_wall_ratio", "bookkeeping_pct"},
    "ranks": {
        "post_abort_overhead_pct",
        "recovered",
        "plan_delivery_us_p50",
        "plan_delivery_us_p99",
        "cfg_step_ratio_over_two_threads",
    },
    "adapters": {"throughput_ratio_over_sequential", "cost_over_none_pct", "load_ms"},
    "reuse": {
        "throughput_ratio_on_over_off",
        "prompt_hit_pct_of_encode",
        "bookkeeping_pct_of_step",
        "http_hit_p99_ms",
        "http_hit_runner_calls",
        "cross_tenant_hits",
    },
    "rollouts": {
        "throughput_ratio_engine_over_calls",
        "cpu_ratio_engine_over_calls",
        "engine_logprob_mismatch",
        "calls_logprob_mismatch",
        "update_idle_ms",
        "update_finish_ms",
        "update_finish_max_gap_steps",
        "update_finish_steps_lost",
        "update_abort_ms",
        "sleep1_ms",
        "wake1_ms",
        "sleep2_dropped_bytes",
        "wake_output_mismatches",
    },
    # --quick starts no PostgreSQL and no tiny Wan: the URL vs base64 figures alone.
    "cluster": {"url_fetch_p50_ms", "url_fetch_p99_ms", "b64_p50_ms", "b64_p99_ms"},
    # --quick compiles nothing (a cold compile is 10-90 s): its eager modes' figures.
    "fastpath": {"bf16_step_ratio", "engine_over_call_max", "int8_weight_ratio"},
}
SCALE_LENGTHS = {"10", "100", "1000", "10000"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: The repository root, where ``python -m benchmarks`` runs.
ROOT = Path(__file__).resolve().parent.parent
#: A hang guard for the quick run, not a timing figure: on the idle 2-core VM it took
#: 116-120 s of wall time (111 s of CPU, one torch thread; ``ranks`` 38 s of it, five
#: groups of ranks started), more beside the suite's other worker, and up to twice
#: that on a loaded CI machine of 2 cores; a hang still fails within minutes.
QUICK_RUN_LIMIT_S = 360

#: Every test here may be the first to use the quick run (``-k``), so each allows for it.
pytestmark = pytest.mark.timeout(QUICK_RUN_LIMIT_S + 30)


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run ``benchmarks all --quick`` once; return its output folder."""
    out = tmp_path_factory.mktemp("bench")
    docs_page = ROOT / "docs" / "performance.md"
    before = docs_page.read_bytes() if docs_page.exists() else None
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "all", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=QUICK_RUN_LIMIT_S,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    after = docs_page.read_bytes() if docs_page.exists() else None
    assert before == after, "bench without --docs must not touch docs/performance.md"
    return out


def test_bench_all_quick_writes_every_benchmark(quick_run: Path) -> None:
    """Every benchmark writes NAME.json with numeric headline figures, NAME.md and NAME.png."""
    for name, keys in SUMMARY_KEYS.items():
        data = json.loads((quick_run / f"{name}.json").read_text())
        summary = data["summary"]
        assert keys <= set(summary), (name, keys - set(summary))
        for key, value in summary.items():
            if isinstance(value, dict):
                assert value and all(_numeric(v) for v in value.values()), (name, key)
            else:
                assert _numeric(value), (name, key, value)
        assert data["machine"]["torch_threads"] == 1
        assert data["quick"] is True
        assert data["command"].startswith(f"python -m benchmarks {name}")
        markdown = (quick_run / f"{name}.md").read_text()
        assert markdown.startswith(f"# {name}") and "| --- |" in markdown.replace(":", "")
        assert (quick_run / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    scale = json.loads((quick_run / "scale.json").read_text())["summary"]
    for key in ("admit_us_per_request", "abort_us_per_request"):
        assert set(scale[key]) == SCALE_LENGTHS


def test_docs_page_renders_from_the_results(quick_run: Path) -> None:
    """The page that --docs would write has every benchmark, its plot and the GPU section."""
    page = render_page(
        load_results(quick_run), perf="perf", analysis="## Analysis", gpu="## GPU: kept"
    )
    for name in SUMMARY_KEYS:
        assert f"### {name}" in page and f"(perf/{name}.png)" in page
    assert "## Analysis" in page and page.rstrip().endswith("## GPU: kept")
