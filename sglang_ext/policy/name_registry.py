"""A small name -> factory registry that refuses duplicates and lists names on a miss."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(entry: T) -> T:
            self.add(name, entry)
            return entry

        return decorator

    def add(self, name: str, entry: T) -> None:
        if name in self._entries:
            raise KeyError(f"{self._kind} {name!r} is already registered")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self._kind} {name!r}; valid: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
