"""Sequence parallel through diffusers' own context parallelism, and what it needs on a CPU.

Every rank calls ``enable_parallelism(config=ContextParallelConfig(...))`` on its
denoisers (its family's, Wan 2.2's two experts both; a family whose split is known
wrong, LTX-Video, is refused: ``omni_trio.runners.context_parallel_denoisers``):
diffusers then splits the token sequence
at the model's entry (its ``_cp_plan``), exchanges tokens inside each attention
(Ulysses: an all-to-all of heads; ring: the keys and values go round) and gathers
the output, so every rank gets the whole noise prediction. Measured with
diffusers 0.42.1 and torch 2.13 (CPU), it needs, on gloo:

- a device count: ``enable_parallelism`` places rank ``r`` on device
  ``r % torch.accelerator.device_count()``, which is 0 with torch's CPU build
  (``ZeroDivisionError``); it is made 1 while the models are set up;
- for ring attention, the log-sum-exp of each partial attention: diffusers'
  native backend, the only one with CPU kernels that takes context parallelism,
  refuses ``return_lse=True``. ``_native_attention_forward_op``, the function it
  hands ring attention, is wrapped (process-wide, while a ring runner is open):
  the wrapper computes the attention and its log-sum-exp with torch's CPU flash
  kernel (``aten._scaled_dot_product_flash_attention_for_cpu``) when asked for
  both, and calls the original otherwise, so every other caller is unchanged;
- token counts that divide by the degree (the runner's size rule makes the image
  tokens divide; Qwen-Image's text is padded, masked, to a multiple);
- torch deprecated the gather diffusers calls at every forward
  (``all_gather_tensor``): that one warning, from that one module, is ignored.

The output of a gather may be an ``AsyncCollectiveTensor``; it is waited for
before the scheduler uses it.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from ..runners import context_parallel_denoisers

__all__ = [
    "ContextKind",
    "ContextSwitch",
    "enable_context_parallel",
    "ignore_gather_deprecation",
    "ring_attention",
    "waited",
]

ContextKind = Literal["ulysses", "ring"]


@contextmanager
def _one_accelerator() -> Iterator[None]:
    """Make ``torch.accelerator.device_count()`` 1 inside the block where it is 0 (CPU torch)."""
    accelerator: Any = torch.accelerator
    original = accelerator.device_count
    if original() > 0:
        yield
        return
    accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        accelerator.device_count = original


def enable_context_parallel(pipeline: Any, kind: ContextKind, degree: int) -> None:
    """Turn on ``kind`` context parallelism of ``degree`` on every denoiser of ``pipeline``.

    Every rank calls it, in the same order (it makes the mesh's groups).
    """
    from diffusers import ContextParallelConfig

    make: Any = ContextParallelConfig
    degrees = {"ulysses_degree": degree} if kind == "ulysses" else {"ring_degree": degree}
    for model in context_parallel_denoisers(pipeline, kind):
        config = make(**degrees)  # one per model: each builds its own mesh
        denoiser: Any = model
        with _one_accelerator():
            denoiser.enable_parallelism(config=config)


class ContextSwitch:
    """Context parallelism on a pipeline's denoisers, turned off for a call and on again.

    A layout that splits by load (``by_load``) runs some calls over rows, each rank
    a slice of them whole, where the sequence split must not act. Off: the split
    and gather hooks ``enable_parallelism`` registered are removed and the
    attention processors forget the parallel config, so a call runs as on one
    device; on: both come back (the device mesh, made once, is kept). The switch
    acts only when the way changes, so a run of calls one way costs nothing.
    """

    def __init__(self, pipeline: Any) -> None:
        self._models: list[Any] = list(context_parallel_denoisers(pipeline))
        self._processors = [
            [
                module.processor
                for module in model.modules()
                if getattr(getattr(module, "processor", None), "_parallel_config", None) is not None
            ]
            for model in self._models
        ]
        self.on = True

    def set(self, on: bool) -> None:
        """Turn context parallelism ``on`` or off on every denoiser (no-op if it is)."""
        if on == self.on:
            return
        from diffusers.hooks.context_parallel import (
            apply_context_parallel,
            remove_context_parallel,
        )

        for model, processors in zip(self._models, self._processors, strict=True):
            config = model._parallel_config
            if on:
                apply_context_parallel(model, config.context_parallel_config, model._cp_plan)
            else:
                remove_context_parallel(model, model._cp_plan)
            for processor in processors:
                processor._parallel_config = config if on else None
        self.on = on


def waited(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, its collective waited for if it is an ``AsyncCollectiveTensor``."""
    wait: Callable[[], torch.Tensor] | None = getattr(tensor, "wait", None)
    return wait() if callable(wait) else tensor


def ignore_gather_deprecation() -> None:
    """Ignore torch's deprecation of the gather diffusers' context parallelism calls.

    Called before each parallel forward: a test runner that resets the warning
    filters between tests (pytest) would otherwise turn it into an error.
    """
    warnings.filterwarnings(
        "ignore",
        message=r".*all_gather_tensor` is deprecated",
        category=FutureWarning,
        module=r"diffusers\.(hooks\.context_parallel|models\.attention_dispatch)",
    )


class _Ring:
    """The ring-attention wrapper, installed while any ring runner of this process is open."""

    lock = threading.Lock()
    users = 0
    original: Any = None


def _forward_op_with_lse(original: Any) -> Any:
    def forward_op(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        _save_ctx: bool = True,
        _parallel_config: Any = None,
    ) -> Any:
        if not return_lse or query.device.type != "cpu":
            return original(
                ctx,
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                enable_gqa,
                return_lse,
                _save_ctx,
                _parallel_config,
            )
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        # diffusers' layout: out [B, S, H, D], lse [B, S, H].
        return out.permute(0, 2, 1, 3), lse.permute(0, 2, 1)

    return forward_op


@contextmanager
def ring_attention() -> Iterator[None]:
    """Keep the log-sum-exp wrapper installed for the block (counted: blocks may overlap)."""
    from diffusers.models import attention_dispatch

    with _Ring.lock:
        if _Ring.users == 0:
            _Ring.original = attention_dispatch._native_attention_forward_op
            attention_dispatch._native_attention_forward_op = _forward_op_with_lse(_Ring.original)
        _Ring.users += 1
    try:
        yield
    finally:
        with _Ring.lock:
            _Ring.users -= 1
            if _Ring.users == 0:
                attention_dispatch._native_attention_forward_op = _Ring.original
                _Ring.original = None
