"""Load a local diffusers folder for the engine, with a plain error when it is not one."""

from __future__ import annotations

import json
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


def load_pipeline(
    path: str | os.PathLike[str],
    *,
    torch_dtype: Any = None,
    variant: str | None = None,
    **extra: Any,
) -> DiffusionPipeline:
    """Load the diffusers pipeline saved in a local folder, never touching the network.

    What diffusers needs told, the loader tells it:

    - a component saved as ``None`` (Stable Diffusion 3 without its T5) is written
      ``[null, null]`` in ``model_index.json``, and diffusers refuses to build the
      pipeline without it unless it is passed as ``None``: the loader passes it;
    - without ``accelerate`` installed, diffusers warns on every load that it falls
      back to ``low_cpu_mem_usage=False``: the loader asks for that directly, so the
      load is the same and the start is quiet. A model that keeps modules in float32
      (Wan's transformer) loads only through accelerate: the loader says so in one
      line rather than let diffusers refuse ``low_cpu_mem_usage=False``.

    Args:
        path: a folder that ``check_pipeline_folder`` accepts.
        torch_dtype: the modules' dtype (a ``torch.dtype``, or diffusers' mapping of
            component to dtype with a ``"default"``); ``None``: as saved.
        variant: the weight files' variant (``fp16``), or ``None``.
        extra: more keyword arguments of ``from_pretrained``: a
            ``quantization_config``, a component loaded apart (``_quantize``).

    Returns:
        The pipeline, as ``DiffusionPipeline.from_pretrained`` built it.

    Raises:
        ValueError: ``path`` is not a diffusers folder (see ``check_pipeline_folder``),
            or its ``model_index.json`` is not a JSON object.
        ImportError: a model of the pipeline needs ``accelerate``, which is not installed.
        Exception: whatever diffusers raises for a folder it cannot load.
    """
    folder = check_pipeline_folder(path)
    index = _read_index(folder)
    with quiet_notices():
        import diffusers

        untyped: Any = diffusers  # unannotated constructors; mypy --strict rejects them
        options: dict[str, Any] = {"local_files_only": True}
        if torch_dtype is not None:
            # diffusers 0.40 renamed ``torch_dtype`` ``dtype`` (the old name warns).
            modern = hasattr(untyped.pipelines.pipeline_utils, "_resolve_dtype")
            options["dtype" if modern else "torch_dtype"] = torch_dtype
        if variant is not None:
            options["variant"] = variant
        options |= dict.fromkeys(_saved_as_none(index))
        options |= extra
        if not untyped.utils.is_accelerate_available():
            _refuse_without_accelerate(untyped, index)
            options["low_cpu_mem_usage"] = False
        pipeline: DiffusionPipeline = untyped.DiffusionPipeline.from_pretrained(
            str(folder), **options
        )
    return pipeline


def _read_index(folder: Path) -> dict[str, Any]:
    """The folder's ``model_index.json``.

    Raises:
        ValueError: it is not a JSON object.
    """
    try:
        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{str(folder)!r}: cannot read its model_index.json ({exc})") from None
    if not isinstance(index, dict):
        raise ValueError(f"{str(folder)!r}: its model_index.json is not a JSON object")
    return index


def _components(index: dict[str, Any]) -> dict[str, tuple[object, object]]:
    """The components ``index`` records: name to ``(library, class name)``."""
    return {
        name: (value[0], value[1])
        for name, value in index.items()
        if not name.startswith("_") and isinstance(value, list) and len(value) == 2
    }


def _saved_as_none(index: dict[str, Any]) -> list[str]:
    """The components saved as ``None`` (``[null, null]``)."""
    return [name for name, pair in _components(index).items() if pair == (None, None)]


def _refuse_without_accelerate(diffusers: Any, index: dict[str, Any]) -> None:
    """Raise if a diffusers model of ``index`` keeps modules in float32.

    diffusers loads such a model only with ``low_cpu_mem_usage=True``, which needs
    accelerate (``ModelMixin.from_pretrained``).

    Raises:
        ImportError: such a model is there; the message names it and the fix.
    """
    for library, name in _components(index).values():
        if library != "diffusers" or not isinstance(name, str):
            continue
        if getattr(getattr(diffusers, name, None), "_keep_in_fp32_modules", None) is not None:
            raise ImportError(
                f"{index.get('_class_name', 'this pipeline')} needs accelerate to load"
                f" ({name} keeps modules in float32): pip install accelerate",
                name="accelerate",
            )
