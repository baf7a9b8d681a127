"""What every CSI call goes through: one `Abort(code, message)` exception, one wrapper that logs the call
with its secrets stripped, counts it, and turns exceptions into gRPC codes, and the checks of required
fields and paths that every RPC needs.

A user's mistake (a missing field, a bad attribute, a wrong URL) becomes INVALID_ARGUMENT with one line
naming it; only our own bugs are INTERNAL. No secret reaches a log line or an error message: secrets are
the fields the CSI spec marks `csi_secret`, and their values are scrubbed from every message we send.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
from google.protobuf import text_format
from google.protobuf.message import Message
from pydantic import ValidationError

from pffs.backends.errors import BackendUnavailableError, BadOptionError, UnknownSchemeError
from pffs.config import settings_error
from pffs.csi import csi_pb2
from pffs.csi.metrics import PluginMetrics

log = logging.getLogger(__name__)

STRIPPED = "***stripped***"
Code = grpc.StatusCode


class Abort(Exception):
    """Ends a call with this gRPC code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def require(request: Message, *fields: str) -> None:
    """INVALID_ARGUMENT naming the first required field the request lacks (empty counts as missing)."""
    for name in fields:
        field = request.DESCRIPTOR.fields_by_name[name]
        if field.message_type is not None and not _is_repeated(field):
            present = request.HasField(name)
        else:
            present = bool(getattr(request, name))
        if not present:
            raise Abort(Code.INVALID_ARGUMENT, f"{name} is required")


def _is_repeated(field: Any) -> bool:
    return bool(field.is_repeated)


def check_path(path: str, what: str) -> str:
    """A path the CO gave us to mount on: absolute, no `..` component, no NUL. Returns it normalized."""
    if "\0" in path:
        raise Abort(Code.INVALID_ARGUMENT, f"{what} contains a NUL byte")
    if not path.startswith("/"):
        raise Abort(Code.INVALID_ARGUMENT, f"{what} must be an absolute path, not {path!r}")
    if ".." in path.split("/"):
        raise Abort(Code.INVALID_ARGUMENT, f"{what} must not contain '..': {path!r}")
    return os.path.normpath(path)


def check_volume_id(volume_id: str) -> str:
    """Volume ids name records in the state dir (hashed) and are shown to users: nothing that looks like a
    way out of a directory."""
    if "\0" in volume_id or any(ord(c) < 0x20 for c in volume_id):
        raise Abort(Code.INVALID_ARGUMENT, "volume_id contains control characters")
    if volume_id.startswith("/") or ".." in volume_id.replace("\\", "/").split("/"):
        raise Abort(Code.INVALID_ARGUMENT, f"volume_id must not be a path or contain '..': {volume_id!r}")
    return volume_id


# Secrets: the fields the spec marks csi_secret (map<string, string> secrets = N [(csi_secret) = true]).


def _secret_fields(message: Message) -> Iterator[tuple[Message, str]]:
    for field, value in message.ListFields():
        if field.GetOptions().Extensions[csi_pb2.csi_secret]:
            yield message, field.name
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for item in value if _is_repeated(field) else [value]:
                yield from _secret_fields(item)


def secret_values(message: Message) -> list[str]:
    values: list[str] = []
    for owner, name in _secret_fields(message):
        values += [v for v in getattr(owner, name).values() if v]
    return values


def stripped(message: Message) -> str:
    """The message in one line for a log, with the value of every secret replaced."""
    copy = type(message)()
    copy.CopyFrom(message)
    for owner, name in list(_secret_fields(copy)):
        secrets = getattr(owner, name)
        for key in list(secrets):
            secrets[key] = STRIPPED
    return text_format.MessageToString(copy, as_one_line=True)


def scrub(text: str, secrets: Iterable[str]) -> str:
    for value in secrets:
        if len(value) >= 4:  # a shorter "secret" would blank out ordinary words
            text = text.replace(value, STRIPPED)
    return text


# Exceptions → codes, for errors raised below the servicers (backends, mounts, options).


