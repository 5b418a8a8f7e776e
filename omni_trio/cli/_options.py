"""What ``serve`` and ``serve --ray`` share: the model the options name, and its errors.

The serve package says what is wrong with a model (a ``ValueError`` for a spec that
names none, a ``ModelError`` for one that does not load) without naming an option;
here those become the command's errors, named by the option that set the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..serve._models import MODELS, LoadedModel, ModelError, load_model, model_folder
from ._errors import CommandError, UsageError, summary

__all__ = ["check_model", "load"]


def check_model(spec: str) -> None:
    """Check that ``spec`` names a model (built in, or a diffusers folder); nothing loads.

    Raises:
        UsageError: it names none; the message names ``--model``.
    """
    if spec in MODELS:
        return
    try:
        model_folder(spec)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None


def load(
    spec: str,
    *,
    step_seconds: float,
    max_steps: int = 200,
    devices: Sequence[str] | None = None,
    runner_options: Mapping[str, Any] | None = None,
) -> LoadedModel:
    """``load_model`` with its errors as the command's (see ``load_model`` for the arguments).

    Raises:
        UsageError: ``spec`` names no model.
        CommandError: the model does not load, or not on a device.
    """
    check_model(spec)
    try:
        return load_model(
            spec,
            step_seconds=step_seconds,
            max_steps=max_steps,
            devices=devices,
            runner_options=runner_options,
        )
    except ModelError as exc:
        reason = "" if exc.__cause__ is None else f": {summary(exc.__cause__)}"
        raise CommandError(f"--model: {exc}{reason}") from exc
