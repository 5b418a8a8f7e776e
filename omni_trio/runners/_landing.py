"""Where each tensor of an adapter lands: the census a load is checked against (L85).

diffusers' ``load_lora_weights`` reads a LoRA in several formats (PEFT's
``lora_A``/``lora_B``, its own older ``lora.down``/``lora.up``, kohya's
``lora_down``/``lora_up``, other trainers') and brings each to PEFT's keys in two
stages: the pipeline's ``lora_state_dict`` (other trainers' names to diffusers',
``alpha`` entries to scales), then each component's loader (the older diffusers
names to PEFT's). At every stage a tensor can be dropped with no error, at most a
log line: one for a component the pipeline lacks, one for a layer the model lacks
(PEFT's "unexpected keys"), two that one rename gives one name, a DoRA scale, what
a conversion does not know. The adapter would then be loaded in part.

``census`` runs both stages on the source's tensors with diffusers' own functions,
before anything is loaded, and refuses (``Unlanded``, naming the tensor) a tensor
for no LoRA-loadable component, one that is no LoRA weight, one for a layer the
component does not have or whose shape the layer does not take, two for one weight,
DoRA, and a conversion that loses tensors; it returns each tensor's parameter.
After the load ``check_landed`` compares that with the parameters the load made:
every tensor's exists, and none of the adapter's came from no tensor (PEFT
initialises those itself: half a LoRA pair).

A limit: a conversion that splits a fused tensor in several (kohya's Flux ``qkv``)
makes more tensors than the file has; there the check that it lost none is one of
counts, which a split can hide.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from .._adapters import AdapterError

__all__ = ["Target", "Unlanded", "adapter_source", "census", "check_landed", "source_tensors"]


class Unlanded(ValueError):
    """A tensor of an adapter lands on no layer of the model; the message names it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """The parameter one tensor of an adapter loads into.

    Args:
        component: the pipeline's component (``unet``, ``transformer``, ``text_encoder``...).
        module: the LoRA layer's path in the component.
        kind: the LoRA part (``lora_A``, ``lora_B``...).
        rest: the part's parameter (``weight``, ``bias``), or ``""``.
    """

    component: str
    module: str
    kind: str
    rest: str

    def parameter(self, adapter: str) -> str:
        """The parameter's name in the component once PEFT loaded it as ``adapter``."""
        name = f"{self.module}.{self.kind}" if self.module else self.kind
        return f"{name}.{adapter}.{self.rest}" if self.rest else f"{name}.{adapter}"


def census(pipe: Any, components: Sequence[str], tensors: Mapping[str, Any]) -> dict[str, Target]:
    """Each tensor of ``tensors`` (an adapter's source) by the name diffusers gives it,
    and its target; nothing is loaded.

    Raises:
        Unlanded: a tensor would land on no layer (see the module doc).
        Exception: diffusers cannot read the format (its own error).
    """
    dora = next((key for key in tensors if "dora_scale" in key or "magnitude_vector" in key), None)
    if dora is not None:
        raise Unlanded(f"DoRA and other LoRA variants are not applied per row ({dora!r})")
    converted = _converted(pipe, tensors)
    _check_nothing_lost(tensors, converted)
    parts: dict[str, dict[str, Any]] = {}
    for key, value in converted.items():
        component, _, rest = key.partition(".")
        if component not in components or not rest:
            raise Unlanded(
                f"its tensor {key!r} is for no part of this model that takes a LoRA"
                f" ({', '.join(components)})"
            )
        parts.setdefault(component, {})[rest] = value
    landing: dict[str, Target] = {}
    seen: dict[tuple[str, str], str] = {}
    for component, part in parts.items():
        model = getattr(pipe, component)
        for rest, key, value in _peft_keys(component, model, part):
            name = f"{component}.{rest}"
            target = _target(component, key)
            if target is None:
                raise Unlanded(f"its tensor {name!r} is not a LoRA weight")
            _check_layer(model, name, target, value)
            slot = (component, target.parameter("_"))
            if slot in seen:
                raise Unlanded(f"its tensors {seen[slot]!r} and {name!r} load into one weight")
            seen[slot] = name
            landing[name] = target
    if not landing:
        raise Unlanded("it has no LoRA tensor")
    return landing


def check_landed(
    pipe: Any, components: Sequence[str], landing: Mapping[str, Target], adapter: str
) -> None:
    """After the load as ``adapter``: every tensor's parameter exists, and every
    parameter of ``adapter`` is some tensor's.

    Raises:
        Unlanded: naming a tensor that landed nowhere, or a layer that got half a pair.
    """
    expected = {(t.component, t.parameter(adapter)): key for key, t in landing.items()}
    made: set[tuple[str, str]] = set()
    for component in components:
        for name, _ in getattr(pipe, component).named_parameters():
            if adapter in name.split("."):
                made.add((component, name))
    for slot, key in expected.items():
        if slot not in made:
            raise Unlanded(f"its tensor {key!r} landed on no layer (diffusers skipped it)")
    extra = sorted(made - expected.keys())
    if extra:
        component, name = extra[0]
        layer, kind = name.split(f".{adapter}")[0].rsplit(".", 1)
        raise Unlanded(f"the layer {component}.{layer} got no {kind} from it (half a LoRA pair)")


