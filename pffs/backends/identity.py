"""Object identity: what changes when an object's bytes change. Cache keys carry it, so a changed object
gets new keys and old bytes are never served for it, nor mixed with new ones."""

from __future__ import annotations

import datetime as dt
from typing import Any

# Where fsspec implementations put a modification time, most specific first.
MTIME_FIELDS = (
    "mtime",
    "LastModified",
    "last_modified",
    "modificationTime",
    "modification_time",  # hdfs-native (milliseconds)
    "modified",
    "updated",
    "created",
)


def identity_token(protocol: str, info: dict[str, Any]) -> str:
    """A string that differs whenever the object's content may differ (size is added by the caller)."""
    if protocol == "s3":
        version = info.get("VersionId")
        if version and version != "null":
            return f"version:{version}"
        etag = info.get("ETag") or info.get("etag")
        if etag:
            return "etag:" + str(etag).strip('"')
    for field in MTIME_FIELDS:
        value = info.get(field)
        if value is not None:
            if isinstance(value, dt.datetime):
                return f"mtime:{value.timestamp():.9f}"
            return f"mtime:{value}"
    return "unversioned"


def mtime_seconds(info: dict[str, Any]) -> float:
    """The modification time in seconds since the epoch, or 0.0 where the backend gives none."""
    for field in MTIME_FIELDS:
        value = info.get(field)
        if value is None:
            continue
        if isinstance(value, dt.datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value) / 1000 if value > 1e12 else float(value)  # webhdfs gives milliseconds
        try:
            return dt.datetime.fromisoformat(str(value)).timestamp()
        except ValueError:
            continue
    return 0.0
