"""One runner per device (L42): the devices a machine has, and a runner built on each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["for_devices", "visible_devices"]

R = TypeVar("R")


def visible_devices() -> list[str]:
    """Every CUDA device torch can see (``cuda:0``, ``cuda:1``, ...), else ``["cpu"]``."""
    import torch

    if torch.cuda.is_available():
        return [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    return ["cpu"]


def parse_devices(devices: Sequence[str] | str) -> list[str]:
    """The device names ``devices`` stands for, checked.

    Args:
        devices: ``"auto"`` (``visible_devices()``), a comma-separated list, or a
            sequence of torch device names. ``cpu`` may repeat (several CPU
            workers); an accelerator may not (two workers on one device would
            share its memory and its queue of kernels, and gain nothing).

    Raises:
        ValueError: no device, a name torch does not parse, or an accelerator
            named twice; the message says which.
    """
    import torch

    if isinstance(devices, str):
        names = visible_devices() if devices == "auto" else devices.split(",")
    else:
        names = list(devices)
    names = [name.strip() for name in names]
    if not names or not all(names):
        raise ValueError("devices: give at least one device, e.g. cuda:0,cuda:1 or cpu")
    seen: set[str] = set()
    for name in names:
        try:
            device = torch.device(name)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"devices: {name!r} is not a torch device ({exc})") from None
        if device.type != "cpu":
            if str(device) in seen:
                raise ValueError(f"devices: {name} is named twice")
            seen.add(str(device))
    return names


def for_devices(make: Callable[[str], R], devices: Sequence[str] | str = "auto") -> list[R]:
    """Build one runner per device: ``make(device)`` for each, in order.

    Typically ``make`` loads the same pipeline onto the device it is given and wraps
    it: ``for_devices(lambda d: DiffusersRunner(load(d)))``. Pass the list to
    ``open_engine``: each runner gets its own worker, all share one queue.

    Args:
        make: builds a runner on the device it is given (a torch device name).
        devices: see ``parse_devices``; ``"auto"``: every visible GPU, else the CPU.

    Raises:
        ValueError: ``devices`` is wrong (see ``parse_devices``).
    """
    return [make(name) for name in parse_devices(devices)]
