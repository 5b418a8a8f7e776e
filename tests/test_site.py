"""The documentation site builds with ``mkdocs build --strict``, and its HTML is whole.

Strict: a broken link or anchor, a link to no page or file of the site, a code block that
is no copy of its file (docs/hooks/site.py) or a reference mkdocstrings cannot resolve
fails the build. The built HTML is checked without a browser: every page of the
navigation is there, the search index finds "abort", the state machine is a Mermaid
block, the reference is generated from the docstrings, the examples and the benchmarks'
plots are in. ``scripts/check_site.py`` checks the same site in headless Chromium.

Those checks build in this environment, and are skipped, with the reason, without the
``docs`` extra (the ``test`` extra includes it, so CI builds the site). The slow tests at
the end run the documented commands verbatim, as a reader would: in a fresh virtual
environment with the pinned CPU torch and the ``docs`` extra alone, from a copy of the
checkout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers")
MISSING = [name for name in DOCS_PACKAGES if importlib.util.find_spec(name) is None]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the site once, strictly, into a temporary folder."""
    if MISSING:
        pytest.skip(
            f"the docs extra is not installed (no {', '.join(MISSING)}): pip install -e '.[docs]'"
        )
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-6000:]
    return out


def _page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text()


def test_every_page_of_the_navigation_is_built(site: Path) -> None:
    """Each page mkdocs.yml's nav names is in the site, and a reference page per module."""
    lines = [line.strip() for line in (ROOT / "mkdocs.yml").read_text().splitlines()]
    nav = [
        line.split(": ", 1)[1] for line in lines if line.startswith("- ") and line.endswith(".md")
    ]
    modules = [line[2:] for line in lines if line.startswith("- omni_trio")]
    assert len(nav) > 20 and "omni_trio.testing" in modules
    for page in [*nav, *(f"reference/{module}.md" for module in modules)]:
        built = site / ("" if page == "index.md" else page.removesuffix(".md")) / "index.html"
        assert built.is_file(), page


def test_the_search_index_finds_abort(site: Path) -> None:
    """The search index holds the tutorial's section on aborts."""
    index = json.loads((site / "search" / "search_index.json").read_text())
    hits = [doc["location"] for doc in index["docs"] if "abort" in doc["text"].lower()]
    assert any(location.startswith("tutorial/") for location in hits), hits[:20]


def test_the_state_machine_is_a_mermaid_diagram(site: Path) -> None:
    """The design page's state machine is left for Mermaid to draw (a browser renders it)."""
    design = _page(site, "design")
    assert '<pre class="mermaid">' in design
    assert "stateDiagram-v2" in design


def test_the_reference_is_generated_from_the_docstrings(site: Path) -> None:
    """mkdocstrings rendered the public names, with their docstrings."""
    reference = _page(site, "reference/omni_trio")
    assert 'id="omni_trio.open_engine"' in reference
    assert "Submit <code>request</code> and wait for its output" in reference
    assert 'id="omni_trio.testing.FakeRunner"' in _page(site, "reference/omni_trio.testing")
    assert 'id="omni_trio.runners.DiffusersRunner"' in _page(site, "reference/omni_trio.runners")


def test_samples_are_included_from_their_files(site: Path) -> None:
    """The examples page and the tutorial show the example files' own text, each under
    its file's name."""
    examples = _page(site, "examples")
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert f'id="{path.stem}"' in examples, path.name
        assert f'<span class="filename">examples/{path.name}</span>' in examples, path.name
    assert "tiny_pipeline" in _page(site, "tutorial")


def test_the_performance_page_has_every_plot(site: Path) -> None:
    """The Performance page, rendered from docs/perf/*.json, shows each benchmark's plot."""
    performance = _page(site, "performance")
    for result in sorted((ROOT / "docs" / "perf").glob("*.json")):
        assert f"perf/{result.stem}.png" in performance, result.stem
        assert (site / "perf" / f"{result.stem}.png").is_file()


# The documented commands, run verbatim in a fresh environment with the docs extra alone.

#: How docs/install.md and the README install the docs extra.
INSTALL_DOCS = "python -m pip install -e '.[docs]'"
#: The address `mkdocs serve` serves on (its default, which the docs state).
SERVE_URL = "http://127.0.0.1:8000/"
#: Seconds for a fresh environment's installs, and for a build or `mkdocs serve` to
#: answer (chosen, not measured to the edge: on the idle 2-core VM the installs take
#: about 40 s and a build 15 s; a loaded CI machine may take several times that).
INSTALL_S = 420.0
BUILD_S = 240.0


