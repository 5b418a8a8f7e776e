"""The model spec's options (L89-L92), declared once for ``serve`` and ``demo``.

Each sets the field of ``omni_trio.runners.ModelSpec`` of its name, which is also the
field of ``ServiceOptions`` of that name: ``serve``'s table (``_serve_table``) lists them
among its own, and ``demo`` adds them to its ``--model`` (``_demo``). The module imports
neither torch nor the serve extra: both commands build their parsers from it, and the
demo runs without the extra.

``ModelSpec`` refuses a value with a ``ValueError`` whose message starts with the
field's name (its words, or the name itself); ``named`` names the option that set it
instead, and ``spec_error`` makes that the command's usage error.
"""

from __future__ import annotations

from ._declare import Option
from ._errors import UsageError
from ._serve_groups import MODEL, Applies, names

__all__ = ["COMPILE_MODES", "DTYPES", "QUANTIZATIONS", "SPEC_OPTIONS", "named", "spec_error"]

#: A model's dtypes, compile modes and quantizations, as ``runners.ModelSpec`` takes them
#: (written out: the parsers import no torch; tests/runners/test_spec.py and
#: tests/runners/test_quantize.py hold them equal).
DTYPES = ("auto", "fp32", "fp16", "bf16")
COMPILE_MODES = ("blocks",)
QUANTIZATIONS = ("int8-weight", "int8-dynamic", "fp8", "gguf")

#: The options of a model spec, in ``--help``'s order; ``sets``: the field of
#: ``ModelSpec`` (and ``ServiceOptions``) of that name.
SPEC_OPTIONS = (
    Option(
        flag="--revision",
        sets="revision",
        group=MODEL,
        applies=Applies.REAL,
        help="the hub id's revision: a branch, tag or commit (default: main)",
    ),
    Option(
        flag="--variant",
        sets="variant",
        group=MODEL,
        applies=Applies.REAL,
        help="the weight files' variant, as fp16 for *.fp16.safetensors (default: none)",
    ),
    Option(
        flag="--dtype",
        sets="dtype",
        group=MODEL,
        choices=DTYPES,
        applies=Applies.REAL,
        help="the modules' dtype: auto is bf16 on CUDA, fp32 on a CPU (default auto)",
    ),
    Option(
        flag="--attention-backend",
        sets="attention_backend",
        group=MODEL,
        metavar="NAME",
        applies=Applies.REAL,
        help="one of diffusers' attention backends (native, flash, sage, ...); one this"
        " machine lacks stops the start (default: the model's)",
    ),
    Option(
        flag="--compile",
        sets="compile",
        group=MODEL,
        choices=COMPILE_MODES,
        applies=Applies.REAL,
        help="blocks: compile the denoiser's blocks, the warm-up's shapes before the server"
        " answers; other shapes then run eager, never stalling a batch (default: eager)",
    ),
    Option(
        flag="--compile-cache",
        sets="compile_cache",
        group=MODEL,
        metavar="DIR",
        applies=Applies.REAL,
        help="keep the compiled artifacts in DIR, for a restart in seconds (default: torch's)",
    ),
    Option(
        flag="--quantization",
        sets="quantization",
        group=MODEL,
        choices=QUANTIZATIONS,
        applies=Applies.REAL,
        help="int8-weight, int8-dynamic (torchao: the quant extra), fp8 (CUDA only), or gguf"
        " (the denoiser from --gguf-file): the denoiser's weights quantized as the model"
        " loads (default: none)",
    ),
    Option(
        flag="--quantize-components",
        sets="quantize_components",
        group=MODEL,
        type=names,
        metavar="LIST",
        applies=Applies.REAL,
        help="the models --quantization quantizes, comma-separated, as"
        " transformer,text_encoder_2 (default: the denoisers)",
    ),
    Option(
        flag="--gguf-file",
        sets="gguf_file",
        group=MODEL,
        metavar="FILE",
        applies=Applies.REAL,
        help="with --quantization gguf: the denoiser's single-file GGUF checkpoint",
    ),
)


def named(exc: Exception) -> str | None:
    """``exc``'s first line named by the option that set the field it names first
    (``compile_cache: only with compile`` -> ``--compile-cache: only with compile``;
    ``attention backend 'flash' is not available here`` -> ``--attention-backend: ...``),
    or ``None`` when it names none.
    """
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    for option in SPEC_OPTIONS:
        for spelled in (option.name, option.name.replace("_", " ")):
            if text.startswith(f"{spelled}: "):
                return f"{option.flag}: {text.removeprefix(f'{spelled}: ')}"
            if text.startswith(f"{spelled} "):
                return f"{option.flag}: {text}"
    return None


def spec_error(exc: ValueError) -> UsageError:
    """The usage error of a spec's refusal: ``named``, else ``--model``'s (a folder or a hub
    id out of reach)."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return UsageError(named(exc) or f"--model: {lines[0]}")
