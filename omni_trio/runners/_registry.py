"""Which family drives which pipeline: the registry on top of the family modules.

It imports every family module (``_sd``, ``_flow``, ``_video``); none of them
imports it, so what a pipeline gets is decided here alone.
"""

from __future__ import annotations

from ._chunks import DecodeChunks
from ._family import Family
from ._flow import Flux, QwenImage, StableDiffusion3
from ._sd import StableDiffusion, StableDiffusionXL, Unconditional
from ._video import LTXImageToVideo, LTXVideo, Wan, WanImageToVideo

__all__ = ["family_for", "is_supported", "supported_pipelines"]


#: Every family by the name of the pipeline class it drives.
_FAMILIES: dict[str, type[Family]] = {
    "StableDiffusionPipeline": StableDiffusion,
    "StableDiffusionXLPipeline": StableDiffusionXL,
    "StableDiffusion3Pipeline": StableDiffusion3,
    "FluxPipeline": Flux,
    "QwenImagePipeline": QwenImage,
    "DDPMPipeline": Unconditional,
    "DDIMPipeline": Unconditional,
    # Video (L70).
    "WanPipeline": Wan,
    "WanImageToVideoPipeline": WanImageToVideo,
    "LTXPipeline": LTXVideo,
    "LTXImageToVideoPipeline": LTXImageToVideo,
}


def supported_pipelines() -> list[str]:
    """The pipeline classes ``DiffusersRunner`` drives step by step."""
    return list(_FAMILIES)


def _family_class(pipe: object) -> type[Family] | None:
    import diffusers

    for name, family in _FAMILIES.items():
        # The exact class: a subclass may change the loop in ways we cannot see. The
        # name first: diffusers imports a pipeline's module (and its notices) on lookup.
        if type(pipe).__name__ == name and type(pipe) is getattr(diffusers, name):
            return family
    return None


def is_supported(pipe: object) -> bool:
    """Whether ``DiffusersRunner`` can drive ``pipe`` step by step."""
    return _family_class(pipe) is not None


def family_for(pipe: object, chunks: DecodeChunks | None = None) -> Family:
    """Return the family that drives ``pipe``, its decodes split as ``chunks`` says (L72).

    Raises:
        TypeError: ``pipe`` is not a pipeline of a supported family.
    """
    family = _family_class(pipe)
    if family is not None:
        instance = family(pipe)
        if chunks is not None:
            instance.chunks = chunks
        return instance
    raise TypeError(
        f"DiffusersRunner drives {', '.join(supported_pipelines())}; got"
        f" {type(pipe).__name__} (use omni_trio.runners.PipelineCallRunner for other pipelines)"
    )
