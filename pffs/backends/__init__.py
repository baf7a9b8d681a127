"""pffs.backends: URLs to fsspec filesystems, object identity, retries.

The names below load on first use (PEP 562): importing `pffs.backends.errors` alone (the CLI does, to
map errors) must not import fsspec and every backend client.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Backend": "backend",
    "ObjectInfo": "backend",
    "BackendUnavailableError": "errors",
    "BadOptionError": "errors",
    "ObjectChangedError": "errors",
    "UnknownSchemeError": "errors",
    "BackendOptions": "options",
    "RetryPolicy": "retry",
    "open_backend": "urls",
    "split_url": "urls",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pffs.backends' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pffs.backends.{_WHERE[name]}"), name)
