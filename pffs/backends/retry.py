"""One retry policy for every backend: temporary failures are retried with capped, jittered exponential
backoff; permanent ones (403, 404, bad request) are raised at once with a message naming the URL.

Messages are built from the error's type and the server's text, never from the request, so credentials
cannot leak into them.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pffs.backends.deadline import BackendTimeoutError, deadline
from pffs.backends.errors import BackendUnavailableError, EndpointNotS3Error, ObjectChangedError

log = logging.getLogger(__name__)
T = TypeVar("T")

PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
    ObjectChangedError,
    ValueError,
    TypeError,
    NotImplementedError,
)
# s3fs maps 4xx answers it has no better class for to these errnos.
PERMANENT_ERRNOS = {errno.EINVAL, errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTEMPTY, errno.EEXIST}
TEMPORARY_ERROR_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError"}


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    timeout_s: float | None = None  # the deadline of one call, retries included (deadline.py); None: none
    endpoint: str | None = None  # the S3 endpoint given (--endpoint-url), named when it does not answer as S3

    def delay(self, attempt: int) -> float:
        capped = min(self.max_delay_s, self.base_delay_s * (2**attempt))
        return capped * (0.5 + random.random() / 2)

    def call(self, fn: Callable[[], T], url: str, extra_s: float = 0.0) -> T:
        """fn() with retries, all within the deadline: timeout_s, plus extra_s for a call that moves much
        data (an upload's time grows with its size; a hung backend still ends it)."""
        timeout_s = None if self.timeout_s is None else self.timeout_s + extra_s
        with deadline(timeout_s) as at:
            for attempt in range(self.attempts):
                try:
                    return fn()
                except BaseException as exc:
                    if not is_temporary(exc):
                        raise permanent_error(exc, url, self.endpoint) from exc
                    left = None if at is None else at - time.monotonic()
                    if left is not None and left <= 0.001:
                        raise BackendTimeoutError(url, timeout_s or 0.0, describe(exc)) from exc
                    if attempt == self.attempts - 1:
                        raise BackendUnavailableError(
                            f"{url}: backend unavailable after {self.attempts} attempts: {describe(exc)}"
                        ) from exc
                    pause = self.delay(attempt) if left is None else min(self.delay(attempt), left)
                    log.debug("temporary failure on %s (%s); retrying in %.2fs", url, describe(exc), pause)
                    time.sleep(pause)
        raise AssertionError("unreachable")


def is_temporary(exc: BaseException) -> bool:
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return False
    if isinstance(exc, PERMANENT_ERRORS):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    status, code = _http_status(exc)
    if status is not None:
        return status >= 500 or status == 429 or code in TEMPORARY_ERROR_CODES
    if isinstance(exc, OSError):
        return exc.errno not in PERMANENT_ERRNOS
    # botocore and aiohttp connection/timeout errors are not OSErrors; recognise them by name.
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(
        names
        & {
            "EndpointConnectionError",
            "ConnectTimeoutError",
            "ReadTimeoutError",
            "ConnectionClosedError",
            "ClientConnectorError",
            "ServerDisconnectedError",
            "ClientPayloadError",
            "IncompleteReadError",
            "ResponseStreamingError",
        }
    )


def _http_status(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and error code of a botocore ClientError, here or as the cause of an s3fs error."""
    response = _response(exc)
    if response is None:
        return None, None
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode"), response.get("Error", {}).get("Code")


def _response(exc: BaseException) -> dict[str, Any] | None:
    """The answer a botocore ClientError (or our native client's error) carries: on the error itself, or
    down its chain (s3fs raises its own error from botocore's, and pffs its own from s3fs's)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            break
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            return response
        seen = seen.__cause__ or seen.__context__
    return None


def not_like_s3(exc: BaseException) -> str | None:
    """What the server answered, if the answer is not an S3 server's: an error without any x-amz-* header
    and not XML (S3's errors are XML; AWS, MinIO, Ceph and SeaweedFS all send x-amz-request-id), as a
    plain web server's 404 page. None if it looks like S3's, or carries no headers to tell."""
    response = _response(exc)
    meta = response.get("ResponseMetadata", {}) if response else {}
    headers = {str(k).lower(): str(v) for k, v in (meta.get("HTTPHeaders") or {}).items()}
    if not headers or any(k.startswith(("x-amz-", "x-goog-")) for k in headers):  # (GCS's XML API: x-goog-)
        return None
    content_type = headers.get("content-type", "")
    if "xml" in content_type:
        return None
    status = meta.get("HTTPStatusCode")
    words = [f"HTTP {status}" if status else "an answer"]
    if content_type:
        words.append(content_type.split(";")[0].strip())
    if headers.get("server"):
        words.append(f"server {headers['server'][:60]}")
    return ", ".join(words)


def _without_userinfo(url: str) -> str:
    scheme, found, rest = url.partition("://")
    if not found:
        return url
    authority, slash, path = rest.partition("/")
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}"


def _no_such_bucket(exc: BaseException) -> bool:
    response = _response(exc)
    if response is not None and response.get("Error", {}).get("Code") == "NoSuchBucket":
        return True
    return "specified bucket does not exist" in str(exc).lower()


def describe(exc: BaseException) -> str:
    text = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).strip()
    text = text or type(exc).__name__
    return text.splitlines()[0][:300]


# Raised by pffs, naming the URL already (and taking other arguments than OSError's).
OUR_ERRORS = (ObjectChangedError, BackendTimeoutError, BackendUnavailableError, EndpointNotS3Error)
# botocore's, when it finds no credentials where it looks: a setup mistake, said as access denied.
CREDENTIAL_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}


def permanent_error(exc: BaseException, url: str, endpoint: str | None = None) -> BaseException:
    """The same kind of error, with a message that names the URL and what to do. An answer that is not an
    S3 server's (a web server's 404 page) is said as such, not as a missing bucket or object."""
    if type(exc).__name__ in CREDENTIAL_ERRORS:
        return PermissionError(
            errno.EACCES,
            f"{url}: no usable S3 credentials ({describe(exc)}): set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or a credentials file; --anonymous for a public bucket",
        )
    if isinstance(exc, OUR_ERRORS):
        return exc  # ours: they name the URL already (and take other arguments than OSError's)
    if not isinstance(exc, OSError | ValueError):
        return exc
    answered = not_like_s3(exc)
    if answered is not None:
        where = f"the endpoint {_without_userinfo(endpoint)}" if endpoint else "the S3 endpoint (AWS)"
        return EndpointNotS3Error(
            f"{url}: {where} does not answer like an S3 server ({answered}); check --endpoint-url "
            "(the SDK's endpoint_url): it must be the address of the S3 API"
        )
    if isinstance(exc, FileNotFoundError):
        if _no_such_bucket(exc):
            return FileNotFoundError(errno.ENOENT, f"{url}: the bucket does not exist ({describe(exc)})")
        return FileNotFoundError(errno.ENOENT, f"{url}: no such file or object")
    if isinstance(exc, PermissionError):
        return PermissionError(
            errno.EACCES,
            f"{url}: access denied ({describe(exc)}); check the credentials (AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the credentials file) and the bucket policy",
        )
    if isinstance(exc, OSError):
        return type(exc)(exc.errno, f"{url}: {describe(exc)}")
    return type(exc)(f"{url}: {describe(exc)}")
