"""A ``DiffusersRunner``'s weights, updated in place and put to sleep (L102, L103).

Updates (``PipelineWeights.update``, then ``commit`` or ``revert``): a source is a
``.safetensors`` file or a state dict of the pipeline's models, read whole and checked
before the model is touched: every tensor names a parameter or buffer of its
component (the denoiser's when its keys carry no ``component.`` prefix; a LoRA
layer's base by its plain name) of the same shape, floating point where the model's
is, never a quantized one. Then each is copied into its tensor, in place (its storage
stays: what points at it, compiled graphs included, sees the new values), after a
copy of the old values to host memory, which ``revert`` puts back and ``commit``
forgets. A LoRA source (its keys name ``lora_A``/``lora_B`` or ``lora_down``/
``lora_up``) is not merged: it becomes the base adapter that every row of every
request runs at scale 1 (``AdapterSet.load_base``), with PEFT's own expressions, so a
trainer's unmerged forward and a rollout's are the same computation; the next LoRA
update replaces it.

Sleep (``sleep``, ``wake``): every parameter and buffer of the pipeline's models
(once each, however many names it has) is moved out of its device: level 1 copies it
to host memory (pinned on CUDA) and lets go of the device copy; level 2 drops instead
what the model's own files hold (the ``.safetensors`` of the folder its component was
loaded from, ``config._name_or_path``: same name and shape, and its first row equal
to the file's, converted to its dtype) and no update changed since, and moves the
rest as level 1 does. ``wake`` puts the same bytes back on their device (a level-2
tensor read again from its file, converted as the load converted it), refusing, and
staying asleep, when a file changed since the sleep (its size or time). The tensor
objects stay, only their data move: a module keeps its parameters, hooks and
adapters' layers. A quantized tensor (a subclass) stays on its device (``kept``).

Threads: every call takes the runner's model lock; the engine makes them only while
no request of the runner runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._adapters import AdapterError
from .._weights import SleepBytes, WeightsError, WeightSource
from ._adapters import AdapterSet, HeldAdapters

__all__ = ["PipelineWeights"]

#: What names a LoRA's tensors, in the formats diffusers reads.
_LORA_PARTS = ("lora_A", "lora_B", "lora_down", "lora_up", "lora.down", "lora.up")
#: How many names of a refused source a message lists.
_SHOWN = 3
#: A woken tensor lands at the address its data had modulo this many bytes: kernels
#: pick their paths by alignment (measured: tiny Flux loaded from its folder, whose
#: tensors sit at odd offsets, gave other pixels, ~1e-6, from fresh aligned copies).
_ALIGN = 256


def _invalid(message: str) -> WeightsError:
    return WeightsError(message, reason="invalid")


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds plain data (no quantized subclass) that can move."""
    return type(tensor.data) is torch.Tensor


def _named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _file_name(name: str) -> str:
    """A tensor's name as the model's files have it: a LoRA layer's base by its own."""
    return name.replace(".base_layer.", ".")


def _is_lora(keys: Iterator[str]) -> bool:
    return any(part in key for key in keys for part in _LORA_PARTS)


def _read(source: object) -> tuple[Mapping[str, Any], Path | None]:
    """The source's tensors (or component state dicts) by name, and its file if one."""
    if isinstance(source, Mapping):
        if not source or not all(isinstance(key, str) for key in source):
            raise _invalid("a state dict maps names to tensors (or components to state dicts)")
        return source, None
    if not isinstance(source, str | os.PathLike):
        raise _invalid(f"the source is a .safetensors file or a state dict, got {type(source)}")
    path = Path(source)
    if path.suffix != ".safetensors" or not path.is_file():
        raise _invalid(f"no .safetensors file {str(path)!r}")
    from safetensors.torch import load_file

    try:
        return load_file(str(path)), path
    except Exception as exc:
        raise _invalid(f"{path.name} is not a safetensors file ({exc})") from None


@dataclass(eq=False)
class _Dropped:
    """A tensor a level-2 sleep dropped: where its file holds it, and that file's stamp."""

    tensor: torch.Tensor
    path: Path
    key: str
    stamp: tuple[int, int]
    offset: int = 0


