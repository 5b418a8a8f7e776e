"""The ``omni-trio`` command: one-line errors, exit statuses, --version, the serve extra.

Each case runs the command in a subprocess (``python -m omni_trio``) on this
checkout's code (``PYTHONPATH``) and asserts on its exit status and its whole
stderr. The serve extra's absence is simulated by a meta path hook that makes
``starlette`` unimportable before the command starts.
"""

from __future__ import annotations

import tomllib
from importlib import import_module
from pathlib import Path

import pytest

import omni_trio
from tests.support.cli import ROOT, omni_trio_command, python

# Makes "starlette" (the first module of the serve extra) look uninstalled.
WITHOUT_STARLETTE = """
import runpy, sys

class Uninstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "starlette":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Uninstalled())
sys.argv[0] = "omni-trio"
runpy.run_module("omni_trio", run_name="__main__", alter_sys=True)
"""

SERVE_EXTRA = (
    "omni-trio: error: serve needs the 'serve' extra (starlette is missing):"
    " pip install 'omni_trio[serve]'\n"
)


def test_version(tmp_path: Path) -> None:
    """--version prints the package's version on stdout and exits 0."""
    result = omni_trio_command("--version", cwd=tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, "omni-trio 0.2.0\n", "")
    assert omni_trio.__version__ == "0.2.0"


def test_console_script_is_main(capsys: pytest.CaptureFixture[str]) -> None:
    """pyproject's omni-trio script names omni_trio.cli:main, which runs the CLI."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["omni-trio"].partition(":")
    entry = getattr(import_module(module), function)
    with pytest.raises(SystemExit) as info:
        entry(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == "omni-trio 0.2.0\n"
    assert entry(["demo", "--steps", "0"]) == 2
    assert capsys.readouterr().err == "omni-trio: error: --steps: must be >= 1, got 0\n"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["demo", "--steps", "0"], "--steps: must be >= 1, got 0"),
        (["demo", "--steps", "5000"], "--steps: must be <= 1000 (engine limit), got 5000"),
        (
            ["demo", "--kind", "fake", "--size", "65"],
            "--size: must be a multiple of 8 for this runner, got 65",
        ),
        (["demo", "--seed", "-1"], "--seed: must be >= 0, got -1"),
        (
            ["demo", "--steps", "x"],
            "argument --steps: invalid int value: 'x' (see 'omni-trio demo --help')",
        ),
        (
            ["demo", "--kind", "fake", "--step-seconds", "inf"],
            "argument --step-seconds: expected a number of seconds >= 0, got 'inf'"
            " (see 'omni-trio demo --help')",
        ),
        (
            ["demo", "--frobnicate"],
            "unrecognized arguments: --frobnicate (see 'omni-trio demo --help')",
        ),
        (["demo", "--model", "no-such-folder"], "--model: no such folder: 'no-such-folder'"),
        # Options the run would ignore.
        (["demo", "--step-seconds", "0.1"], "--step-seconds: applies to --kind fake only"),
        (
            ["demo", "--model", ".", "--kind", "sdxl"],
            "--kind: does not apply with --model (the folder's pipeline is the model)",
        ),
        (
            ["demo", "--kind", "fake", "--steps", "5", "--abort-after", "5"],
            "--abort-after: must be below the 5 denoise steps: the run ends before step 5",
        ),
        # Checked before the model loads, not once the image is made.
        (
            ["demo", "--out", "no-such-folder/demo.png"],
            "--out: cannot write 'no-such-folder/demo.png': No such file or directory",
        ),
        (
            ["demo", "--out", "demo.text"],
            "--out: 'demo.text' does not end with an image extension (.png, .jpg, ...)",
        ),
        (
            ["demo", "--torch-threads", "0"],
            "argument --torch-threads: expected an integer from 1 to 4096, got '0'"
            " (see 'omni-trio demo --help')",
        ),
        (
            ["demo", "--model", "."],
            "--model: '.' is not a diffusers folder (it has no model_index.json)",
        ),
        (
            [],
            "the following arguments are required: {demo,serve,load} (see 'omni-trio --help')",
        ),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(tmp_path: Path, args: list[str], line: str) -> None:
    """A wrong argument prints exactly one line on stderr, no traceback, and exits 2."""
    result = omni_trio_command(*args, cwd=tmp_path)
    assert (result.returncode, result.stderr) == (2, f"omni-trio: error: {line}\n")
    assert result.stdout == ""


def test_a_model_that_does_not_load_exits_1(tmp_path: Path) -> None:
    """A diffusers folder whose model_index.json is broken: one line, exit 1."""
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "model_index.json").write_text("{not json")
    result = omni_trio_command("demo", "--model", str(folder), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        f"omni-trio: error: --model: could not load a pipeline from '{folder}': "
    )


def test_debug_adds_the_traceback(tmp_path: Path) -> None:
    """With --debug the same error comes after its traceback."""
    result = omni_trio_command("demo", "--steps", "0", "--debug", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("Traceback (most recent call last):\n")
    assert "InvalidRequestError: num_steps: must be >= 1, got 0" in result.stderr
    assert result.stderr.endswith("\nomni-trio: error: --steps: must be >= 1, got 0\n")


@pytest.mark.parametrize(
    "args",
    [
        ["serve"],
        ["serve", "--model", "fake", "--port", "not-a-port", "--frobnicate"],
        ["serve", "--help"],
        ["serve", "-h", "--model"],
    ],
)
def test_serve_without_its_extra_names_the_pip_command(tmp_path: Path, args: list[str]) -> None:
    """Without the serve extra, serve says what to install, whatever follows it; exit 1."""
    result = python("-c", WITHOUT_STARLETTE, *args, cwd=tmp_path)
    assert (result.returncode, result.stderr, result.stdout) == (1, SERVE_EXTRA, "")


def test_demo_works_without_the_serve_extra(tmp_path: Path) -> None:
    """Only serve needs the extra: the demo runs, and --help says what serve needs."""
    demo = ("demo", "--kind", "fake", "--steps", "2", "--step-seconds", "0")
    result = python("-c", WITHOUT_STARLETTE, *demo, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "demo.png").exists()
    helped = python("-c", WITHOUT_STARLETTE, "--help", cwd=tmp_path)
    assert helped.returncode == 0
    assert "(needs pip install 'omni_trio[serve]')" in helped.stdout