def _site_block(text: str, heading: str) -> list[str]:
    """The lines of the first ```sh block after ``heading`` in ``text``."""
    section = text.split(f"\n{heading}\n", 1)[1]
    block = re.search(r"^```sh\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)
    assert block, heading
    return block[1].splitlines()


def _documented_commands() -> list[str]:
    """The site's commands as docs/install.md states them (the README states the same)."""
    return _site_block((ROOT / "docs" / "install.md").read_text(), "## This site, locally")


def _pinned_torch() -> str:
    """The torch requirement scripts/bootstrap.sh installs before the package."""
    pinned = re.search(
        r"install[^\n]*?(torch==[\w.+]+)", (ROOT / "scripts/bootstrap.sh").read_text()
    )
    assert pinned, "scripts/bootstrap.sh pins no torch"
    return pinned[1]


def test_the_readme_and_the_install_page_state_the_same_docs_commands() -> None:
    """The README's documentation commands are docs/install.md's, and both install the
    docs extra the same way (the slow tests below run that page's commands)."""
    readme = (ROOT / "README.md").read_text()
    install = (ROOT / "docs" / "install.md").read_text()
    assert _site_block(readme, "## Documentation") == _documented_commands()
    assert INSTALL_DOCS in readme
    assert INSTALL_DOCS in install
    commands = [line.split("#", 1)[0].strip() for line in _documented_commands()]
    assert commands[:2] == ["mkdocs serve", "mkdocs build --strict"], commands


@dataclass(frozen=True, slots=True, kw_only=True)
class DocsEnv:
    """A copy of the checkout and the environment of a shell in a fresh venv there."""

    checkout: Path
    env: dict[str, str]

    def run(self, command: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run ``command`` verbatim in bash, from the copy's root."""
        return subprocess.run(
            ["bash", "-c", command],
            cwd=self.checkout,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def _copy_checkout(dest: Path) -> None:
    """Copy the checkout's files (tracked, and new ones git does not ignore) to ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


@pytest.fixture(scope="session")
def docs_env(tmp_path_factory: pytest.TempPathFactory) -> DocsEnv:
    """A fresh venv with the pinned CPU torch, then the docs extra alone, installed the
    way the docs say, from a copy of the checkout (so nothing is written into it).

    pip's cache is used as it is; the packages come from local disk here. Byte-compiling
    what is installed is left to the first import (``PIP_COMPILE=0``): it halves the
    installs' time and changes nothing that is installed.
    """
    root = tmp_path_factory.mktemp("docs-env")
    checkout = root / "checkout"
    _copy_checkout(checkout)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=INSTALL_S)
    inherited = {
        key: value
        for key, value in os.environ.items()
        if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
    }
    env = {
        **inherited,
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv),
        "PIP_COMPILE": "0",
        "NO_MKDOCS_2_WARNING": "1",
    }
    docs_env = DocsEnv(checkout=checkout, env=env)
    for command in (f"python -m pip install -q {_pinned_torch()}", f"{INSTALL_DOCS} -q"):
        installed = docs_env.run(command, timeout=INSTALL_S)
        assert installed.returncode == 0, (command, installed.stderr[-4000:])
    # The extra alone: nothing of the test or serve extras came with it.
    alone = docs_env.run(
        "python -c 'import importlib.util as u;"
        ' assert not any(map(u.find_spec, ("pytest", "starlette", "matplotlib")))\'',
        timeout=60,
    )
    assert alone.returncode == 0, alone.stderr
    return docs_env


def _command(start: str) -> str:
    """The documented command line that starts with ``start``, verbatim, comment and all."""
    lines = [line for line in _documented_commands() if line.startswith(start)]
    assert len(lines) == 1, (start, _documented_commands())
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_S + BUILD_S)
def test_mkdocs_build_strict_runs_with_the_docs_extra_alone(docs_env: DocsEnv) -> None:
    """``mkdocs build --strict``, as documented, builds the whole site in a fresh venv
    with only the docs extra: the benchmarks' renderer imports, the reference's
    signatures are formatted, and the site lands in site/."""
    built = docs_env.run(_command("mkdocs build --strict"), timeout=BUILD_S)
    assert built.returncode == 0, built.stderr[-6000:]
    assert "Formatting signatures requires" not in built.stderr
    site = docs_env.checkout / "site"
    assert 'id="omni_trio.open_engine"' in _page(site, "reference/omni_trio")
    performance = _page(site, "performance")
    for result in sorted((ROOT / "docs" / "perf").glob("*.json")):
        assert f"perf/{result.stem}.png" in performance, result.stem
    assert '<span class="filename">examples/quickstart.py</span>' in _page(site, "")


def _port_taken(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def _serving(docs_env: DocsEnv, command: str, stderr: list[str]) -> Iterator[subprocess.Popen[str]]:
    """Run ``command`` in its own process group; stop that group on the way out (it may
    have ended already) and put what it wrote on stderr in ``stderr``."""
    process = subprocess.Popen(
        ["bash", "-c", command],
        cwd=docs_env.checkout,
        env=docs_env.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)
        try:
            _, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            _, err = process.communicate()
        stderr.append(err or "")


def _home_page(process: subprocess.Popen[str]) -> str | None:
    """The served home page, polled until it answers; ``None`` if the server ended first."""
    deadline = time.monotonic() + BUILD_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(SERVE_URL, timeout=10) as answer:
                body: str = answer.read().decode()
                return body
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)  # the first build is still running
    return None


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_S + BUILD_S + 60)
def test_mkdocs_serve_runs_with_the_docs_extra_alone(docs_env: DocsEnv) -> None:
    """``mkdocs serve``, as documented, serves the site at 127.0.0.1:8000 in a fresh venv
    with only the docs extra."""
    if _port_taken(8000):
        pytest.skip("port 8000 is in use here: mkdocs serve could not bind it")
    stderr: list[str] = []
    with _serving(docs_env, _command("mkdocs serve"), stderr) as process:
        page = _home_page(process)
    assert page is not None, "".join(stderr)[-6000:]
    assert "<title>omni_trio</title>" in page


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_S + BUILD_S + 120)
def test_check_site_runs_with_the_docs_extra_alone(docs_env: DocsEnv) -> None:
    """``python scripts/check_site.py screenshots``, as documented, runs in a fresh venv
    with only the docs extra: every check passes, or, with no Chromium, it says SKIPPED."""
    checked = docs_env.run(_command("python scripts/check_site.py"), timeout=BUILD_S + 120)
    assert checked.returncode == 0, (checked.stdout + checked.stderr)[-6000:]
    assert "every check passed" in checked.stdout or "SKIPPED" in checked.stdout
