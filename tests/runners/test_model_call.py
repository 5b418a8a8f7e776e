"""The model call's room: one registry of module hooks (``runners._hooks``) and the call's
context (``runners._forward``) that the per-row features read.

No engine, no threads of the engine: plain torch modules and plain calls.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from omni_trio.runners import ModelCall, rows_slice, token_split
from omni_trio.runners._forward import calling, current
from omni_trio.runners._hooks import ModuleHooks, has_hook


class Scale(torch.nn.Module):
    """x * factor: what a wrapper sees and changes is plain."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def adding(amount: float, seen: list[str], name: str) -> Callable[..., Any]:
    def wrapper(module: torch.nn.Module, proceed: Callable[..., Any], x: torch.Tensor) -> Any:
        seen.append(name)
        return proceed(x) + amount

    return wrapper


def test_a_modules_wrappers_run_in_the_order_of_their_kinds_whoever_installed_first() -> None:
    """The step cache's wrapper is outside the adapters' on one module, whichever was
    installed first; the module's own forward is innermost; a pre-hook runs before all."""
    for first, second in (("step-cache", "adapters"), ("adapters", "step-cache")):
        module = Scale(2.0)
        seen: list[str] = []
        hooks = ModuleHooks()
        hooks.pre_hook([module], "cancel-point", lambda m, args, seen=seen: seen.append("pre"))
        hooks.wrap(module, first, adding(1.0 if first == "step-cache" else 10.0, seen, first))
        hooks.wrap(module, second, adding(1.0 if second == "step-cache" else 10.0, seen, second))
        # adapters' inside: (x * 2 + 10) + 1
        assert module(torch.ones(1)).item() == 13.0
        assert seen == ["pre", "step-cache", "adapters"]
        hooks.close()
        assert module(torch.ones(1)).item() == 2.0
        assert "forward" not in vars(module) and not module._forward_pre_hooks


def test_hooks_are_counted_per_module_and_kind_and_the_last_holder_removes_them() -> None:
    """Two runners over one pipeline: each holds the hooks; the first close leaves them,
    the second removes them, and a forward a library set on the instance comes back."""
    module = Scale(3.0)
    library = module.forward
    module.__dict__["forward"] = library  # as a library that patches instances does
    seen: list[str] = []
    one, two = ModuleHooks(), ModuleHooks()
    assert one.wrap(module, "adapters", adding(1.0, seen, "one"))
    assert not two.wrap(module, "adapters", adding(100.0, seen, "two"))  # one is there
    two.pre_hook([module, module], "cancel-point", lambda m, args: None)
    assert (one.count, two.count) == (1, 2)
    one.close()
    assert has_hook(module, "adapters") and module(torch.ones(1)).item() == 4.0
    two.close()
    assert not has_hook(module, "adapters") and not has_hook(module, "cancel-point")
    assert module.__dict__["forward"] is library and module(torch.ones(1)).item() == 3.0
    one.close()  # idempotent


def test_a_deep_copy_of_a_wrapped_module_calls_its_own_forward() -> None:
    """The chain lives on the module: a deep copy wraps the copy, not the original."""
    module = Scale(2.0)
    hooks = ModuleHooks()
    hooks.wrap(module, "adapters", adding(1.0, [], "one"))
    twin = copy.deepcopy(module)
    twin.factor = 5.0
    assert (module(torch.ones(1)).item(), twin(torch.ones(1)).item()) == (3.0, 6.0)
    hooks.close()


class Part:
    """A feature's part that records what the room asks of it."""

    def __init__(self, rows: Sequence[int], log: list[str]) -> None:
        self.rows = list(rows)
        self.log = log

    def narrowed(self, low: int, high: int) -> Part:
        return Part(self.rows[low:high], self.log)

    def exchange(self) -> None:
        self.log.append(f"exchange {self.rows}")

    def commit(self) -> None:
        self.log.append(f"commit {self.rows}")


def test_a_call_is_set_for_its_block_and_its_parts_commit_only_when_it_returns() -> None:
    """The context is the call's while it runs and gone after; a call that raises commits
    nothing; a rank's slice narrows every part and restores the whole call after."""
    call = ModelCall(states=("a", "b"), rows=(2, 1), device=torch.device("cpu"))
    assert call.total == 3 and list(call.owners()) == [("a", 0, 2), ("b", 2, 1)]
    log: list[str] = []
    with calling(call, {"f": Part([0, 1, 2], log)}) as forward:
        assert current() is forward and forward.rows == 3
        with rows_slice(1, 3) as exchanges:
            inner = current()
            assert inner is not None and inner.part("f").rows == [1, 2] and inner.rows == 2
        assert exchanges == [] and current() is forward
        with token_split(lambda sums: sums * 2):
            assert forward.sums is not None
        assert forward.sums is None
    assert current() is None
    assert log == ["exchange [1, 2]", "commit [0, 1, 2]"]
    log.clear()
    with pytest.raises(RuntimeError), calling(call, {"f": Part([0, 1, 2], log)}):
        raise RuntimeError("a failed call")
    assert log == [] and current() is None
    with rows_slice(0, 1) as exchanges:  # outside a call: nothing to narrow
        assert exchanges == [] and current() is None