def classify(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, Abort):
        return exc.code, exc.message
    if isinstance(exc, ValidationError):
        return Code.INVALID_ARGUMENT, settings_error(exc)
    if isinstance(exc, BadOptionError | UnknownSchemeError):
        return Code.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, FileNotFoundError):
        return Code.NOT_FOUND, exc.strerror or str(exc)
    if isinstance(exc, PermissionError):
        return Code.PERMISSION_DENIED, with_secret_hint(exc.strerror or str(exc))
    if isinstance(exc, TimeoutError):
        return Code.DEADLINE_EXCEEDED, str(exc) or "timed out"
    if isinstance(exc, BackendUnavailableError):
        return Code.UNAVAILABLE, f"{exc} (is the endpoint right and the server up?)"
    if isinstance(exc, OSError):
        detail = exc.strerror or str(exc)
        if exc.filename and str(exc.filename) not in detail:
            detail = f"{exc.filename}: {detail}"
        return Code.INTERNAL, detail
    log.exception("internal error")
    return Code.INTERNAL, f"internal error: {type(exc).__name__} (see the plugin's log)"


# The backends' hints name what a shell user sets; a CSI volume's credentials come only from its Secret.
_SHELL_HINTS = re.compile(
    r"(: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY[^;]*|; check the credentials \(AWS_ACCESS_KEY_ID/"
    r"AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the credentials file\) and the bucket policy)"
)
SECRET_HINT = (
    "check the volume's Secret (the PV's nodeStageSecretRef, the StorageClass's "
    "csi.storage.k8s.io/node-stage-secret-name/-namespace, or an inline volume's nodePublishSecretRef): "
    "keys accessKeyId and secretAccessKey (and sessionToken for temporary keys), and the bucket's policy"
)


def with_secret_hint(message: str) -> str:
    """A credentials error's message with the hint a CSI user can act on."""
    if not _SHELL_HINTS.search(message):
        return message
    return _SHELL_HINTS.sub("", message) + "; " + SECRET_HINT


Handler = TypeVar("Handler", bound=Callable[..., Any])


def rpc(method: Handler) -> Handler:
    """Wraps a servicer method: logs the call (secrets stripped), times and counts it by code, and turns
    any exception into the gRPC status the spec wants, its message scrubbed of the call's secrets."""
    name = method.__name__

    @functools.wraps(method)
    def handler(self: Any, request: Message, context: grpc.ServicerContext) -> Any:
        metrics: PluginMetrics = self.metrics
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s(%s)", name, stripped(request))
        started = time.monotonic()
        code, message, response = Code.OK, "", None
        try:
            response = method(self, request, context)
        except Exception as exc:
            code, message = classify(exc)
            message = scrub(message, secret_values(request))
        elapsed = time.monotonic() - started
        metrics.rpcs.labels(name, code.name).inc()
        metrics.rpc_seconds.labels(name).observe(elapsed)
        if code is not Code.OK:
            level = logging.WARNING if code is not Code.INTERNAL else logging.ERROR
            log.log(level, "%s: %s: %s (%.2f s)", name, code.name, message, elapsed)
            context.abort(code, message)
        elif name not in QUIET_METHODS:
            log.info("%s: OK (%.2f s)", name, elapsed)
        return response

    return handler  # type: ignore[return-value]


# Called every few seconds by the kubelet and the sidecars: logged at debug only.
QUIET_METHODS = frozenset(
    {
        "Probe",
        "GetPluginInfo",
        "GetPluginCapabilities",
        "NodeGetCapabilities",
        "ControllerGetCapabilities",
        "NodeGetVolumeStats",
        "NodeGetVolumeHealth",
    }
)


class KeyedLocks:
    """One lock per key (a staging or target path). The CO sends one call per volume at a time, but after
    a restart it may send two: the second gets ABORTED, as the spec suggests, and is retried."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    @contextmanager
    def hold(self, key: str, wait_s: float = 0.0) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        acquired = lock.acquire(timeout=wait_s) if wait_s > 0 else lock.acquire(blocking=False)
        if not acquired:
            raise Abort(Code.ABORTED, f"an operation on {key} is in progress; retry")
        try:
            yield
        finally:
            lock.release()


T = TypeVar("T")


def with_deadline(pool: concurrent.futures.Executor, fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """fn() on a worker thread, or DEADLINE_EXCEEDED naming `what` after timeout_s: a hung backend or mount
    must not hold a CSI call (and the kubelet behind it) forever."""
    future = pool.submit(fn)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise Abort(Code.DEADLINE_EXCEEDED, f"{what} did not answer within {timeout_s:.0f} s") from None
