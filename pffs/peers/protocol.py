"""What members agree on: who owns a block, how a request is signed, and how a block travels.

A request is `GET /v1/block?<query>` with headers X-Pffs-Time (Unix seconds) and X-Pffs-Signature (the
hex HMAC-SHA256, keyed by the group's token, of "<time>\\n<path and query>"). A signature older or newer
than MAX_CLOCK_SKEW_S is refused, so a captured request cannot be replayed later. An answer is 200 with the
block in its cache file format (a header of xxh3 digests, one per 32 KiB, then the payload), or 404 when
the member will not serve it (another backend, outside its dataset, another block size), 401 for a bad
signature, 503 when its own fetch failed.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlencode

from pffs.backends.backend import ObjectInfo

BLOCK_PATH = "/v1/block"
MAX_CLOCK_SKEW_S = 300.0
TIME_HEADER = "X-Pffs-Time"
SIGNATURE_HEADER = "X-Pffs-Signature"


def owner_of(key: str, members: Iterable[str]) -> str | None:
    """The member that owns `key`: the highest rendezvous score. Adding or removing a member moves only
    the keys that member wins or won."""
    best, best_score = None, b""
    for member in members:
        score = hashlib.blake2b(f"{member}\0{key}".encode(), digest_size=8).digest()
        if best is None or score > best_score:
            best, best_score = member, score
    return best


def signature(token: bytes, stamp: str, target: str) -> str:
    return hmac.new(token, f"{stamp}\n{target}".encode(), hashlib.sha256).hexdigest()


def signed_headers(token: bytes, target: str, now: float | None = None) -> dict[str, str]:
    stamp = str(int(time.time() if now is None else now))
    return {TIME_HEADER: stamp, SIGNATURE_HEADER: signature(token, stamp, target)}


def is_signed(token: bytes, target: str, headers: Mapping[str, str] | Any, now: float | None = None) -> bool:
    """`headers`: a mapping, or http.server's message (whose names are case-insensitive)."""
    stamp, given = headers.get(TIME_HEADER) or "", headers.get(SIGNATURE_HEADER) or ""
    if not stamp.isdigit() or not given:
        return False
    if abs((time.time() if now is None else now) - int(stamp)) > MAX_CLOCK_SKEW_S:
        return False
    return hmac.compare_digest(signature(token, stamp, target), given)


@dataclass(frozen=True)
class BlockRequest:
    """One block of one version of one object, as both sides name it."""

    origin: str  # the backend (e.g. "s3 http://10.0.0.5:8333"): members of other backends serve nothing
    key: str  # the local cache's key of the block
    path: str
    size: int
    identity: str
    etag: str | None
    version_id: str | None
    start: int
    end: int

    def target(self) -> str:
        fields = {
            "origin": self.origin,
            "key": self.key,
            "path": self.path,
            "size": self.size,
            "identity": self.identity,
            "start": self.start,
            "end": self.end,
        }
        if self.etag is not None:
            fields["etag"] = self.etag
        if self.version_id is not None:
            fields["version"] = self.version_id
        return f"{BLOCK_PATH}?{urlencode(fields)}"

    @classmethod
    def parse(cls, query: str) -> BlockRequest:
        """ValueError for anything that is not a whole request."""
        fields = {name: values[-1] for name, values in parse_qs(query, strict_parsing=True).items()}
        try:
            request = cls(
                origin=fields["origin"],
                key=fields["key"],
                path=fields["path"],
                size=int(fields["size"]),
                identity=fields["identity"],
                etag=fields.get("etag"),
                version_id=fields.get("version"),
                start=int(fields["start"]),
                end=int(fields["end"]),
            )
        except KeyError as exc:
            raise ValueError(f"missing {exc.args[0]}") from None
        if not 0 <= request.start < request.end <= request.size:
            raise ValueError("bad range")
        return request

    def object_info(self) -> ObjectInfo:
        """The version the request names, as the owner's backend reads it (pinned to its ETag/version)."""
        return ObjectInfo(
            path=self.path,
            size=self.size,
            is_dir=False,
            identity=self.identity,
            etag=self.etag,
            version_id=self.version_id,
        )
