"""Loading a saved folder: every tiny family, saved by ``save_pretrained``, loads back.

- the loaded pipeline's generation through ``DiffusersRunner`` equals the in-memory
  pipeline's, bitwise, with accelerate and without it (where the family can load
  without it), and the load prints nothing and opens no connection;
- the in-memory tokenizers save and load to the same tokens;
- a family that needs accelerate says so in one line when it is missing.

Determinism: tiny pipelines with seeded weights, built once (``tiny``); torch uses
one thread; the engine runs one request at a time. "Without accelerate" is what the
loader sees (``diffusers.utils.is_accelerate_available``); it then asks diffusers
for ``low_cpu_mem_usage=False``, the load diffusers itself does without accelerate.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import anyio
import diffusers
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner
from omni_trio.runners._load import load_pipeline
from tests.support.core import BUDGET
from tests.support.runners import KINDS, assert_loaded_output_matches, request, tiny

UNTYPED: Any = diffusers  # its utils re-export names mypy --strict does not see

#: The families whose models diffusers loads only through accelerate (Wan's
#: transformer keeps modules in float32).
NEEDS_ACCELERATE = frozenset({"wan"})

#: The kinds whose pipelines have tokenizers (all but the unconditional UNet).
TOKENIZED = tuple(kind for kind in KINDS if kind != "unet")


async def generated(pipeline: Any, kind: str) -> torch.Tensor:
    """A 2-step request of ``kind`` through ``DiffusersRunner``: its frames or images."""
    r = request(kind, num_steps=2)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(pipeline)) as engine:
            output = await engine.generate(r)
    return output.images if output.video is None else output.video


def saved(kind: str, folder: Path) -> Path:
    """The tiny pipeline of ``kind``, saved in ``folder``."""
    tiny(kind).save_pretrained(folder)
    return folder


def without_accelerate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the loader see no accelerate."""
    monkeypatch.setattr(diffusers.utils, "is_accelerate_available", lambda: False)


def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse every outgoing connection."""

    def refuse(self: socket.socket, address: object) -> None:
        raise AssertionError(f"the load connected to {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.mark.anyio
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    ("kind", "accelerate"),
    [(kind, True) for kind in KINDS]
    + [(kind, False) for kind in KINDS if kind not in NEEDS_ACCELERATE],
)
async def test_a_saved_folder_loads_quietly_to_the_same_output(
    kind: str,
    accelerate: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Loaded offline, without a word on stdout or stderr, it generates what it did (to float
    rounding: ``assert_loaded_output_matches``)."""
    if accelerate:
        assert UNTYPED.utils.is_accelerate_available(), "accelerate is a dependency"
    else:
        without_accelerate(monkeypatch)
    folder = saved(kind, tmp_path)
    capfd.readouterr()  # what saving printed
    with monkeypatch.context() as patch:
        offline(patch)
        loaded = load_pipeline(folder)
    assert capfd.readouterr() == ("", "")
    assert type(loaded) is type(tiny(kind))
    assert_loaded_output_matches(await generated(loaded, kind), await generated(tiny(kind), kind))


@pytest.mark.parametrize("kind", sorted(NEEDS_ACCELERATE))
def test_without_accelerate_the_error_names_the_fix(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A family that loads only through accelerate says so in one line, naming the fix."""
    without_accelerate(monkeypatch)
    folder = saved(kind, tmp_path)
    with pytest.raises(ImportError) as info:
        load_pipeline(folder)
    message = str(info.value)
    assert message.endswith(": pip install accelerate")
    assert message.startswith(f"{type(tiny(kind)).__name__} needs accelerate")
    assert "\n" not in message
    assert info.value.name == "accelerate"


@pytest.mark.parametrize("kind", TOKENIZED)
def test_the_tokenizers_save_and_load_to_the_same_tokens(kind: str, tmp_path: Path) -> None:
    """Each tokenizer built in memory loads back from the folder: same class, same tokens."""
    built = tiny(kind)
    loaded = load_pipeline(saved(kind, tmp_path))
    names = [name for name, value in built.components.items() if "tokenizer" in name and value]
    assert names
    prompts = ["a red flower", "Ünïcode, punctuation; DIGITS 0123!", "x" * 600]
    for name in names:
        before, after = built.components[name], loaded.components[name]
        assert type(after) is type(before), name
        assert after.model_max_length == before.model_max_length, name
        assert after.all_special_tokens == before.all_special_tokens, name
        # As the pipelines call them: padded and cut to a length.
        options = {"padding": "max_length", "max_length": 64, "truncation": True}
        for prompt in prompts:
            assert after(prompt, **options).input_ids == before(prompt, **options).input_ids
