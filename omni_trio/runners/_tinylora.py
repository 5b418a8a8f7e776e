"""Tiny random LoRAs for any LoRA-loadable pipeline, made with PEFT (no download).

``tiny_lora`` injects a ``LoraConfig`` into a copy of each LoRA-loadable component of
a pipeline (its denoiser and, with ``text``, its text encoders), gives the weights
seeded random values (PEFT starts ``lora_B`` at zero: a LoRA that changes nothing),
and saves them with the pipeline class's own ``save_lora_weights``: diffusers' file
format, with the adapter metadata that makes ``lora_alpha`` apply. For tests, demos
and benchmarks, as ``tiny_pipeline`` is; a served LoRA comes from its own file.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["DENOISER_TARGETS", "TEXT_TARGETS", "tiny_lora", "tiny_lora_weights"]

#: The layers a tiny LoRA targets: the attention projections of the denoisers, and of
#: the CLIP/T5 text encoders, as most published LoRAs do.
DENOISER_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


def tiny_lora_weights(
    pipe: Any, *, seed: int, rank: int = 4, alpha: int = 8, text: bool = True
) -> dict[str, Any]:
    """A random LoRA for ``pipe``'s architecture: ``save_lora_weights``' keyword arguments
    (each component's ``<name>_lora_layers`` and ``<name>_lora_adapter_metadata``).

    Small deltas (``lora_A`` ~ N(0, 1/rank), ``lora_B`` ~ N(0, 0.09/rank)): visible in
    the output, far from overflowing it. Needs PEFT (the ``adapters`` extra).
    """
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    generator = torch.Generator().manual_seed(seed)
    saved: dict[str, Any] = {}
    for name in getattr(pipe, "_lora_loadable_modules", ()):
        component = getattr(pipe, name, None)
        if not isinstance(component, torch.nn.Module):
            continue
        denoiser = name in ("unet", "transformer")
        if not (denoiser or text):
            continue
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=list(DENOISER_TARGETS if denoiser else TEXT_TARGETS),
            init_lora_weights=False,
        )
        with warnings.catch_warnings():
            # A copy of a component that has adapters already: PEFT's note, not a problem.
            warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
            model = inject_adapter_in_model(config, copy.deepcopy(component), adapter_name="made")
        state = get_peft_model_state_dict(model, adapter_name="made")
        for key, tensor in state.items():
            scale = 0.3 if "lora_B" in key else 1.0
            state[key] = torch.randn(tensor.shape, generator=generator) * scale / rank**0.5
        saved[f"{name}_lora_layers"] = state
        saved[f"{name}_lora_adapter_metadata"] = config.to_dict()  # type: ignore[no-untyped-call]
    if not saved:
        raise TypeError(f"{type(pipe).__name__} has no LoRA-loadable component")
    return saved


def tiny_lora(
    pipe: Any,
    folder: str | Path,
    name: str,
    *,
    seed: int,
    rank: int = 4,
    alpha: int = 8,
    text: bool = True,
) -> Path:
    """Save a random LoRA for ``pipe``'s architecture as ``folder/<name>.safetensors``.

    Args:
        pipe: the pipeline whose architecture the LoRA fits (its weights are not read).
        folder: an existing folder.
        name: the file's stem.
        seed: the random values' seed: the same seed, the same file.
        rank: the LoRA's rank.
        alpha: its ``lora_alpha`` (the deltas are scaled by ``alpha / rank``).
        text: the text encoders' attention too, where the pipeline loads LoRAs into
            them; ``False``: the denoiser's only.

    Returns:
        The file's path.

    Raises:
        TypeError: the pipeline loads no LoRA.
    """
    weights = tiny_lora_weights(pipe, seed=seed, rank=rank, alpha=alpha, text=text)
    type(pipe).save_lora_weights(str(folder), weight_name=f"{name}.safetensors", **weights)
    return Path(folder) / f"{name}.safetensors"
