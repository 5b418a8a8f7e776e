"""``omni-trio demo``: one image end to end, or an abort that skips the decode; a quiet start.

Each case runs the command in a subprocess (``python -m omni_trio demo``) on this
checkout's code, in the test's own folder, and asserts on its exit status, its
report (stdout) and its stderr.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from omni_trio.runners import tiny_pipeline
from tests.support.cli import bar_free, omni_trio_command, one_line_error, python
from tests.support.runners import REVISION, hub_cache


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


def test_a_hub_id_runs_offline_from_the_cache_with_the_specs_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L89: ``demo --model ORG/NAME --dtype bf16`` loads the id from the Hugging Face cache
    with HF_HUB_OFFLINE=1 (no network), in that dtype, and writes the image; its spec is
    the one ``serve --model`` builds (``runners.load_pipeline_of``)."""
    home = tmp_path / "hf"
    hub_cache(home, "sd", "tiny-org/tiny-sd")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_demo(
        tmp_path, "--model", "tiny-org/tiny-sd", "--revision", REVISION, "--dtype", "bf16"
    )
    assert result.returncode == 0, result.stderr
    assert "model: StableDiffusionPipeline from tiny-org/tiny-sd, bf16\n" in result.stdout
    assert (tmp_path / "demo.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        # Without --model, the spec's options do not apply.
        (["--dtype", "bf16"], "--dtype: applies with --model only"),
        (["--kind", "fake", "--compile", "blocks"], "--compile: applies with --model only"),
        (["--revision", "main"], "--revision: applies with --model only"),
        # A value the parser or the spec refuses names its option.
        (["--model", "MODEL", "--dtype", "bf17"], "argument --dtype: invalid choice: 'bf17'"),
        (["--model", "MODEL", "--compile-cache", "cache"], "--compile-cache: only with compile"),
        (["--model", "MODEL", "--revision", "main"], "--revision: only for a hub id, and"),
        # An id the cache lacks, offline: one line naming it and the command that fetches it.
        (
            ["--model", "tiny-org/absent"],
            "--model: model 'tiny-org/absent' is not in the Hugging Face cache",
        ),
    ],
)
def test_the_specs_options_are_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], line: str
) -> None:
    """L89: the model spec's options apply with --model only; a value refused by the parser
    or the spec, or a hub id not in the cache offline, is one line naming its option, exit 2,
    before anything loads."""
    folder = tmp_path / "tiny-sd"
    tiny_pipeline("sd").save_pretrained(folder)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = [str(folder) if arg == "MODEL" else arg for arg in args]
    one_line_error(run_demo(tmp_path, *argv), 2, line)
    assert not (tmp_path / "demo.png").exists()
