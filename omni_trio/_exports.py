"""Give each exported class and function the public package as its ``__module__``.

Each public package (``omni_trio``, ``omni_trio.abc``, ``omni_trio.runners``,
``omni_trio.testing``, ``omni_trio.serve``) re-exports names from private modules and calls
``set_public_module`` at the end of its ``__init__``, as trio's
``fixup_module_metadata`` and httpx do. Then reprs, tracebacks and documentation
say ``omni_trio.RequestAbortedError``, not the private module it lives in, and a
pickle refers to the public path, so renaming a private module breaks no pickle.

The price: ``typing.get_type_hints`` resolves a class's string annotations in the
namespace of its ``__module__``, so it fails on a class whose annotations name
something the public package does not export (trio's classes have the same limit).
"""

from __future__ import annotations

import types
from collections.abc import Mapping

__all__ = ["set_public_module"]


def _is_private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split("."))


def set_public_module(package: str, namespace: Mapping[str, object]) -> None:
    """Set ``__module__ = package`` on each class and function in ``namespace['__all__']``.

    Only objects of this project defined in a private module change, so an object
    that two public packages export keeps the first one's name.

    Args:
        package: the public package's name (its ``__name__``).
        namespace: the package's ``globals()``, with its ``__all__``.
    """
    names = namespace["__all__"]
    assert isinstance(names, list)
    for name in names:
        obj = namespace[name]
        if not isinstance(obj, type | types.FunctionType):
            continue  # constants: their type's __module__ is not theirs to change
        module = obj.__module__
        if module.startswith("omni_trio.") and _is_private(module):
            obj.__module__ = package
