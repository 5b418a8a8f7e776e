"""Runners over one pipeline in two threads (L42): what they share is safe to share.

Determinism: a tiny Flux pipeline with seeded weights on the CPU; the interleaving that
broke is forced, never waited for: one thread is held inside its tokenizer's call
until the other has encoded or waits for the tokenizer (the lock's own report).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from omni_trio.runners import DiffusersRunner, _prompts
from omni_trio.runners._family import RequestState
from tests.support.core import BUDGET
from tests.support.runners import request, tiny


class _Announced:
    """A tokenizer's lock that sets ``moved`` when ``thread`` starts waiting for it."""

    def __init__(
        self, lock: Any, thread: Callable[[], threading.Thread | None], moved: threading.Event
    ) -> None:
        self._lock = lock
        self._thread = thread
        self._moved = moved

    def __enter__(self) -> None:
        if threading.current_thread() is self._thread():
            self._moved.set()
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _image(runner: DiffusersRunner, state: RequestState) -> torch.Tensor:
    for _ in range(state.request.num_steps):
        runner.step([state])
    try:
        return runner.decode(state)
    finally:
        runner.discard(state)


def test_an_encode_between_another_runners_tokenizer_calls_leaves_its_prompt_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L42: two runners over one pipeline (two workers' prepares in their own threads)
    share its tokenizers, whose padding and truncation a call sets on the tokenizer:
    the second runner encoding its prompt while the first is inside its T5 tokenizer's
    call (its padding to 512 set, its tokens not yet made) left the first prompt padded
    to its own 10 tokens, and the first request's image was not one worker's. Each
    encode holds the pipeline's tokenizers: the second waits, and both images equal
    the ones each runner makes alone."""
    pipe = tiny("flux")
    first = DiffusersRunner(pipe, prompt_cache_bytes=0)
    second = DiffusersRunner(pipe, prompt_cache_bytes=0)
    try:
        one = request("flux", prompt="a red flower", num_steps=2, seed=1)
        two = request("flux", prompt="a blue boat at dusk", num_steps=2, seed=2)
        alone = [_image(first, first.prepare(one, "a")), _image(second, second.prepare(two, "b"))]

        threads: dict[str, threading.Thread] = {}
        # Set once the second runner encoded, or waits for a tokenizer the first holds.
        held, second_moved = threading.Event(), threading.Event()
        lock = getattr(_prompts, "tokenizer_lock", None)

        def reporting(tokenizer: Any) -> _Announced:
            assert lock is not None
            return _Announced(lock(tokenizer), lambda: threads.get("second"), second_moved)

        monkeypatch.setattr(_prompts, "tokenizer_lock", reporting, raising=False)
        tokenizer = pipe.tokenizer_2
        configure = tokenizer.set_truncation_and_padding

        def paused(*args: Any, **kwargs: Any) -> None:
            configure(*args, **kwargs)
            padded = kwargs["max_length"] is not None  # not the tokenize() before it
            if padded and threading.current_thread() is threads["first"] and not held.is_set():
                held.set()  # the T5 tokenizer is set to pad to 512; hold here
                assert second_moved.wait(BUDGET)

        monkeypatch.setattr(tokenizer, "set_truncation_and_padding", paused)
        states: dict[str, RequestState] = {}
        errors: list[BaseException] = []

        def prepare(name: str, runner: DiffusersRunner, r: Any) -> None:
            try:
                states[name] = runner.prepare(r, name)
            except BaseException as exc:
                errors.append(exc)
            finally:
                if name == "second":
                    second_moved.set()

        threads["first"] = threading.Thread(target=prepare, args=("first", first, one))
        threads["first"].start()
        assert held.wait(BUDGET)
        threads["second"] = threading.Thread(target=prepare, args=("second", second, two))
        threads["second"].start()
        for thread in threads.values():
            thread.join(BUDGET)
            assert not thread.is_alive()
        assert not errors, errors
        monkeypatch.undo()
        assert states["first"].cond["encoder_hidden_states"].shape[1] == 512
        images = [_image(first, states["first"]), _image(second, states["second"])]
        assert all(torch.equal(made, own) for made, own in zip(images, alone, strict=True))
    finally:
        first.close()
        second.close()
