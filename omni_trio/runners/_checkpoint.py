"""Checkpoints of a ``DiffusersRunner`` state (L78): what is saved, and how it comes back.

A state is rebuilt by ``prepare`` (the prompt's encoding, the batch-shared inputs
and the initial noise are functions of the request) and then given what the steps
changed: the latents, the scheduler's own state (its step index, sigmas, a
multistep solver's previous outputs: every attribute but its config), the random
generator's state and the step position, and a sampled request's trajectory so far
(L100). That is the suspended state of L61, less what ``prepare`` makes again. The copy
(``state_copy``) runs in the worker thread at a step boundary and clones tensors on
their device; the materializer moves them to the host and serializes them
(``copy_bytes``), with ``torch.save``; ``restore_into`` reads them back with
``weights_only=True``, so a checkpoint holds data only.

A request with a step cache (L80) is not checkpointed: its residuals and forecasts
would have to be saved too (``state_copy`` refuses, the engine logs it once).
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any

import torch

from .._checkpoint import CheckpointError, pack_checkpoint, unpack_checkpoint
from .._request import GenerationRequest
from ._family import RequestState
from ._quantize import layout, storage_tensors

__all__ = ["StateCopy", "copy_bytes", "model_key", "restore_into", "state_copy"]

#: Scheduler attributes that ``prepare`` makes again and a checkpoint does not hold.
_SCHEDULER_SKIPPED = frozenset({"_internal_dict", "config"})


@dataclass(frozen=True, slots=True)
class StateCopy:
    """What ``state_copy`` took at a boundary: tensors on their device, plain values."""

    request: GenerationRequest
    step: int
    values: dict[str, Any]


def _copied(value: Any, where: str) -> Any:
    """``value`` with its tensors cloned, if it is made of tensors and plain data only.

    Raises:
        ValueError: ``value`` holds something else (an object a checkpoint cannot keep).
    """
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_copied(item, where) for item in value]
    raise ValueError(f"{where} holds a {type(value).__name__}, which a checkpoint cannot keep")


def state_copy(state: RequestState) -> StateCopy:
    """A copy of what the next step of ``state`` needs (worker thread, at a boundary).

    Raises:
        ValueError: the state holds what a checkpoint cannot keep (a step cache, a
            scheduler's object).
    """
    if state.cache is not None:
        raise ValueError("a request with a step cache is not checkpointed")
    if state.latents is None or state.parked_from is not None:
        raise ValueError("the state is discarded or suspended")
    scheduler = {
        name: _copied(value, f"the scheduler's {name}")
        for name, value in vars(state.scheduler).items()
        if name not in _SCHEDULER_SKIPPED
    }
    values = {
        "latents": state.latents.detach().clone(),
        "scheduler": scheduler,
        "generator": state.generator.get_state(),
        "position": state.position,
        "steps_done": state.steps_done,
    }
    if state.sampler is not None and state.sampler.returns:
        values["sampler"] = {
            name: _copied(items, "the sampler's record")
            for name, items in state.sampler.record.items()
        }
    return StateCopy(state.request, state.steps_done, values)


def _on_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {name: _on_host(item) for name, item in value.items()}
    if isinstance(value, list):
        return [_on_host(item) for item in value]
    return value


def copy_bytes(copy: StateCopy, model: str) -> bytes:
    """The copy as a checkpoint's bytes (materializer thread): to the host, serialized."""
    data = io.BytesIO()
    torch.save(_on_host(copy.values), data)
    return pack_checkpoint(data.getvalue(), model=model, request=copy.request, step=copy.step)


def _to_device(value: Any, like: Any) -> Any:
    """``value`` (from a checkpoint) on the device and dtype of ``like`` where it is a tensor."""
    if isinstance(value, torch.Tensor) and isinstance(like, torch.Tensor):
        return value.to(device=like.device, dtype=like.dtype)
    if isinstance(value, list) and isinstance(like, list | tuple):
        rebuilt = [_to_device(v, w) for v, w in zip(value, like, strict=False)]
        rebuilt += value[len(rebuilt) :]
        return type(like)(rebuilt) if isinstance(like, tuple) else rebuilt
    return value


def restore_into(state: RequestState, data: bytes, model: str) -> int:
    """Give a freshly prepared ``state`` what the checkpoint ``data`` holds; return its step.

    Raises:
        CheckpointError: ``data`` is not a checkpoint of this model and request, or
            does not fit the prepared state (its latents' shape, its step).
    """
    payload, step = unpack_checkpoint(data, model=model, request=state.request)
    try:
        values = torch.load(io.BytesIO(payload), weights_only=True)
        latents = values["latents"]
        scheduler = values["scheduler"]
        generator = values["generator"]
        position, steps_done = int(values["position"]), int(values["steps_done"])
    except Exception as exc:
        raise CheckpointError(f"its payload does not load ({type(exc).__name__})") from None
    assert state.latents is not None
    if (
        not isinstance(latents, torch.Tensor)
        or latents.shape != state.latents.shape
        or not isinstance(scheduler, dict)
        or steps_done != step
        or not 0 <= step < len(state.groups)
    ):
        raise CheckpointError("its latents or its step do not fit the request")
    try:
        state.generator.set_state(generator)
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(f"its generator state does not fit ({exc})") from None
    own = vars(state.scheduler)
    for name, value in scheduler.items():
        own[name] = _to_device(value, own.get(name))
    if state.sampler is not None and state.sampler.returns:
        try:
            state.sampler.restore(values["sampler"], state.latents.device)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"its trajectory does not fit ({exc})") from None
    state.latents = latents.to(device=state.latents.device, dtype=state.latents.dtype)
    state.position, state.steps_done = position, steps_done
    return step


def _config_text(config: Any) -> str:
    """A component's config as text: diffusers' (a mapping) or transformers' (``to_dict``)."""
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        config = to_dict()
    elif callable(getattr(config, "items", None)):
        config = dict(config.items())
    if isinstance(config, dict):
        # Private entries are bookkeeping (``_use_default_values`` is a set's order).
        config = {key: value for key, value in config.items() if not str(key).startswith("_")}
    # An object in a config is named by its type: its repr may hold its address.
    return json.dumps(config, sort_keys=True, default=lambda value: type(value).__name__)


def model_key(family: str, pipeline: Any) -> str:
    """What names a model in its checkpoints: its family, its class and its weights.

    A digest of each component's config and of the first and last values of every
    parameter tensor (a quantized one's layout and the tensors that hold it): two
    models of one config with other weights, or other quantizations, differ, and it
    costs one pass over the parameters' metadata, once per runner.
    """
    digest = hashlib.sha256(f"{family}:{type(pipeline).__name__}".encode())
    for name, component in sorted(getattr(pipeline, "components", {}).items()):
        config = getattr(component, "config", None)
        if config is not None:
            digest.update(name.encode())
            digest.update(_config_text(config).encode())
        parameters = getattr(component, "parameters", None)
        if callable(parameters):
            with torch.no_grad():
                # A quantized weight by its layout and the tensors that hold it (``_quantize``).
                for tensor in parameters():
                    digest.update(layout(tensor).encode())
                    for part in storage_tensors(tensor.detach()):
                        flat = part.reshape(-1)
                        if flat.numel():
                            ends = torch.stack([flat[0], flat[-1]]).float().cpu()
                            digest.update(ends.numpy().tobytes())
    return f"{family}:{type(pipeline).__name__}:{digest.hexdigest()[:16]}"