def _placed(values: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """``values`` as ``like``'s dtype on its device, at an address ``offset`` past an
    ``_ALIGN`` boundary (where the data it replaces was); strided ones as they come."""
    if not values.is_contiguous():
        return values.to(device=like.device, dtype=like.dtype)
    size = torch.empty((), dtype=like.dtype).element_size()
    raw = torch.empty(values.numel() * size + _ALIGN, dtype=torch.uint8, device=like.device)
    start = (offset - raw.data_ptr()) % _ALIGN
    placed = raw[start : start + values.numel() * size].view(like.dtype).view(values.shape)
    placed.copy_(values, non_blocking=like.device.type == "cuda")
    return placed


@dataclass(eq=False)
class PipelineWeights:
    """A runner's weights (see the module's docstring).

    Args:
        pipe: the pipeline.
        model_lock: the runner's lock around its model calls.
        adapters: the runner's adapters, where a LoRA update loads.
        denoiser: the component a state dict without prefixes is for.
        changed: told after every change of the weights (an update applied or reverted).
    """

    pipe: Any
    model_lock: Any
    adapters: AdapterSet
    denoiser: str
    changed: Callable[[], None]
    #: The base LoRA of a LoRA update (``AdapterSet.load_base``'s handle), or ``None``.
    lora: object | None = None
    _backup: list[tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, init=False)
    _lora_before: tuple[object | None] | None = field(default=None, init=False)
    #: The tensors an update changed (by id): the model's files no longer hold them.
    _updated: set[int] = field(default_factory=set, init=False)
    _level: int = field(default=0, init=False)
    _offloaded: list[tuple[torch.Tensor, torch.Tensor, int]] = field(
        default_factory=list, init=False
    )
    _dropped: list[_Dropped] = field(default_factory=list, init=False)

    @property
    def base_pairs(self) -> HeldAdapters:
        """The base LoRA's pair that every request's rows run; ``()`` without one."""
        return self.adapters.base_pairs(self.lora)

    @property
    def asleep(self) -> int:
        """The level it sleeps at; 0 awake."""
        return self._level

    def _modules(self) -> Iterator[tuple[str, torch.nn.Module]]:
        for name, module in sorted(self.pipe.components.items()):
            if isinstance(module, torch.nn.Module):
                yield name, module

    # -- updates -----------------------------------------------------------------

    def update(self, source: WeightSource) -> None:
        """Apply ``source``, keeping what it replaces (``WeightsRunner.update_weights``)."""
        if self._level:
            raise WeightsError("the runner sleeps: wake it first", reason="asleep")
        if self._backup is not None or self._lora_before is not None:
            raise WeightsError("an update is pending: commit or revert it", reason="failed")
        tensors, path = _read(source)
        if _is_lora(iter(tensors)):
            try:
                lora = self.adapters.load_base(source if path is None else path)
            except AdapterError as exc:
                raise _invalid(f"a LoRA update: {exc}") from None
            self._lora_before, self.lora = (self.lora,), lora
        else:
            pairs = self._targets(tensors)
            with self.model_lock, torch.no_grad():
                self._backup = []
                try:
                    for target, value in pairs:
                        self._backup.append((target, target.detach().to("cpu", copy=True)))
                        target.copy_(value.to(device=target.device, dtype=target.dtype))
                except BaseException:
                    self.revert()
                    raise
                self._updated.update(id(target) for target, _ in pairs)
        self.changed()

    def commit(self) -> None:
        """Forget what the last update replaced."""
        self._backup = None
        before, self._lora_before = self._lora_before, None
        if before is not None and before[0] is not None:
            self.adapters.remove_base(before[0])

    def revert(self) -> None:
        """Put back what the last update replaced."""
        backup, self._backup = self._backup, None
        if backup:
            with self.model_lock, torch.no_grad():
                for target, old in reversed(backup):
                    target.copy_(old.to(target.device))
        before, self._lora_before = self._lora_before, None
        if before is not None:
            lora, self.lora = self.lora, before[0]
            if lora is not None:
                self.adapters.remove_base(lora)
        self.changed()

    def _targets(self, tensors: Mapping[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each of the source's tensors with the model's tensor it replaces; ``WeightsError``
        naming what fits nothing."""
        modules = dict(self._modules())
        grouped: dict[str, dict[str, Any]] = {}
        if all(isinstance(value, Mapping) for value in tensors.values()):
            grouped = {name: dict(value) for name, value in tensors.items()}
        elif all("." in name and name.partition(".")[0] in modules for name in tensors):
            for name, value in tensors.items():
                component, _, rest = name.partition(".")
                grouped.setdefault(component, {})[rest] = value
        else:
            grouped = {self.denoiser: dict(tensors)}
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        problems: list[str] = []
        for component, state in grouped.items():
            module = modules.get(component)
            if module is None:
                raise _invalid(f"the pipeline has no model {component!r}")
            known = {_file_name(name): tensor for name, tensor in _named_tensors(module)}
            for name, value in state.items():
                target = known.get(name)
                if not isinstance(value, torch.Tensor):
                    problems.append(f"{component}.{name} is a {type(value).__name__}")
                elif target is None:
                    problems.append(f"{component}.{name} is no tensor of the model")
                elif tuple(value.shape) != tuple(target.shape):
                    problems.append(
                        f"{component}.{name} has the shape {list(value.shape)},"
                        f" the model's {list(target.shape)}"
                    )
                elif not _plain(target):
                    problems.append(f"{component}.{name} is quantized: not updated in place")
                elif value.is_floating_point() != target.is_floating_point():
                    problems.append(
                        f"{component}.{name} is {value.dtype}, the model's {target.dtype}"
                    )
                else:
                    pairs.append((target, value))
        if problems:
            more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
            raise _invalid("; ".join(problems[:_SHOWN]) + more)
        return pairs

    # -- sleep -------------------------------------------------------------------

    def sleep(self, level: int) -> SleepBytes:
        """Free the weights' device memory (``WeightsRunner.sleep_weights``)."""
        if level not in (1, 2):
            raise ValueError(f"level: 1 or 2, got {level!r}")
        with self.model_lock, torch.no_grad():
            if self._level:
                return SleepBytes()
            offloaded = dropped = kept = 0
            seen: set[int] = set()
            for _, module in self._modules():
                files = _FileIndex.of(module) if level == 2 else None
                for name, tensor in _named_tensors(module):
                    if id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                    size = tensor.nbytes
                    if not _plain(tensor):
                        kept += size
                        continue
                    where = None
                    if files is not None and id(tensor) not in self._updated:
                        where = files.holding(_file_name(name), tensor)
                    offset = tensor.data_ptr() % _ALIGN
                    if where is not None:
                        self._dropped.append(_Dropped(tensor, *where, offset))
                        dropped += size
                    else:
                        self._offloaded.append((tensor, _host_copy(tensor), offset))
                        offloaded += size
                    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            self._level = level
        return SleepBytes(offloaded=offloaded, dropped=dropped, kept=kept)

    def wake(self) -> None:
        """Bring every tensor back, bit for bit (``WeightsRunner.wake_weights``)."""
        with self.model_lock, torch.no_grad():
            if not self._level:
                return
            for item in self._dropped:
                if _stamp(item.path) != item.stamp:
                    raise WeightsError(
                        f"{item.path} changed or went away while the runner slept: the"
                        " weights it held cannot be read again",
                        reason="failed",
                    )
            for tensor, host, offset in self._offloaded:
                tensor.data = _placed(host, tensor, offset)
            readers = _Readers()
            for item in self._dropped:
                value = readers.of(item.path).get_tensor(item.key)
                item.tensor.data = _placed(value, item.tensor, item.offset)
            if any(tensor.device.type == "cuda" for tensor, _, _ in self._offloaded):
                torch.cuda.synchronize()  # the pinned copies stay alive until here
            self._offloaded.clear()
            self._dropped.clear()
            self._level = 0

    def close(self) -> None:
        """The runner closes: an update pending is kept, a LoRA update's adapter leaves
        the model, a sleep ends (the pipeline is its owner's again, whole)."""
        self.commit()
        lora, self.lora = self.lora, None
        if lora is not None:
            self.adapters.remove_base(lora)
        self.wake()


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in host memory: pinned, from a CUDA device."""
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor.detach())
        return host
    return tensor.detach().to("cpu", copy=True)


def _stamp(path: Path) -> tuple[int, int]:
    """A file's size and modification time (ns); ``(-1, -1)`` when it is gone."""
    try:
        status = path.stat()
    except OSError:
        return (-1, -1)
    return (status.st_size, status.st_mtime_ns)


class _Readers:
    """Each file's safetensors reader, opened once (its header read once)."""

    def __init__(self) -> None:
        self._open: dict[Path, Any] = {}

    def of(self, path: Path) -> Any:
        reader = self._open.get(path)
        if reader is None:
            from safetensors import safe_open

            reader = self._open[path] = safe_open(str(path), "pt")
        return reader


@dataclass
class _FileIndex:
    """The ``.safetensors`` files of the folder a model was loaded from: each key's file."""

    keys: dict[str, Path]
    readers: _Readers

    @classmethod
    def of(cls, module: torch.nn.Module) -> _FileIndex | None:
        config = getattr(module, "config", None)
        folder = getattr(config, "_name_or_path", None)
        if not isinstance(folder, str) or not folder or not Path(folder).is_dir():
            return None
        readers = _Readers()
        keys: dict[str, Path] = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            try:
                names = readers.of(path).keys()
            except Exception:  # a file it cannot read holds nothing it drops
                continue
            for key in names:
                keys.setdefault(key, path)
        return cls(keys, readers)

    def holding(self, key: str, tensor: torch.Tensor) -> tuple[Path, str, tuple[int, int]] | None:
        """Where ``tensor`` can be read again from: its file, its key there and the file's
        stamp; ``None`` when no file holds it (by name, shape and first row)."""
        path = self.keys.get(key)
        if path is None:
            return None
        reader = self.readers.of(path)
        part = reader.get_slice(key)
        if tuple(part.get_shape()) != tuple(tensor.shape):
            return None
        first = reader.get_tensor(key) if tensor.dim() == 0 else part[0:1]
        mine = tensor.detach() if tensor.dim() == 0 else tensor.detach()[0:1]
        if not torch.equal(first.to(device=mine.device, dtype=mine.dtype), mine):
            return None
        return path, key, _stamp(path)
