"""Tiny random LoRAs for the tiny pipelines, made with peft (no downloads).

``make_lora`` injects a ``LoraConfig`` into a copy of each LoRA-loadable component
of a pipeline (its denoiser and, with ``text``, its text encoders), gives the
``lora_B`` weights random values (peft starts them at zero: a LoRA that changes
nothing), and saves the lot with the pipeline class's own ``save_lora_weights``
(diffusers' format, with its adapter metadata: ``lora_alpha`` applies).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch

#: The layers a LoRA targets: the attention projections of the denoisers and of the
#: CLIP/T5 text encoders, as most published LoRAs do.
DENOISER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def lora_state(
    pipe: Any, *, seed: int, rank: int = 4, alpha: int = 8, text: bool = True
) -> dict[str, Any]:
    """``save_lora_weights``' keyword arguments: each component's LoRA and its metadata."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    generator = torch.Generator().manual_seed(seed)
    saved: dict[str, Any] = {}
    for name in pipe._lora_loadable_modules:
        component = getattr(pipe, name, None)
        if not isinstance(component, torch.nn.Module):
            continue
        denoiser = name in ("unet", "transformer")
        if not (denoiser or text):
            continue
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=DENOISER_TARGETS if denoiser else TEXT_TARGETS,
            init_lora_weights=False,
        )
        with warnings.catch_warnings():
            # A copy of a component that has adapters already: PEFT's note, not a problem.
            warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
            model = inject_adapter_in_model(config, copy.deepcopy(component), adapter_name="made")
        state = get_peft_model_state_dict(model, adapter_name="made")
        for key, tensor in state.items():
            # Small random deltas: visible in the output, far from overflowing it.
            scale = 0.3 if "lora_B" in key else 1.0
            state[key] = torch.randn(tensor.shape, generator=generator) * scale / rank**0.5
        saved[f"{name}_lora_layers"] = state
        saved[f"{name}_lora_adapter_metadata"] = config.to_dict()  # type: ignore[no-untyped-call]
    return saved


def make_lora(
    pipe: Any,
    folder: Path,
    name: str,
    *,
    seed: int,
    rank: int = 4,
    alpha: int = 8,
    text: bool = True,
) -> Path:
    """Save a random LoRA for ``pipe``'s architecture as ``folder/name.safetensors``."""
    weights = lora_state(pipe, seed=seed, rank=rank, alpha=alpha, text=text)
    type(pipe).save_lora_weights(str(folder), weight_name=f"{name}.safetensors", **weights)
    return folder / f"{name}.safetensors"
