"""Errors the backends raise. All are OSError subclasses, so every layer above can map them to an errno."""

from __future__ import annotations

import errno


class BackendUnavailableError(ConnectionError):
    """The backend kept failing with temporary errors (timeouts, 5xx, refused connections)."""


class ObjectChangedError(OSError):
    """The object changed while it was being read; its old bytes can no longer be fetched."""

    def __init__(self, url: str) -> None:
        super().__init__(errno.ESTALE, f"{url}: the object changed while it was being read; open it again")


class EndpointNotS3Error(OSError):
    """The endpoint answered, but not as an S3 server does (a web server's page): a wrong --endpoint-url."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EPROTO, message)


class UnknownSchemeError(ValueError):
    """A URL whose scheme no installed fsspec backend handles."""


class BadOptionError(ValueError):
    """An option that cannot be used (a bad size, a missing value)."""
