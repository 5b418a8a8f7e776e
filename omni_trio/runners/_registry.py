"""Which family drives which pipeline: the registry on top of the family modules.

It imports every family module (``_sd``, ``_flow``, ``_video``); none of them
imports it, so what a pipeline gets is decided here alone. The registry is the list
of family classes, ``FAMILIES``: each declares the pipelines it drives and its other
facts (``_family.Family``), so a new family is its class and one line here (and its
tiny pipeline in ``_tiny``). The rest of the package asks the registry for a
pipeline's family (``family_class``) and reads the facts off it: the cancel points
(``_cancel``), the adapters (``_adapters``), the server's defaults, and the parallel
layer through ``context_parallel_denoisers``.
"""

from __future__ import annotations

import torch

from ._chunks import DecodeChunks
from ._family import Family
from ._flow import Flux, QwenImage, StableDiffusion3
from ._sd import StableDiffusion, StableDiffusionXL, Unconditional
from ._video import LTXImageToVideo, LTXVideo, Wan, WanImageToVideo

__all__ = [
    "FAMILIES",
    "context_parallel_denoisers",
    "family_class",
    "family_for",
    "is_supported",
    "supported_pipelines",
]


#: Every family, images first, then videos (L70).
FAMILIES: tuple[type[Family], ...] = (
    StableDiffusion,
    StableDiffusionXL,
    StableDiffusion3,
    Flux,
    QwenImage,
    Unconditional,
    Wan,
    WanImageToVideo,
    LTXVideo,
    LTXImageToVideo,
)

#: Every family by the name of a pipeline class it drives.
_BY_PIPELINE: dict[str, type[Family]] = {
    pipeline: family for family in FAMILIES for pipeline in family.pipelines
}


def supported_pipelines() -> list[str]:
    """The pipeline classes ``DiffusersRunner`` drives step by step."""
    return list(_BY_PIPELINE)


def family_class(pipe: object) -> type[Family] | None:
    """The family that drives ``pipe``, or ``None`` where none does."""
    import diffusers

    name = type(pipe).__name__
    family = _BY_PIPELINE.get(name)
    # The exact class: a subclass may change the loop in ways we cannot see. The
    # name first: diffusers imports a pipeline's module (and its notices) on lookup.
    return family if family is not None and type(pipe) is getattr(diffusers, name) else None


def family_blocks(pipe: object) -> list[torch.nn.Module]:
    """The blocks of ``pipe``'s denoisers that its family names, in call order (a DiT's
    transformer blocks, a UNet's down, mid and up blocks); none for a pipeline of no
    family. Cancel points come before them (L71), compilation compiles them (L90)."""
    family = family_class(pipe)
    if family is None:
        return []
    modules: list[torch.nn.Module] = []
    for name in family.denoisers:
        denoiser = getattr(pipe, name, None)
        if not isinstance(denoiser, torch.nn.Module):
            continue
        for attribute in family.block_lists:
            blocks = getattr(denoiser, attribute, None)
            if isinstance(blocks, torch.nn.ModuleList):
                modules.extend(blocks)
            elif isinstance(blocks, torch.nn.Module):
                modules.append(blocks)
    return modules


def is_supported(pipe: object) -> bool:
    """Whether ``DiffusersRunner`` can drive ``pipe`` step by step."""
    return family_class(pipe) is not None


def _driven(pipe: object) -> type[Family]:
    """``pipe``'s family.

    Raises:
        TypeError: ``pipe`` is not a pipeline of a supported family.
    """
    family = family_class(pipe)
    if family is None:
        raise TypeError(
            f"DiffusersRunner drives {', '.join(supported_pipelines())}; got"
            f" {type(pipe).__name__} (use omni_trio.runners.PipelineCallRunner for other"
            f" pipelines)"
        )
    return family


def family_for(pipe: object, chunks: DecodeChunks | None = None) -> Family:
    """Return the family that drives ``pipe``, its decodes split as ``chunks`` says (L72).

    Raises:
        TypeError: ``pipe`` is not a pipeline of a supported family.
    """
    instance = _driven(pipe)(pipe)
    if chunks is not None:
        instance.chunks = chunks
    return instance


def context_parallel_denoisers(
    pipeline: object, layout: str | None = None
) -> list[torch.nn.Module]:
    """Return the denoisers of ``pipeline`` that sequence parallel splits over ranks (L48).

    They are its family's, each with diffusers' context-parallel plan. ``layout``
    (``"ulysses"`` or ``"ring"``) is refused where its family's split is known wrong
    (LTX-Video); ``None`` checks the plan only.

    Raises:
        TypeError: ``pipeline`` is no family's; its denoisers have no context-parallel
            plan (the message names the families that have one); or its family's split
            under ``layout`` is wrong (the message says why and names the layout that
            works, cfg).
    """
    family = _driven(pipeline)
    models = [getattr(pipeline, name, None) for name in family.denoisers]
    found = [model for model in models if isinstance(model, torch.nn.Module)]
    planned = all(getattr(model, "_cp_plan", None) for model in found)
    if not (family.context_parallel and found and planned):
        served = dict.fromkeys(
            f.title for f in FAMILIES if f.context_parallel and not f.wrong_splits
        )
        raise TypeError(
            f"sequence parallel needs a transformer with a context-parallel plan"
            f" ({', '.join(served)}); {type(pipeline).__name__} has none"
        )
    why = None if layout is None else family.wrong_splits.get(layout)
    if why is not None:
        raise TypeError(
            f"sequence parallel: {family.title} is not supported ({why}); split its"
            f" classifier-free guidance instead (cfg)"
        )
    return found
