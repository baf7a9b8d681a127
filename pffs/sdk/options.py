"""Turning fsspec-style keyword arguments into pffs settings and backend options.

Users chain pffs in front of a backend the fsspec way — `fsspec.open("pffs::s3://b/k", s3={"key": ...})` —
so the backend's options arrive in s3fs's vocabulary (key, secret, token, anon, client_kwargs); pffs's own
names (access_key_id, endpoint_url, ...) work too.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from typing import Any

import fsspec
from pydantic import ValidationError

from pffs.backends.errors import BadOptionError
from pffs.backends.options import BackendOptions
from pffs.config import CacheSettings, settings_error
from pffs.peers.settings import PeerSettings

log = logging.getLogger(__name__)

S3FS_NAMES = {
    "key": "access_key_id",
    "secret": "secret_access_key",
    "token": "session_token",
    "anon": "anonymous",
}
CACHE_FIELDS = set(CacheSettings.model_fields)
BACKEND_FIELDS = set(BackendOptions.model_fields) - {"extra"}


def own_layer_options(options: dict[str, Any], protocol: str, scheme: str = "") -> dict[str, Any]:
    """The options of a pffs layer in front of `protocol`: given flat, or per layer as `pffs={...}` and
    `<protocol>={...}` (merged in; what is given flat wins). Another layer's (`hf={...}`) are dropped:
    fsspec hands the first layer of a URL every option no layer of it is named for, and Hugging Face
    `datasets` passes its Hub's options (`hf`) with every URL."""
    own = {"pffs", protocol, scheme} - {""}
    others = set(fsspec.available_protocols()) - own
    merged: dict[str, Any] = {}
    for name, value in options.items():
        if name in own and isinstance(value, dict):
            merged = {**value, **merged}
        elif name in others and isinstance(value, dict):
            log.debug("options for %s ignored by pffs (%s)", name, ", ".join(sorted(value)))
        else:
            merged[name] = value
    return merged


def backend_options(raw: dict[str, Any]) -> BackendOptions:
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for name, value in raw.items():
        name = S3FS_NAMES.get(name, name)
        if name == "client_kwargs" and isinstance(value, dict):
            client = dict(value)
            if "endpoint_url" in client:
                fields["endpoint_url"] = client.pop("endpoint_url")
            if "region_name" in client:
                fields["region"] = client.pop("region_name")
            if client:
                extra["client_kwargs"] = client
        elif name in BACKEND_FIELDS:
            fields[name] = value
        else:
            extra[name] = value
    try:
        return BackendOptions(**fields, extra=extra)
    except ValidationError as exc:
        raise BadOptionError(f"bad backend option: {settings_error(exc)}") from None


# Options every fsspec filesystem takes (AbstractFileSystem's own), beside those of its __init__.
FSSPEC_COMMON = {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache"}


def check_passed_through(protocol: str, options: BackendOptions) -> None:
    """An option pffs does not know and the backend's client does not take is a typo: said now, by name,
    not as a TypeError from deep inside the client at the first read."""
    if protocol == "s3" and options.extra:
        import s3fs

        taken = set(inspect.signature(s3fs.S3FileSystem.__init__).parameters) - {"self", "kwargs"}
        client = "s3fs.S3FileSystem"
    elif protocol in ("file", "memory"):
        taken, client = set(), "local files"
    else:
        return  # other clients take what their own constructors take, often through **kwargs
    unknown = sorted(set(options.extra) - taken - FSSPEC_COMMON)
    if not unknown:
        return
    names = sorted(BACKEND_FIELDS | CACHE_FIELDS | set(S3FS_NAMES) | set(PEER_OPTIONS) | taken)
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, names, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise BadOptionError(
        f"unknown option {', '.join(hints)}: pffs takes {', '.join(sorted(CACHE_FIELDS | BACKEND_FIELDS))}"
        + (f", and the options of {client}" if taken else "")
    )


def cache_settings(raw: dict[str, Any]) -> CacheSettings:
    try:
        return CacheSettings(**{k: v for k, v in raw.items() if v is not None})
    except ValidationError as exc:
        raise BadOptionError(f"bad cache option: {settings_error(exc)}") from None


# A cache group (pffs.peers): peers="10.0.0.7:9830,10.0.0.8:9830" (or a list) and/or peers_file (one
# HOST:PORT per line, read again when it changes), peer_listen (this process's own member address; none: it
# reads from the group and serves nothing), peer_token or peer_token_file, peer_timeout (seconds),
# peer_tls_dir (mutual TLS: a folder of ca.crt, tls.crt, tls.key).
PEER_OPTIONS = {
    "peers": "members",
    "peers_file": "members_file",
    "peer_listen": "listen",
    "peer_token": "token",
    "peer_token_file": "token_file",
    "peer_timeout": "timeout_s",
    "peer_tls_dir": "tls_dir",
}


def peer_settings(options: dict[str, Any]) -> PeerSettings | None:
    """Takes the cache-group options out of `options`; None if it names no peers."""
    given = {PEER_OPTIONS[k]: options.pop(k) for k in list(options) if k in PEER_OPTIONS}
    return peer_settings_from(given, PEER_OPTIONS) if given else None


def peer_settings_from(fields: dict[str, Any], names: dict[str, str] | None = None) -> PeerSettings:
    """PeerSettings of `fields`; a bad value is one BadOptionError naming the option as the user wrote it
    (`names`: option -> field, where they differ)."""
    try:
        return PeerSettings(**fields)
    except ValidationError as exc:
        message = settings_error(exc)
        for option, field in (names or {}).items():
            message = message.replace(field, option)
        raise BadOptionError(f"bad cache-group option: {message}") from None
