"""Quantization (L91): a model's weights in int8 or float8 through torchao, or its denoiser
from a GGUF file, at load where diffusers' quantizers do it, else on the loaded pipeline.

``ModelSpec.quantization`` names the mode:

- ``int8-weight``: int8 weights, per output channel, dequantized in each matmul
  (torchao's ``Int8WeightOnlyConfig``); CPU and CUDA;
- ``int8-dynamic``: int8 weights and int8 activations, each token's scale computed as
  it runs (``Int8DynamicActivationInt8WeightConfig``): an integer matmul (on a CPU, half
  a linear-heavy DiT's step, compiled or not; docs/runners.md); CPU and CUDA;
- ``fp8``: float8 weights and activations, per row (``Float8DynamicActivationFloat8WeightConfig``
  with ``PerRow``); CUDA only (a GPU of compute capability 8.9 or later), refused
  elsewhere in one line;
- ``gguf``: the denoiser's weights read from a single-file GGUF checkpoint
  (``ModelSpec.gguf_file``, through diffusers' ``from_single_file`` and its
  ``GGUFQuantizationConfig``: the weights stay in their GGUF blocks and are
  dequantized per layer as it runs), the rest of the pipeline from the source folder
  or hub id.

Which models: the denoisers by default (``transformer``, ``unet``; both of Wan 2.2's
experts); ``quantize_components`` names others (a text encoder: Flux's T5 is most of
its text side). A folder or hub id is quantized as it loads (diffusers'
``PipelineQuantizationConfig``: a diffusers model through ``diffusers.TorchAoConfig``,
a transformers one through ``transformers.TorchAoConfig``), so its full-precision
weights are never all in memory; a pipeline built in memory (the tiny ones) through
torchao's ``quantize_``, the same quantization.

Every row of a batch keeps its own scales (weights per channel, activations per
token or row), so a request alone and batched agree as they do unquantized (L81).
Adapters run on a quantized layer: PEFT wraps a torchao layer as its
``TorchaoLoraLinear`` (a GGUF one as a plain ``Linear``), whose base layer the per-row
forward calls as any other (``_adapters``); measured on tiny Flux, a LoRA over int8
weights stays within the quantization's own distance of the float32 one.

The ``quant`` extra installs torchao and the GGUF reader (the ``gguf`` package).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DENOISERS",
    "MODES",
    "check_quantization",
    "layout",
    "load_options",
    "quantize_pipeline",
    "storage_tensors",
    "torchao_quantization",
    "weight_bytes",
]

#: What ``quantization`` may be.
MODES = ("int8-weight", "int8-dynamic", "fp8", "gguf")

#: The denoisers' component names, every family's (``Family.denoisers``): what is
#: quantized by default.
DENOISERS = ("transformer", "transformer_2", "unet")

_EXTRA = "pip install 'omni_trio[quant]'"

#: An object's address in its ``repr``: not part of a layout.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def check_quantization(mode: str | None, device: str | None) -> None:
    """Refuse, in one line, a mode this machine cannot run: ``fp8`` off CUDA (or on a GPU
    before compute capability 8.9), a torchao mode without torchao, ``gguf`` without the
    ``gguf`` package.

    Raises:
        ValueError: the mode is unknown or cannot run here; the message says why.
    """
    if mode is None:
        return
    if mode not in MODES:
        raise ValueError(f"quantization: one of {', '.join(MODES)}, got {mode!r}")
    if mode == "fp8":
        if device is None or not device.startswith("cuda") or not torch.cuda.is_available():
            raise ValueError(
                f"quantization fp8 runs on CUDA only, and this model loads on {device or 'cpu'}:"
                " use int8-weight or int8-dynamic here"
            )
        capability = torch.cuda.get_device_capability(torch.device(device))
        if capability < (8, 9):
            raise ValueError(
                f"quantization fp8 needs a GPU of compute capability 8.9 or later (Ada,"
                f" Hopper); {device} has {capability[0]}.{capability[1]}"
            )
    if mode == "gguf":
        if importlib.util.find_spec("gguf") is None:
            raise ValueError(f"quantization gguf needs the gguf package: {_EXTRA}")
        return
    torchao_quantization()


def torchao_quantization() -> Any:
    """``torchao.quantization``, imported with its import-time notes dropped (``_quiet``).

    Raises:
        ValueError: torchao is not installed (one line naming the extra).
    """
    from ._quiet import quiet_notices

    try:
        with quiet_notices():
            # By name: torchao ships no type information.
            return importlib.import_module("torchao.quantization")
    except ImportError:
        raise ValueError(f"quantization needs torchao: {_EXTRA}") from None


def _config(mode: str) -> Any:
    """torchao's configuration of ``mode`` (an ``AOBaseConfig``)."""
    quantization = torchao_quantization()
    if mode == "int8-weight":
        return quantization.Int8WeightOnlyConfig()
    if mode == "int8-dynamic":
        return quantization.Int8DynamicActivationInt8WeightConfig()
    assert mode == "fp8", mode
    # Per row: each token's scale its own, so a row's result never depends on the batch.
    return quantization.Float8DynamicActivationFloat8WeightConfig(granularity=quantization.PerRow())


