"""The public surface: what each public package exports, under which name, and what
``import omni_trio`` loads.

Rule for every public package: its public names (``dir()`` without a leading
underscore, minus submodules and ``annotations``) are exactly ``__all__``, and each
exported class and function has the package itself as its ``__module__`` (set by
``_exports.set_public_module``), so it is found, and pickled, under that name.
"""

from __future__ import annotations

import importlib
import pickle
import pickletools
import subprocess
import sys
import traceback
import types
from pathlib import Path

import pytest

import omni_trio as ot

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [
    "omni_trio",
    "omni_trio.abc",
    "omni_trio.runners",
    "omni_trio.parallel",
    "omni_trio.testing",
    "omni_trio.serve",
]
#: The runner seam: ``omni_trio.runners`` re-exports ``omni_trio.abc``'s names, which
#: keep the name ``omni_trio.abc`` whatever a program imports first.
SEAM = frozenset(ot.abc.__all__)


def _public_names(package: types.ModuleType) -> set[str]:
    return {
        name
        for name in dir(package)
        if not name.startswith("_")
        and name != "annotations"
        and not isinstance(getattr(package, name), types.ModuleType)
    }


@pytest.mark.parametrize("name", PACKAGES)
def test_public_names_are_all(name: str) -> None:
    """Every public name is in ``__all__``, every ``__all__`` entry is public, once."""
    package = importlib.import_module(name)
    exported = package.__all__
    assert len(exported) == len(set(exported)), exported
    assert _public_names(package) == set(exported)


@pytest.mark.parametrize("name", PACKAGES)
def test_exports_carry_the_public_module(name: str) -> None:
    """Each exported class and function names this package; constants are plain data."""
    package = importlib.import_module(name)
    for export in package.__all__:
        obj = getattr(package, export)
        if isinstance(obj, type | types.FunctionType):
            home = "omni_trio.abc" if export in SEAM else name
            assert obj.__module__ == home, (export, obj.__module__)
            # The public path finds the object itself: what pickle relies on.
            assert getattr(sys.modules[obj.__module__], obj.__qualname__) is obj, export
        else:
            assert isinstance(obj, str | int | tuple | frozenset), (export, type(obj))


_ERRORS = [
    ot.OmniTrioError("m"),
    ot.EngineClosedError("m"),
    ot.EngineDeadError("m"),
    ot.RequestError("m", request_id="r"),
    ot.DuplicateRequestError("m", request_id="r"),
    ot.QueueFullError("m", request_id="r"),
    ot.DeadlineError("m", estimate_s=2.5, deadline_s=1.0, request_id="r"),
    ot.RequestFailedError("m", request_id="r"),
    ot.RequestAbortedError("m", reason="user", request_id="r"),
    ot.InvalidRequestError("bad", field="f", request_id="r"),
]


def _pickled_class(data: bytes) -> tuple[str, str]:
    """The (module, name) of the first class that the pickle ``data`` refers to."""
    strings: list[str] = []
    for opcode, arg, _ in pickletools.genops(data):
        if isinstance(arg, str):
            strings.append(arg)
        if opcode.name == "STACK_GLOBAL":
            return strings[-2], strings[-1]
    raise AssertionError("no class in the pickle")


@pytest.mark.parametrize("error", _ERRORS, ids=lambda error: type(error).__name__)
def test_errors_pickle_under_the_public_name(error: Exception) -> None:
    """An error pickles by its public path and comes back equal, with its fields."""
    data = pickle.dumps(error)
    assert _pickled_class(data) == ("omni_trio", type(error).__name__)
    copy = pickle.loads(data)
    assert type(copy) is type(error)
    assert copy.args == error.args
    assert copy.__dict__ == error.__dict__


def test_errors_read_the_same() -> None:
    """repr is unchanged; a traceback names the public class."""
    error = ot.RequestAbortedError("request 'r' was aborted (user)", reason="user")
    assert repr(error) == "RequestAbortedError(\"request 'r' was aborted (user)\")"
    assert traceback.format_exception_only(error) == [
        "omni_trio.RequestAbortedError: request 'r' was aborted (user)\n"
    ]


@pytest.mark.parametrize("name", ["omni_trio", "omni_trio.abc", "omni_trio.serve"])
def test_import_loads_no_torch(name: str) -> None:
    """``import omni_trio`` (the runner seam and the HTTP layer too) loads no torch or diffusers."""
    code = (
        f"import {name}, sys; "
        f"assert {name}.__file__.startswith({str(ROOT)!r}), {name}.__file__; "
        "heavy = sorted({'torch', 'diffusers'} & set(sys.modules)); "
        "assert not heavy, heavy"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_the_seam_is_one_set_of_objects_named_omni_trio_abc() -> None:
    """``omni_trio.runners`` re-exports ``omni_trio.abc``'s objects; they pickle as abc's."""
    import omni_trio.abc
    import omni_trio.runners

    for name in omni_trio.abc.__all__:
        assert getattr(omni_trio.runners, name) is getattr(omni_trio.abc, name), name
    assert _pickled_class(pickle.dumps(omni_trio.abc.StopRun())) == ("omni_trio.abc", "StopRun")
    # Whichever is imported first (a fresh interpreter each way).
    for first in ("omni_trio.runners", "omni_trio.abc"):
        code = f"import {first}, omni_trio.runners as r; print(r.Runner.__module__)"
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert result.stdout.strip() == "omni_trio.abc", (first, result.stderr)
