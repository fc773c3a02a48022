"""Exceptions the frontend raises (besides ValueError for bad arguments)."""

from __future__ import annotations


class BackendError(RuntimeError):
    """A backend cannot serve a request: server unreachable, HTTP failure, backend closed."""


class UnknownVariableError(KeyError):
    """`s[name]` for a name no gen/select of the program has set."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = known
        listed = ", ".join(repr(k) for k in known) if known else "none yet"
        super().__init__(f"unknown variable {name!r}; known variables: {listed}")

    def __str__(self) -> str:  # KeyError would print the message with extra quotes
        return str(self.args[0])