def _chosen(available: Mapping[str, str], named: Sequence[str] | None) -> list[str]:
    """The components to quantize among ``available`` (name to library): ``named``, or
    the denoisers.

    Raises:
        ValueError: a name that is not a model of the pipeline.
    """
    if named is None:
        return [name for name in DENOISERS if name in available]
    unknown = [name for name in named if name not in available]
    if unknown:
        raise ValueError(
            f"quantize_components: this pipeline has no model {unknown[0]!r}"
            f" (its models: {', '.join(sorted(available))})"
        )
    return list(named)


def load_options(
    mode: str | None,
    components: Sequence[str] | None,
    folder: Path,
    *,
    dtype: torch.dtype,
    gguf_file: str | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``from_pretrained`` that quantize the folder's pipeline as it
    loads: a ``quantization_config``, or (``gguf``) the denoiser read from the GGUF file.

    Raises:
        ValueError: as ``check_quantization``, a component the folder lacks, a model
            of neither diffusers nor transformers, or a GGUF file that does not load
            into the folder's denoiser (one line each).
    """
    if mode is None:
        return {}
    index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    libraries = {
        name: str(value[0])
        for name, value in index.items()
        if not name.startswith("_") and isinstance(value, list) and value[0] is not None
    }
    if mode == "gguf":
        assert gguf_file is not None
        return _gguf_denoiser(folder, libraries, gguf_file, dtype)
    import diffusers
    import transformers

    untyped: Any = diffusers
    configs = {"diffusers": untyped.TorchAoConfig, "transformers": transformers.TorchAoConfig}
    mapping: dict[str, Any] = {}
    for name in _chosen(libraries, components):
        library = libraries[name]
        if library not in configs:
            raise ValueError(f"quantize_components: {name!r} is a {library} model: not quantized")
        mapping[name] = configs[library](_config(mode))
    if not mapping:
        return {}
    return {"quantization_config": untyped.PipelineQuantizationConfig(quant_mapping=mapping)}


def _gguf_denoiser(
    folder: Path, libraries: Mapping[str, str], gguf_file: str, dtype: torch.dtype
) -> dict[str, Any]:
    """The folder's denoiser, its weights the GGUF file's (``{name: model}``)."""
    import diffusers

    untyped: Any = diffusers
    denoisers = [name for name in DENOISERS if name in libraries]
    if len(denoisers) != 1:
        raise ValueError(
            f"quantization gguf: one GGUF file is one denoiser, and this pipeline has"
            f" {len(denoisers)} ({', '.join(denoisers) or 'none'})"
        )
    name = denoisers[0]
    index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    model_class = getattr(untyped, str(index[name][1]), None)
    path = Path(gguf_file).expanduser()
    if not path.is_file():
        raise ValueError(f"gguf_file: no such file {str(path)!r}")
    if model_class is None or not hasattr(model_class, "from_single_file"):
        raise ValueError(f"quantization gguf: diffusers reads no single file into {index[name][1]}")
    try:
        model = model_class.from_single_file(
            str(path),
            config=str(folder),
            subfolder=name,
            quantization_config=untyped.GGUFQuantizationConfig(compute_dtype=dtype),
            torch_dtype=dtype,
            local_files_only=True,
        )
    except Exception as exc:
        raise ValueError(
            f"gguf_file {str(path)!r} does not load into this pipeline's {name}"
            f" ({type(exc).__name__}: {exc})"
        ) from None
    return {name: model}


def quantize_pipeline(pipe: Any, mode: str | None, components: Sequence[str] | None) -> Any:
    """Quantize a pipeline built in memory (a tiny one), in place, as loading it with
    ``load_options`` would: each chosen model's linear layers through torchao.

    Raises:
        ValueError: as ``check_quantization``; ``gguf``, which reads a file into a
            loaded model; a component the pipeline lacks.
    """
    if mode is None:
        return pipe
    if mode == "gguf":
        raise ValueError(
            "quantization gguf: a GGUF file replaces the denoiser of a folder or a hub id;"
            " this pipeline is built in memory"
        )
    models = {
        name: "torch"
        for name, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
    }
    config = _config(mode)
    quantize = torchao_quantization().quantize_
    for name in _chosen(models, components):
        quantize(pipe.components[name], config)
    return pipe


def storage_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors that hold ``tensor``: itself, or a tensor subclass's inner ones
    (torchao's ``qdata`` and ``scale``), recursively."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        yield tensor
        return
    names, _ = flatten(tensor)
    for name in names:
        yield from storage_tensors(getattr(tensor, name))


def layout(tensor: torch.Tensor) -> str:
    """How a quantized tensor is laid out (its class and its metadata, torchao's
    ``act_quant_kwargs`` among them: int8-weight and int8-dynamic hold the same int8
    weights); ``""`` for a plain tensor. The same in every process: no addresses."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return ""
    _, metadata = flatten(tensor)
    return _ADDRESS.sub("", f"{type(tensor).__name__}{metadata!r}")


def weight_bytes(module: torch.nn.Module) -> int:
    """The bytes that hold ``module``'s parameters and buffers, quantized ones as stored."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(part.nbytes for tensor in tensors for part in storage_tensors(tensor))
