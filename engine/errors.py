"""Errors the engine raises for bad requests and for a pool that can never fit a request.

Services map them to status codes: :class:`InvalidRequestError` -> ``INVALID_ARGUMENT`` / HTTP 400,
:class:`ResourceExhaustedError` -> ``RESOURCE_EXHAUSTED`` / HTTP 503 (or 400 when it can never fit).
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field is invalid. ``field`` names it (e.g. ``"top_p"``, ``"prompt"``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class ResourceExhaustedError(RuntimeError):
    """The KV pool (or request-slot pool) cannot hold the request, now or ever.

    ``never_fits`` is True when even an empty pool could not hold it (retrying will not help).
    """

    def __init__(self, message: str, never_fits: bool = True):
        self.never_fits = never_fits
        super().__init__(message)
