"""``omni-trio demo``: one image end to end, or an abort that skips the decode; a quiet start.

Each case runs the command in a subprocess (``python -m omni_trio demo``) on this
checkout's code, in the test's own folder, and asserts on its exit status, its
report (stdout) and its stderr.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.cli import bar_free, omni_trio_command, python


def run_demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``omni-trio demo --steps 6 --out DEMO.PNG ARGS``, in ``tmp_path``."""
    out = tmp_path / "demo.png"
    return omni_trio_command("demo", "--steps", "6", "--out", str(out), *args, cwd=tmp_path)


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--kind", "sd3", "--backend", "asyncio"],
        ["--kind", "unet"],
        ["--kind", "fake", "--step-seconds", "0.01"],
        ["--abort-after", "3"],
        ["--kind", "fake", "--abort-after", "3", "--step-seconds", "0.01"],
    ],
)
def test_demo_command(tmp_path: Path, args: list[str]) -> None:
    """python -m omni_trio demo writes a PNG, or shows an abort that skipped the decode."""
    result = run_demo(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "demo.png"
    if "--abort-after" in args:
        assert "aborted (user)" in result.stdout
        assert "decodes run: 0" in result.stdout
        assert not out.exists()
    else:
        assert out.read_bytes().startswith(b"\x89PNG")


def test_the_demo_starts_quietly(tmp_path: Path) -> None:
    """The tiny SD demo's stderr is its progress bar alone, with Python's warnings shown.

    It used to print transformers' torchvision-fallback notice twice on every start.
    """
    result = python("-W", "default", "-m", "omni_trio", "demo", "--steps", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert bar_free(result.stderr) == []
    assert "  denoise: 100%" in result.stderr
    assert "3/3" in result.stderr


def test_a_model_folder_loads_quietly_and_generates(tmp_path: Path) -> None:
    """--model PATH loads a saved diffusers folder (no network) and generates; no
    accelerate or torchvision notice, only the loading and denoise bars.

    Without accelerate, diffusers used to warn on every load that it falls back to
    ``low_cpu_mem_usage=False``.
    """
    from omni_trio.runners import tiny_pipeline

    folder = tmp_path / "tiny-sd"
    tiny_pipeline("sd").save_pretrained(folder)
    result = run_demo(tmp_path, "--model", str(folder), "--steps", "2")
    assert result.returncode == 0, result.stderr
    assert "StableDiffusionPipeline from" in result.stdout
    assert (tmp_path / "demo.png").read_bytes().startswith(b"\x89PNG")
    loading = ("Loading pipeline components...", "Loading weights", "\x1b[A")
    assert [piece for piece in bar_free(result.stderr) if not piece.startswith(loading)] == []


def test_torch_threads_sets_the_process_count_and_out_picks_the_format(tmp_path: Path) -> None:
    """--torch-threads N: the engine sets torch's intra-op threads to N (one worker keeps
    torch's own count otherwise); --out writes the format its extension names."""
    script = (
        "import sys, torch; from omni_trio.cli import main; status = main(sys.argv[1:]);"
        " print(torch.get_num_threads()); sys.exit(status)"
    )
    out = tmp_path / "demo.jpg"
    demo = ["demo", "--kind", "fake", "--steps", "2", "--step-seconds", "0", "--out", str(out)]
    result = python("-c", script, *demo, "--torch-threads", "5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "5"
    assert out.read_bytes().startswith(b"\xff\xd8")  # JPEG
