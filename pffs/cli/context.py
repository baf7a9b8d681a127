"""From parsed command-line options to settings, a backend and a VFS."""

from __future__ import annotations

import argparse
import errno
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pffs.backends.options import BackendOptions
    from pffs.cache import BlockCache
    from pffs.config import CacheSettings
    from pffs.vfs import Vfs


CACHE_OPTIONS = (
    "cache_dir",
    "cache_size",
    "cache_free_space",
    "memory_cache_size",
    "block_size",
    "metadata_ttl",
    "stale_if_error",
)
BACKEND_OPTIONS = {
    "endpoint_url": "endpoint_url",
    "region": "region",
    "profile": "profile",
    "credentials_file": "credentials_file",
    "anonymous": "anonymous",
    "backend_timeout": "backend_timeout",
    "head_every_file": "head_every_file",
}


def _given(args: argparse.Namespace, names: Any) -> dict[str, Any]:
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def cache_settings(args: argparse.Namespace, **overrides: Any) -> CacheSettings:
    from pydantic import ValidationError

    from pffs.backends.errors import BadOptionError
    from pffs.config import CacheSettings, settings_error

    values = {**_given(args, CACHE_OPTIONS), **overrides}
    try:
        return CacheSettings(**values)
    except ValidationError as exc:
        raise BadOptionError(settings_error(exc).replace("_", "-")) from None


def backend_options(args: argparse.Namespace) -> BackendOptions:
    from pydantic import ValidationError

    from pffs.backends.errors import BadOptionError
    from pffs.backends.options import BackendOptions
    from pffs.config import settings_error

    given = _given(args, BACKEND_OPTIONS)
    try:
        return BackendOptions(**{BACKEND_OPTIONS[k]: v for k, v in given.items()})
    except ValidationError as exc:
        raise BadOptionError(settings_error(exc).replace("_", "-")) from None


def open_vfs(url: str, args: argparse.Namespace, **overrides: Any) -> tuple[Vfs, str]:
    from pffs.backends.urls import open_backend
    from pffs.vfs import Vfs

    backend, path = open_backend(url, backend_options(args))
    return Vfs(backend, cache_settings(args, **overrides)), path


def open_cache(args: argparse.Namespace, must_exist: bool = False) -> tuple[CacheSettings, BlockCache]:
    """The cache at --cache-dir; with `must_exist`, a folder that holds no pffs cache is an error (for the
    commands that look after a cache: they must not make an empty one)."""
    from pffs.vfs import shared_block_cache

    settings = cache_settings(args)
    if must_exist and not has_cache(settings):
        raise OSError(
            errno.ENOENT,
            f"{settings.cache_dir}: no pffs cache here; give the --cache-dir your mounts and programs use "
            "(by default $PFFS_CACHE_DIR, else ~/.cache/pffs)",
        )
    return settings, shared_block_cache(settings)


def has_cache(settings: CacheSettings) -> bool:
    """Whether --cache-dir holds a pffs cache (looking makes none)."""
    return (Path(settings.cache_dir) / "blocks").is_dir()
