"""From a URL and options to a Backend and the path inside it.

s3://bucket/prefix  s3a://...       S3 (or any S3-compatible server, with endpoint_url)
/data/x  file:///data/x             the local filesystem
memory://x                          fsspec's in-memory filesystem (tests, demos)
hdfs://namenode:8020/path           HDFS through hdfs-native (no JVM); hdfs:///path takes the NameNode
                                    from fs.defaultFS in $HADOOP_CONF_DIR
webhdfs://namenode:9870/path        HDFS over HTTP
gs://, az://, ...                   any other installed fsspec backend, with options in `extra`
"""

from __future__ import annotations

import os
import re
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import fsspec
from fsspec.registry import known_implementations

from pffs.backends.backend import Backend, LocalBackend, S3Backend
from pffs.backends.deadline import attempt_timeout
from pffs.backends.errors import BadOptionError, UnknownSchemeError
from pffs.backends.helper_process import fork_safe_client
from pffs.backends.options import BackendOptions
from pffs.backends.retry import RetryPolicy
from pffs.backends.s3_native import Credentials, NativeS3Getter, plain_getter

ALIASES = {"s3a": "s3", "local": "file"}


def split_url(url: str) -> tuple[str, str]:
    """(protocol, rest) for a URL or a plain local path."""
    if "://" not in url:
        return "file", os.path.abspath(os.path.expanduser(url))
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise UnknownSchemeError(f"{url!r} is not a URL or a path")
    return ALIASES.get(scheme, scheme), rest


def open_backend(url: str, options: BackendOptions | None = None) -> tuple[Backend, str]:
    """The backend for `url` and the path inside it (bucket/prefix for S3, an absolute path for files)."""
    options = options or BackendOptions()
    protocol, rest = split_url(url)
    retry = RetryPolicy(timeout_s=options.backend_timeout)
    if protocol == "s3":
        retry = RetryPolicy(timeout_s=options.backend_timeout, endpoint=options.endpoint_url)
        native = options.native_s3_gets and not options.extra
        s3 = S3Backend(
            "s3",
            partial(_make_s3fs, options),
            retry,
            native_gets=native,
            head_every_file=options.head_every_file,
            plain_native=partial(_plain_native, options),
        )
        s3.origin = f"s3 {options.endpoint_url or 'aws'}"
        return s3, rest.strip("/")
    if protocol == "file":
        path = rest if rest.startswith("/") else "/" + rest
        return LocalBackend("file", partial(fsspec.filesystem, "file"), retry), os.path.normpath(path)
    if protocol not in known_implementations and protocol not in fsspec.available_protocols():
        raise UnknownSchemeError(
            f"unknown URL scheme {protocol!r} in {url!r}; use s3://, file:// (or a path), memory://, "
            "hdfs://, webhdfs:// or another installed fsspec protocol"
        )
    storage_options: dict[str, Any] = dict(options.extra)
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError as exc:  # "Please install gcsfs to access Google Storage"
        raise UnknownSchemeError(
            f"{url}: {protocol}:// needs a package that is not installed ({exc})"
        ) from None
    try:
        from_url = cls._get_kwargs_from_urls(url)
    except ValueError as exc:  # "port could not be cast to integer", say
        raise BadOptionError(
            f"{url}: not a usable {protocol} URL ({exc}); e.g. {protocol}://HOST:PORT/path"
        ) from None
    storage_options = {**from_url, **storage_options}
    path = cls._strip_protocol(url)
    storage_options.setdefault("skip_instance_cache", True)
    if cls.__module__.startswith("hdfs_native"):
        # hdfs-native retries a NameNode that refuses connections 15 times with growing pauses (~3 min):
        # once (a failover to the other NameNode where there are two), then our retry policy decides, within
        # the backend deadline.
        storage_options.setdefault("dfs.client.failover.max.attempts", "1")
    make_fs = partial(fsspec.filesystem, protocol, **storage_options)
    if cls.__module__.startswith("hdfs_native"):  # does not survive fork: see helper_process.py
        make_fs = partial(fork_safe_client, protocol, storage_options)
    backend_cls = LocalBackend if protocol == "memory" else Backend
    backend = backend_cls(protocol, make_fs, retry)
    if from_url.get("host"):  # the URL names a server (hdfs://namenode:8020/path): messages name it too
        backend.authority = urlsplit(url).netloc
    if protocol != "memory":
        backend.origin = f"{protocol} {backend.authority}"
    return backend, path


def _plain_native(options: BackendOptions) -> NativeS3Getter | None:
    """The native S3 client without s3fs, where the options leave botocore nothing to decide."""
    if options.profile or options.credentials_file:
        return None
    explicit = None
    if options.access_key_id is not None and options.secret_access_key is not None:
        token = options.session_token.get_secret_value() if options.session_token is not None else None
        explicit = Credentials(
            options.access_key_id.get_secret_value(), options.secret_access_key.get_secret_value(), token
        )
    return plain_getter(
        options.endpoint_url,
        options.region,
        explicit,
        options.anonymous,
        min(options.connect_timeout_s, attempt_timeout(options.backend_timeout)),
        min(options.read_timeout_s, attempt_timeout(options.backend_timeout)),
    )


def _make_s3fs(options: BackendOptions) -> fsspec.AbstractFileSystem:
    import s3fs  # imported here: only S3 users pay for botocore

    kwargs: dict[str, Any] = {
        "anon": options.anonymous,
        "skip_instance_cache": True,
        # Our metadata cache has its own TTL; s3fs's listing cache would outlive it.
        "use_listings_cache": False,
        "config_kwargs": {
            # no wait for bytes longer than the per-attempt timeout (a stalled answer is retried), no call
            # longer than the deadline (which also cancels the request): deadline.py
            "connect_timeout": min(options.connect_timeout_s, attempt_timeout(options.backend_timeout)),
            "read_timeout": min(options.read_timeout_s, attempt_timeout(options.backend_timeout)),
            "max_pool_connections": options.max_connections,
            "retries": {"max_attempts": 1},  # our RetryPolicy is the only retry loop
        },
        **options.extra,
    }
    client_kwargs: dict[str, Any] = {}
    if options.endpoint_url:
        client_kwargs["endpoint_url"] = options.endpoint_url
    if options.region:
        client_kwargs["region_name"] = options.region
    if client_kwargs:
        kwargs["client_kwargs"] = client_kwargs
    if options.access_key_id is not None:
        kwargs["key"] = options.access_key_id.get_secret_value()
    if options.secret_access_key is not None:
        kwargs["secret"] = options.secret_access_key.get_secret_value()
    if options.session_token is not None:
        kwargs["token"] = options.session_token.get_secret_value()
    if options.profile or options.credentials_file:
        from aiobotocore.session import AioSession

        session = AioSession(profile=options.profile)
        if options.credentials_file:
            session.set_config_variable("credentials_file", os.path.expanduser(options.credentials_file))
        kwargs["session"] = session
    fs = s3fs.S3FileSystem(**kwargs)
    fs.retries = 1  # s3fs's own retry loop off, as above
    return fs
