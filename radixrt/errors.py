"""Errors of bad request input, shared by the engine and the server (torch-free)."""

from __future__ import annotations


class RequestValueError(ValueError):
    """Bad request input: the message says what was wrong and what is allowed; `field` is
    the request field at fault (a `SamplingParams` / `BeamSearchParams` field name), or None
    when the fault is not one field's."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
