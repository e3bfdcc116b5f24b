"""A name -> builder registry with a decorator; unknown names and double registrations get
actionable errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from draftsmith.common.errors import InputError

T = TypeVar("T")


class Registry(Generic[T]):
    """``@registry.register("name")`` on a builder; ``registry.get("name")`` returns it, or raises a
    ValueError that lists the registered names. ``what`` names the kind of thing in messages
    ("verifier", "batch kind", ...).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering its argument under ``name`` (twice is an error: two methods would
        collide)."""

        def wrap(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self._items[name] = item
            return item

        return wrap

    def get(self, name: str) -> T:
        """The item registered as ``name``."""
        if name not in self._items:
            raise InputError(
                f"unknown {self.what} {name!r}; registered:"
                f" {', '.join(sorted(self._items)) or 'none'}"
            )
        return self._items[name]

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests registering throwaway items)."""
        del self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