def _converted(pipe: Any, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The pipeline's own conversion (``lora_state_dict``, as ``load_lora_weights``
    calls it) of a copy of ``tensors``: the tensors by diffusers' names (the ``alpha``
    scales it takes out aside).

    Copies: some conversions scale tensors in place.
    """
    from diffusers.loaders.lora_pipeline import StableDiffusionXLLoraLoaderMixin

    options: dict[str, Any] = {}

    if isinstance(pipe, StableDiffusionXLLoraLoaderMixin):
        # As its ``load_lora_weights`` passes it.
        options["unet_config"] = cast("Any", pipe).unet.config
    copy = {key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in tensors.items()}
    result = type(pipe).lora_state_dict(copy, **options)
    # A dict, or a tuple whose first item is the dict (the alphas, metadata follow).
    return dict(result if isinstance(result, dict) else result[0])


def _is_alpha(key: str) -> bool:
    return key.rsplit(".", 1)[-1] == "alpha"


def _check_nothing_lost(tensors: Mapping[str, Any], converted: Mapping[str, Any]) -> None:
    """The conversion kept a tensor for each of the source's (``alpha`` scales aside)."""
    own = [key for key in tensors if not _is_alpha(key)]
    if len(converted) >= len(own):
        return
    lost = next((key for key in own if key not in converted), None)
    which = f" (such as {lost!r})" if lost is not None and own[0] in converted else ""
    raise Unlanded(
        f"diffusers' conversion of its format keeps {len(converted)} of its {len(own)}"
        f" tensors{which}: the others would land on no layer"
    )


def _peft_keys(component: str, model: Any, part: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """``part``'s keys renamed to PEFT's as the component's loader renames them:
    ``(key, PEFT key, tensor)`` each, in order.

    Raises:
        Unlanded: two keys got one name.
    """
    from diffusers.utils import state_dict_utils as rename

    renamed: dict[str, Any]
    if component.startswith("text_encoder"):
        # diffusers' ``_load_lora_into_text_encoder``.
        renamed = rename.convert_state_dict_to_peft(  # type: ignore[no-untyped-call]
            rename.convert_state_dict_to_diffusers(dict(part))  # type: ignore[no-untyped-call]
        )
        if not hasattr(model, "text_model"):
            renamed = {key.removeprefix("text_model."): v for key, v in renamed.items()}
    elif "lora_A" in next(iter(part)):
        renamed = dict(part)  # a denoiser's ``load_lora_adapter``: PEFT keys as they are
    else:
        renamed = rename.convert_unet_state_dict_to_peft(dict(part))  # type: ignore[no-untyped-call]
    if len(renamed) != len(part):
        raise Unlanded(f"two of its {component} tensors get one name in diffusers' renaming")
    return [(key, new, value) for key, (new, value) in zip(part, renamed.items(), strict=True)]


def _target(component: str, key: str) -> Target | None:
    """Where PEFT puts the tensor of ``key`` (a PEFT key); ``None``: not a LoRA part."""
    segments = key.split(".")
    for index, segment in enumerate(segments):
        if segment.startswith("lora_"):
            return Target(
                component=component,
                module=".".join(segments[:index]),
                kind=segment,
                rest=".".join(segments[index + 1 :]),
            )
    return None


def _check_layer(model: torch.nn.Module, name: str, target: Target, value: Any) -> None:
    """The component has the tensor's layer, and the layer takes the tensor's shape."""
    try:
        layer = model.get_submodule(target.module)
    except AttributeError:
        raise Unlanded(
            f"its tensor {name!r} is for a layer this model does not have"
            f" ({target.component}.{target.module})"
        ) from None
    shape = tuple(getattr(value, "shape", ()))
    if target.rest != "weight" or len(shape) < 2:
        return
    sizes = {
        "lora_A": (1, getattr(layer, "in_features", getattr(layer, "in_channels", None))),
        "lora_B": (0, getattr(layer, "out_features", getattr(layer, "out_channels", None))),
    }
    axis, size = sizes.get(target.kind, (0, None))
    if isinstance(size, int) and shape[axis] != size:
        raise Unlanded(
            f"its tensor {name!r} has the shape {list(shape)}, which the layer"
            f" {target.component}.{target.module} ({type(layer).__name__}) does not take"
        )


def adapter_source(
    name: str, source: str | os.PathLike[str] | Mapping[str, Any]
) -> tuple[Path | None, Mapping[str, Any] | None]:
    """A load's file (resolved, a ``.safetensors`` that exists) or state dict.

    Raises:
        AdapterError: neither (``invalid``), naming adapter ``name``.
    """
    if isinstance(source, Mapping):
        if not source or not all(isinstance(key, str) for key in source):
            raise AdapterError(
                f"adapter {name!r}: a state dict maps tensor names to tensors",
                reason="invalid",
                name=name,
            )
        return None, source
    if not isinstance(source, str | os.PathLike):
        raise AdapterError(
            f"adapter {name!r}: the source is a path or a state dict, got {type(source).__name__}",
            reason="invalid",
            name=name,
        )
    try:
        path = Path(source).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop: RuntimeError before 3.13
        raise AdapterError(
            f"adapter {name!r}: its path cannot be resolved ({exc})", reason="invalid", name=name
        ) from None
    if path.suffix != ".safetensors":
        raise AdapterError(
            f"adapter {name!r}: only .safetensors files are read, got {path.name!r}",
            reason="invalid",
            name=name,
        )
    if not path.is_file():
        raise AdapterError(f"adapter {name!r}: no file {path}", reason="invalid", name=name)
    return path, None


def source_tensors(
    name: str, path: Path | None, state_dict: Mapping[str, Any] | None
) -> Mapping[str, Any]:
    """The source's tensors by name: the file's at ``path`` (read here), or ``state_dict``.

    Raises:
        AdapterError: the file is not safetensors (``invalid``), naming adapter ``name``.
    """
    if state_dict is not None:
        return state_dict
    assert path is not None
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:
        raise AdapterError(
            f"adapter {name!r}: not a safetensors file ({exc})",
            reason="invalid",
            name=name,
        ) from exc
