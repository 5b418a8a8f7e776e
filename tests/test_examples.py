"""The README's code and every example run as shown."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import omni_trio as ot
from omni_trio.runners import tiny_pipeline
from omni_trio.testing import GatedRunner
from tests.support.core import BUDGET

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_readme_usage_is_the_quickstart_example() -> None:
    """The README shows examples/quickstart.py verbatim, so the test below runs it."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert (ROOT / "examples" / "quickstart.py").read_text() in blocks


def test_readme_names_the_main_and_test_commands() -> None:
    """The two set-up commands are in the README, and CI runs the test one."""
    readme = (ROOT / "README.md").read_text()
    assert "python -m omni_trio demo" in readme
    assert "bash scripts/check.sh" in readme
    assert "bash scripts/check.sh" in (ROOT / ".ci" / "run").read_text()


#: The files an example writes into its working folder.
WRITES = {"tutorial_first.py": "flower.png"}

#: A cached request's line of examples/step_cache.py.
CACHED_LINE = re.compile(
    r"(?P<name>[\w-]+) +(?P<pattern>[CS]+)  skipped (?P<skipped>\d+) of (?P<calls>\d+) calls,"
    r" computed (?P<percent>\d+)% of the block work"
)


def check_step_cache(stdout: str) -> None:
    """L84: each cached request's line says what ran: the calls it skipped (its pattern's
    ``S``) and the share of the block work it computed (``CacheMetrics.block_fraction``:
    every block of a computed call, the first block alone of a skipped one), not the share
    it skipped."""
    # The blocks of one tiny Flux call, as the runner's step cache counts them.
    transformer = tiny_pipeline("flux").transformer
    blocks = len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks)
    lines = stdout.splitlines()
    cached = [match for line in lines if (match := CACHED_LINE.fullmatch(line))]
    assert [match["name"] for match in cached] == ["first-block", "taylorseer"], stdout
    for match in cached:
        pattern = match["pattern"]
        skipped = pattern.count("S")
        assert (int(match["skipped"]), int(match["calls"])) == (skipped, len(pattern))
        assert 0 < skipped < len(pattern)  # neither all nor none of the work ran
        ran = (len(pattern) - skipped) * blocks + skipped  # the first block of each skip
        assert f"{match['percent']}%" == f"{ran / (len(pattern) * blocks):.0%}"


def check_result_cache(stdout: str) -> None:
    """L95, L96: exact seeded repeats come from the cache, equal bytewise; another seed,
    no seed and another tenant run; a folder answers after a restart."""
    assert stdout.splitlines() == [
        "first                ran 8 steps",
        "the same again       from the cache",
        "  equal bytewise: True",
        "another seed         ran 8 steps",
        "no seed              ran 8 steps",
        "tenant acme          ran 8 steps",
        "tenant acme again    from the cache",
        "hits 2, misses 3, 3 outputs kept",
        "before a restart     ran 8 steps",
        "after a restart      from the cache",
    ], stdout


def check_rollouts(stdout: str) -> None:
    """L100-L103: two whole groups of four; the trainer's recomputation of every one of
    their 48 transitions gives the rollout's log-probabilities exactly; after a sleep, a
    wake and an update, the next rollouts name the new weights."""
    lines = stdout.splitlines()
    assert sum(line.endswith("4 samples, partial: False") for line in lines) == 2, stdout
    assert lines[-2] == "trainer recomputed 48 transitions: largest difference 0.0", stdout
    assert lines[-1].endswith("the next rollouts ran on WeightVersion(number=1, label='step-1')"), (
        stdout
    )


#: What an example prints, checked past its exit status.
CHECKS = {
    "step_cache.py": check_step_cache,
    "result_cache.py": check_result_cache,
    "rollouts.py": check_rollouts,
}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path, tmp_path: Path) -> None:
    """Each example runs to completion on a CPU in seconds, writes what it says and prints
    what it means, and leaves nothing in the user's state folder (L77: a local server it
    starts keeps no video jobs in serve's default --jobs-dir).

    docs/tutorial.md's first program is examples/tutorial_first.py: it writes flower.png.
    """
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    if path.name in WRITES:
        assert (tmp_path / WRITES[path.name]).exists()
    if path.name in CHECKS:
        CHECKS[path.name](result.stdout)
    # conftest gives each test its own empty state folder ($XDG_STATE_HOME).
    assert list(Path(os.environ["XDG_STATE_HOME"]).iterdir()) == []


def test_stream_previews_does_what_its_docstring_says(tmp_path: Path) -> None:
    """examples/stream_previews.py: 12 steps, previews (1, 3, 8, 8) at 4, 8, 12, no file."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "stream_previews.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    expected = [
        f"step {k:2d}/12" + ("  preview (1, 3, 8, 8)" if k % 4 == 0 else "") for k in range(1, 13)
    ]
    assert result.stdout.splitlines() == [*expected, "final image (1, 3, 64, 64)"]
    assert list(tmp_path.iterdir()) == []


SNIPPETS = ROOT / "docs" / "snippets"


def test_testing_guide_example_passes(tmp_path: Path) -> None:
    """docs/testing.md's example test (docs/snippets/test_guide.py) passes on both backends."""
    code = (SNIPPETS / "test_guide.py").read_text()
    (tmp_path / "test_guide.py").write_text(code)
    (tmp_path / "conftest.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture(params=['trio', 'asyncio'])\n"
        "def anyio_backend(request):\n"
        "    return request.param\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


#: docs/tutorial.md's two fragments on leaving early, in the page's order.
TUTORIAL_FRAGMENTS = ("tutorial_break.py", "tutorial_abort.py")


def _as_function(code: str) -> Callable[..., Awaitable[Any]]:
    """``code`` as the body of ``async def f(engine, request, user_pressed_stop)``."""
    source = (
        "async def block(engine, request, user_pressed_stop):\n"
        + textwrap.indent(code, "    ")
        + "    return handle, locals().get('output')\n"
    )
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    function: Callable[..., Awaitable[Any]] = namespace["block"]
    return function


@pytest.mark.anyio
@pytest.mark.parametrize(("index", "steps_done"), [(0, 6), (1, 3)])
async def test_tutorial_leaving_early(index: int, steps_done: int) -> None:
    """docs/tutorial.md, leaving early: after a break the request runs on; abort() stops it.

    The user presses stop at step 2, while step 3 is in progress. The first block
    (a bare break) gets all 6 steps and the image; the second (abort, then break)
    ends ABORTED after the step in progress, never decoded (L7, L10).
    """
    block = _as_function((SNIPPETS / TUTORIAL_FRAGMENTS[index]).read_text())
    runner = GatedRunner()
    request = ot.GenerationRequest(prompt="x", num_steps=6, height=16, width=16, seed=1)
    seen: list[int] = []

    def user_pressed_stop() -> bool:
        seen.append(len(seen) + 1)
        if len(seen) < 2:
            return False
        # Step 3 is at the gate when the user presses stop; then it may run on.
        assert runner.wait_until_sync(lambda: runner.arrived == 3, BUDGET)
        runner.open_gate()
        return True

    runner.release(2)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle, output = await block(engine, request, user_pressed_stop)
    assert seen == [1, 2]
    assert handle.metrics is not None
    assert handle.metrics.steps_done == steps_done
    if index == 0:
        assert handle.status is ot.RequestStatus.COMPLETED
        assert output.images.shape == (1, 3, 16, 16)
    else:
        assert handle.status is ot.RequestStatus.ABORTED
        assert handle.abort_reason == "user"
        assert runner.decodes == 0
