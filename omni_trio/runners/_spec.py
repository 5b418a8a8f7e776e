"""A model as one value (L89): where it comes from and how it runs, from the command line
or Python to every worker and rank.

``ModelSpec`` is frozen and picklable: the server builds it once from its options, a
parallel group sends it to its rank processes as it is, and ``load_pipeline`` makes the
same pipeline from it everywhere:

- ``source``: a local diffusers folder, or a Hugging Face hub id (``org/name``) with an
  optional ``revision`` and ``variant`` (``fp16`` weight files), resolved through the
  Hugging Face cache. ``HF_HUB_OFFLINE=1`` is honoured (or ``offline=True``): then an id
  must be in the cache, and one that is not is one line naming it and how to fetch it;
- ``dtype``: ``auto`` (bfloat16 on CUDA, float32 on a CPU, where bfloat16 kernels are
  slow for many ops), or ``fp32``, ``fp16``, ``bf16``; ``component_dtypes`` overrides it
  per component (``(("vae", "fp32"),)``). diffusers keeps the modules a model lists in
  float32 (``_keep_in_fp32_modules``: Wan's norms and embeddings) whatever the dtype;
- ``attention_backend``: one of diffusers' attention backends by name
  (``set_attention_backend`` on the denoisers); one this machine or build lacks is
  refused when the model loads, in one line.

Quantization and compilation are fields of the spec too, applied by their own modules:
``quantization`` (``_quantize``: ``int8-weight``, ``int8-dynamic``, ``fp8`` on CUDA, or
``gguf`` with a ``gguf_file``) as the pipeline loads, ``compile`` once it is built.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._compile import MODES as COMPILE_MODES
from ._compile import use_compile_cache
from ._load import check_pipeline_folder, load_pipeline
from ._quantize import MODES as QUANTIZATION_MODES
from ._quantize import check_quantization, load_options

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "ModelSpec",
    "apply_dtype",
    "load",
    "load_pipeline_of",
    "pipeline_folder",
    "resolve_dtype",
    "runner_of",
    "set_attention_backend",
]

#: The dtypes a spec names, by name; ``auto`` picks one by device.
DTYPES = ("auto", "fp32", "fp16", "bf16")

#: A Hugging Face hub id: ``org/name`` (letters, digits, ``-``, ``_``, ``.``).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A model: where it comes from and how it runs (see the module's docstring).

    Args:
        source: a local diffusers folder, or a hub id ``org/name``.
        revision: the hub revision (a branch, tag or commit); only with a hub id.
        variant: the weight files' variant (``fp16``: ``*.fp16.safetensors``).
        dtype: ``auto``, ``fp32``, ``fp16`` or ``bf16``.
        component_dtypes: ``(component, dtype)`` pairs overriding ``dtype``.
        attention_backend: a diffusers attention backend's name, or ``None``: the
            model's default.
        offline: only the Hugging Face cache, never the network; ``None``: as
            ``HF_HUB_OFFLINE`` says.
        compile: ``"blocks"``: the denoiser's blocks compiled (L90, ``_compile``);
            ``None``: eager.
        compile_cache: a folder where the compiled artifacts are kept across
            restarts (torch's inductor cache), or ``None``: torch's default.
        quantization: ``int8-weight``, ``int8-dynamic``, ``fp8`` (CUDA only) or
            ``gguf`` (``_quantize``); ``None``: the weights as ``dtype`` says.
        quantize_components: the models quantized (a text encoder too:
            ``("transformer", "text_encoder_2")``); ``None``: the denoisers.
        gguf_file: with ``quantization="gguf"``: the single-file GGUF checkpoint of
            the denoiser, whose weights replace the source's.

    Raises:
        ValueError: a field is out of range; the message names it.
    """

    source: str
    revision: str | None = None
    variant: str | None = None
    dtype: str = "auto"
    component_dtypes: tuple[tuple[str, str], ...] = ()
    attention_backend: str | None = None
    offline: bool | None = None
    compile: str | None = None
    compile_cache: str | None = None
    quantization: str | None = None
    quantize_components: tuple[str, ...] | None = None
    gguf_file: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"source: a folder or a hub id, got {self.source!r}")
        for name, value in (("dtype", self.dtype), *self.component_dtypes):
            if value not in DTYPES or (name != "dtype" and value == "auto"):
                allowed = DTYPES if name == "dtype" else DTYPES[1:]
                raise ValueError(f"dtype of {name}: one of {', '.join(allowed)}, got {value!r}")
        names = [name for name, _ in self.component_dtypes]
        if len(set(names)) != len(names):
            raise ValueError(f"component_dtypes: a component named twice in {names}")
        if self.compile is not None and self.compile not in COMPILE_MODES:
            raise ValueError(f"compile: one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.compile_cache is not None and self.compile is None:
            raise ValueError("compile_cache: only with compile")
        self._check_quantization()

    def _check_quantization(self) -> None:
        mode = self.quantization
        if mode is not None and mode not in QUANTIZATION_MODES:
            raise ValueError(f"quantization: one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")
        if self.quantize_components is not None and mode in (None, "gguf"):
            raise ValueError("quantize_components: only with an int8 or fp8 quantization")
        if self.quantize_components is not None and not self.quantize_components:
            raise ValueError("quantize_components: name at least one model")
        if (mode == "gguf") != (self.gguf_file is not None):
            raise ValueError("gguf_file: with quantization gguf, and only with it")

    @property
    def is_hub_id(self) -> bool:
        """Whether ``source`` names a hub model (``org/name``, and no folder of that path)."""
        return _HUB_ID.fullmatch(self.source) is not None and not (
            Path(self.source).expanduser().exists()
        )


def resolve_dtype(name: str, device: str | None) -> torch.dtype:
    """The torch dtype ``name`` means on ``device`` (``auto``: bf16 on CUDA, else fp32)."""
    import torch

    if name == "auto":
        name = "bf16" if device is not None and device.startswith("cuda") else "fp32"
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def apply_dtype(pipe: Any, dtype: torch.dtype, components: Mapping[str, torch.dtype]) -> Any:
    """Cast a pipeline built in memory (a tiny one) as loading it with ``torch_dtype`` would:
    each module to its dtype, the modules its model keeps in float32 left in float32."""
    import torch

    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        module.to(components.get(name, dtype))
        keep = getattr(module, "_keep_in_fp32_modules", None) or ()
        for path, child in module.named_modules():
            if any(part in keep for part in path.split(".")):
                child.to(torch.float32)
    return pipe


def pipeline_folder(spec: ModelSpec) -> Path:
    """The diffusers folder of ``spec``'s source: the folder itself, checked, or the hub
    id's in the Hugging Face cache (fetched there unless offline); nothing loads.

    Raises:
        ValueError: the source is neither a diffusers folder nor a hub id in reach (one
            line naming it and how to fetch it), or a folder is given a revision.
    """
    if spec.is_hub_id:
        return _from_hub(spec)
    if spec.revision is not None:
        raise ValueError(f"revision: only for a hub id, and {spec.source!r} is a folder")
    return check_pipeline_folder(Path(spec.source).expanduser())


def load_pipeline_of(
    spec: ModelSpec, device: str | None = None, *, folder: Path | None = None
) -> Any:
    """The diffusers pipeline ``spec`` names, in its dtypes, quantized as it says, on
    ``device`` (``None``: where it loads), its attention backend set.

    Args:
        spec: the model.
        device: where it runs.
        folder: ``pipeline_folder(spec)``, if it is found already.

    Raises:
        ValueError: as ``pipeline_folder``, or the attention backend or the quantization
            is not available here.
        Exception: whatever diffusers raises for a model it cannot load.
    """
    from ._quiet import quiet_notices

    check_quantization(spec.quantization, device)
    dtype = resolve_dtype(spec.dtype, device)
    components = {name: resolve_dtype(value, device) for name, value in spec.component_dtypes}
    torch_dtype: Any = dtype if not components else {"default": dtype, **components}
    if folder is None:
        folder = pipeline_folder(spec)
    with quiet_notices():
        quantized = load_options(
            spec.quantization,
            spec.quantize_components,
            folder,
            dtype=dtype,
            gguf_file=spec.gguf_file,
        )
        pipe = load_pipeline(folder, torch_dtype=torch_dtype, variant=spec.variant, **quantized)
    if device is not None:
        pipe = pipe.to(device)
    if spec.attention_backend is not None:
        set_attention_backend(pipe, spec.attention_backend)
    return pipe


def _offline(spec: ModelSpec) -> bool:
    if spec.offline is not None:
        return spec.offline
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _from_hub(spec: ModelSpec) -> Path:
    """The folder of a hub id in the Hugging Face cache (fetched there unless offline)."""
    offline = _offline(spec)
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(spec.source, revision=spec.revision, local_files_only=offline)
    except Exception as exc:
        how = (
            f"fetch it where the network is reachable (huggingface-cli download {spec.source}"
            + (f" --revision {spec.revision}" if spec.revision else "")
            + ") into this cache, or unset HF_HUB_OFFLINE"
            if offline
            else "check the id, the revision and your access to it"
        )
        where = "in the Hugging Face cache" if offline else "on the Hugging Face hub"
        raise ValueError(
            f"model {spec.source!r}"
            + (f" at revision {spec.revision!r}" if spec.revision else "")
            + f" is not {where} ({type(exc).__name__}): {how}"
        ) from None
    return Path(folder)


def set_attention_backend(pipe: Any, name: str) -> None:
    """Set diffusers' attention backend ``name`` on the pipeline's denoisers.

    Raises:
        ValueError: no such backend, or this machine or build lacks it (one line).
    """
    from diffusers.models.attention_dispatch import AttentionBackendName

    known = [backend.value for backend in AttentionBackendName]
    if name not in known:
        raise ValueError(f"attention backend: one of {', '.join(known)}, got {name!r}")
    from ._registry import family_class

    family = family_class(pipe)
    denoisers = family.denoisers if family is not None else ("transformer", "unet")
    found = [getattr(pipe, denoiser, None) for denoiser in denoisers]
    models = [model for model in found if model is not None]
    if not models or not all(hasattr(model, "set_attention_backend") for model in models):
        raise ValueError(f"attention backend {name!r}: this model's denoiser takes none")
    try:
        for model in models:
            model.set_attention_backend(name)
    except Exception as exc:
        raise ValueError(
            f"attention backend {name!r} is not available here ({type(exc).__name__}: {exc})"
        ) from None


def load(spec: ModelSpec | str, *, device: str | None = None, **options: Any) -> Any:
    """The runner of ``spec`` (a ``ModelSpec``, or a folder or hub id as its ``source``):
    ``DiffusersRunner`` where it can drive the pipeline step by step, else
    ``PipelineCallRunner`` (``runner_for``); ``options`` are the runner's.

    Raises:
        ValueError: as ``load_pipeline_of`` and ``runner_of``.
    """
    if isinstance(spec, str):
        spec = ModelSpec(source=spec)
    return runner_of(load_pipeline_of(spec, device), spec, **options)


def runner_of(pipe: Any, spec: ModelSpec, **options: Any) -> Any:
    """The runner of ``pipe``, the pipeline ``load_pipeline_of(spec)`` made, as ``load``
    makes it: compiled as ``spec`` says, its progress bar off.

    Raises:
        ValueError: ``spec`` compiles a pipeline that runs by its own call.
    """
    from ._call import runner_for
    from ._diffusers import DiffusersRunner
    from ._registry import is_supported

    pipe.set_progress_bar_config(disable=True)
    if spec.compile is None:
        return runner_for(pipe, **options)
    if spec.compile_cache is not None:
        use_compile_cache(spec.compile_cache)
    if not is_supported(pipe):
        raise ValueError(
            f"compile: {type(pipe).__name__} runs by its own call, whose blocks omni_trio"
            " does not compile"
        )
    return DiffusersRunner(pipe, compile=spec.compile, **options)
