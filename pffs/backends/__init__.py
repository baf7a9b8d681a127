"""pffs.backends: URLs to fsspec filesystems, object identity, retries."""

from pffs.backends.backend import Backend, ObjectInfo
from pffs.backends.errors import (
    BackendUnavailableError,
    BadOptionError,
    ObjectChangedError,
    UnknownSchemeError,
)
from pffs.backends.options import BackendOptions
from pffs.backends.retry import RetryPolicy
from pffs.backends.urls import open_backend, split_url

__all__ = [
    "Backend",
    "BackendOptions",
    "BackendUnavailableError",
    "BadOptionError",
    "ObjectChangedError",
    "ObjectInfo",
    "RetryPolicy",
    "UnknownSchemeError",
    "open_backend",
    "split_url",
]
