"""Classes that only the library may instantiate, and that nobody may subclass.

An ``Engine`` built by hand has no running worker, and a ``RequestHandle`` built by
hand has no admitted request: both would accept calls that then wait forever. So
their metaclass refuses the public constructor, and the library makes them through
the private ``_create`` classmethod (the idiom of trio's ``NoPublicConstructor``).
A subclass could not be constructed either, so defining one is refused too.
"""

from __future__ import annotations

from typing import Any, NoReturn, TypeVar

__all__ = ["NoPublicConstructor"]

T = TypeVar("T")


class NoPublicConstructor(type):
    """Metaclass of a final class whose instances only the library creates.

    Pair it with ``@typing.final``, which tells type checkers what the metaclass
    enforces at run time; ``made_by`` names the public way to get an instance::

        @final
        class Engine(metaclass=NoPublicConstructor, made_by="open_engine()"): ...

        engine = Engine._create(runner, config)  # inside omni_trio only

    Raises:
        TypeError: on ``cls(...)``, and on defining a subclass.
    """

    _made_by: str

    def __new__(
        mcs,
        name: str,
        bases: tuple[type, ...],
        namespace: dict[str, Any],
        *,
        made_by: str = "",
    ) -> NoPublicConstructor:
        for base in bases:
            if isinstance(base, NoPublicConstructor):
                raise TypeError(
                    f"{base.__module__}.{base.__qualname__} does not support subclassing"
                )
        if not made_by:
            raise TypeError(f"{name}: say how to get an instance with made_by=...")
        cls = super().__new__(mcs, name, bases, namespace)
        cls._made_by = made_by
        return cls

    def __call__(cls, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} has no public constructor available; "
            f"get one from {cls._made_by}"
        )

    def _create(cls: type[T], *args: Any, **kwargs: Any) -> T:
        """Make an instance: the one way in, for the library's own use."""
        return super().__call__(*args, **kwargs)  # type: ignore[misc, no-any-return]
