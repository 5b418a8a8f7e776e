"""Load a local diffusers folder for the engine, with a plain error when it is not one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._quiet import quiet_notices

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

__all__ = ["check_pipeline_folder", "load_pipeline"]


def check_pipeline_folder(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` if it is a diffusers pipeline folder (it has a ``model_index.json``).

    Args:
        path: the folder, as ``save_pretrained`` or a Hugging Face snapshot wrote it.

    Returns:
        The folder as a ``Path``.

    Raises:
        ValueError: ``path`` does not exist, is not a folder, or has no
            ``model_index.json``; the message says which, in one line.
    """
    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"no such folder: {str(folder)!r}")
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r} is a file, not a diffusers folder")
    if not (folder / "model_index.json").is_file():
        raise ValueError(f"{str(folder)!r} is not a diffusers folder (it has no model_index.json)")
    return folder


def load_pipeline(path: str | os.PathLike[str]) -> DiffusionPipeline:
    """Load the diffusers pipeline saved in a local folder, never touching the network.

    Without ``accelerate`` installed, diffusers warns on every load that it falls
    back to ``low_cpu_mem_usage=False``; the loader asks for that directly, so the
    load is the same and the start is quiet.

    Args:
        path: a folder that ``check_pipeline_folder`` accepts.

    Returns:
        The pipeline, as ``DiffusionPipeline.from_pretrained`` built it.

    Raises:
        ValueError: ``path`` is not a diffusers folder (see ``check_pipeline_folder``).
        Exception: whatever diffusers raises for a folder it cannot load.
    """
    folder = check_pipeline_folder(path)
    with quiet_notices():
        import diffusers

        untyped: Any = diffusers  # unannotated constructors; mypy --strict rejects them
        options: dict[str, Any] = {"local_files_only": True}
        if not untyped.utils.is_accelerate_available():
            options["low_cpu_mem_usage"] = False
        pipeline: DiffusionPipeline = untyped.DiffusionPipeline.from_pretrained(
            str(folder), **options
        )
    return pipeline
