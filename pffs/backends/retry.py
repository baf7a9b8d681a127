"""One retry policy for every backend: temporary failures are retried with capped, jittered exponential
backoff until the call's deadline (--backend-timeout), throttling from a larger base delay; permanent ones
(403, 404, bad request) are raised at once with a message naming the URL.

Messages are built from the error's type and the server's text, never from the request, so credentials
cannot leak into them.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pffs.backends.deadline import BackendTimeoutError, deadline
from pffs.backends.errors import BackendUnavailableError, EndpointNotS3Error, ObjectChangedError

if TYPE_CHECKING:
    from pffs.backends.request_stats import RequestStats

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


# Answers that say "slow down": retried after longer pauses (throttled_delay_s, as the AWS SDKs' 500 ms
# throttled base against their 100 ms), so many clients throttled at once back off rather than pile on.
THROTTLING_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequests",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "ProvisionedThroughputExceededException",
}
# What ended a failed attempt, as counted (request_stats.RETRY_COUNTERS) and said in the episode's line.
THROTTLED, TIMED_OUT, RESET, SERVER_ERROR, OTHER = "throttled", "timeouts", "resets", "server_errors", "other"
ATTEMPTS_WITHOUT_DEADLINE = 10  # a call with neither a deadline nor a count of attempts
LAST_ATTEMPT_S = 0.2  # the least time left worth a last attempt: a pause ends this long before the deadline
# A connection refused (nothing listens: a stopped store, a wrong port) answers at once and says the store
# is down, not slow: after this many in a row the call fails (in about 1 s) instead of holding its reader
# for the whole deadline, so stale-if-error or the error reaches the user while a restart's blink is still
# ridden out.
REFUSED_ATTEMPTS = 4


@dataclass(frozen=True)
class RetryPolicy:
    """Temporary failures are retried until the call's deadline (timeout_s), with capped exponential backoff
    and jitter; throttling answers from a larger base delay. `attempts` caps the count as well (None: the
    deadline alone decides; without a deadline either, ATTEMPTS_WITHOUT_DEADLINE)."""

    attempts: int | None = None
    base_delay_s: float = 0.1
    # Capped at 2 s, a call keeps trying ~15 times over the default 30 s deadline: against a store that
    # sheds half its requests (0.5^15) nearly every call is answered. Each pause is still long enough
    # that a throttled fleet backs off (the throttled base, 0.5 s, doubles to the cap in two steps).
    max_delay_s: float = 2.0
    timeout_s: float | None = None  # the deadline of one call, retries included (deadline.py); None: none
    endpoint: str | None = None  # the S3 endpoint given (--endpoint-url), named when it does not answer as S3
    throttled_delay_s: float = 0.5

    def delay(self, attempt: int, throttled: bool = False) -> float:
        """The pause after failed attempt number `attempt` (0 for the first): between half and all of the
        base delay doubled per attempt, capped at max_delay_s."""
        base = self.throttled_delay_s if throttled else self.base_delay_s
        capped = min(self.max_delay_s, base * (2 ** min(attempt, 30)))
        return capped * (0.5 + random.random() / 2)

    def call(
        self,
        fn: Callable[[], T],
        url: str,
        extra_s: float = 0.0,
        kind: str = "",
        stats: RequestStats | None = None,
    ) -> T:
        """fn() with retries, all within the deadline: timeout_s, plus extra_s for a call that moves much
        data (an upload's time grows with its size; a hung backend still ends it). A call that needed
        retries (an episode) is counted into `stats` as `kind` and said in one line at INFO when it ends."""
        timeout_s = None if self.timeout_s is None else self.timeout_s + extra_s
        limit = self.attempts or (ATTEMPTS_WITHOUT_DEADLINE if timeout_s is None else None)
        episode = Episode(url, kind, time.monotonic())
        with deadline(timeout_s) as at:
            while True:
                episode.attempts += 1
                try:
                    result = fn()
                except BaseException as exc:
                    if not is_temporary(exc):
                        episode.end(stats, exc)
                        raise permanent_error(exc, url, self.endpoint) from exc
                    cause = failure_cause(exc)
                    episode.failures[cause] = episode.failures.get(cause, 0) + 1
                    episode.refused_in_row = episode.refused_in_row + 1 if is_refused(exc) else 0
                    left = None if at is None else at - time.monotonic()
                    pause = self.delay(episode.attempts - 1, cause == THROTTLED)
                    if left is not None and left <= LAST_ATTEMPT_S:
                        episode.end(stats, exc)
                        if cause == TIMED_OUT:
                            raise BackendTimeoutError(url, timeout_s or 0.0, describe(exc)) from exc
                        raise episode.unavailable(exc, timeout_s) from exc
                    if (limit is not None and episode.attempts >= limit) or (
                        episode.refused_in_row >= REFUSED_ATTEMPTS
                    ):
                        episode.end(stats, exc)
                        raise episode.unavailable(exc, timeout_s) from exc
                    if left is not None:
                        pause = min(pause, left - LAST_ATTEMPT_S)
                    log.debug("temporary failure on %s (%s); retrying in %.2fs", url, describe(exc), pause)
                    time.sleep(pause)
                else:
                    episode.end(stats, None)
                    return result


@dataclass
class Episode:
    """The attempts of one call: those that needed retries are counted and logged once, when they end."""

    url: str
    kind: str
    started: float
    attempts: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # cause -> failed attempts
    refused_in_row: int = 0  # the last attempts' connections refused (REFUSED_ATTEMPTS)

    def end(self, stats: RequestStats | None, error: BaseException | None) -> None:
        if not self.failures:
            return
        if stats is not None:  # a call that failed at its first attempt too (a timeout that took it all)
            stats.record_retries(self.kind, self.attempts - 1, self.failures)
        if self.attempts <= 1:
            return
        what = self.kind.upper() or "call"
        seconds = time.monotonic() - self.started
        causes = ", ".join(f"{n} {CAUSE_WORDS[cause]}" for cause, n in sorted(self.failures.items()))
        if error is None:
            log.info("%s: %s answered after %d attempts in %.1f s (%s)", self.url, what, self.attempts,
                     seconds, causes)  # fmt: skip
        else:
            log.info("%s: %s failed after %d attempts in %.1f s (%s): %s", self.url, what, self.attempts,
                     seconds, causes, describe(error))  # fmt: skip

    def unavailable(self, exc: BaseException, timeout_s: float | None) -> BackendUnavailableError:
        within = f" (--backend-timeout {timeout_s:g} s)" if timeout_s is not None else ""
        return BackendUnavailableError(
            f"{self.url}: backend unavailable after {self.attempts} attempts: {describe(exc)}{within}"
        )


CAUSE_WORDS = {
    THROTTLED: "throttled",
    TIMED_OUT: "timed out",
    RESET: "reset",
    SERVER_ERROR: "server errors",
    OTHER: "other",
}

RESET_NAMES = {
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ClientPayloadError",
    "IncompleteReadError",
    "ResponseStreamingError",
    "ClientOSError",
}
TIMEOUT_NAMES = {"ConnectTimeoutError", "ReadTimeoutError", "ServerTimeoutError", "FSTimeoutError"}


def failure_cause(exc: BaseException) -> str:
    """What ended a failed attempt (of a temporary failure): throttled, timed out, reset, a server error."""
    status, code = _http_status(exc)
    if status in (429, 503) or code in THROTTLING_CODES:
        return THROTTLED
    if status is not None and status >= 500:
        return SERVER_ERROR
    names = {cls.__name__ for cls in type(exc).__mro__}
    if isinstance(exc, TimeoutError) or names & TIMEOUT_NAMES:
        return TIMED_OUT
    if isinstance(exc, ConnectionError) or names & RESET_NAMES:
        return RESET
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:  # s3fs's OSError raised from botocore's or aiohttp's
        found = failure_cause(cause)
        if found != OTHER:
            return found
    return OTHER


def is_refused(exc: BaseException) -> bool:
    """Whether the attempt's connection was refused or could not be made at all (botocore's
    EndpointConnectionError, aiohttp's ClientConnectorError), here or down the error's chain."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError) or type(seen).__name__ in CONNECT_ERROR_NAMES:
            return True
        if isinstance(seen, OSError) and seen.errno == errno.ECONNREFUSED:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


CONNECT_ERROR_NAMES = {"EndpointConnectionError", "ClientConnectorError"}


def is_temporary(exc: BaseException) -> bool:
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return False
    if isinstance(exc, PERMANENT_ERRORS):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    status, code = _http_status(exc)
    if status is not None:
        return status >= 500 or status == 429 or code in TEMPORARY_ERROR_CODES | THROTTLING_CODES
    if isinstance(exc, OSError):
        return exc.errno not in PERMANENT_ERRNOS
    # botocore and aiohttp connection/timeout errors are not OSErrors; recognise them by name.
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & (RESET_NAMES | TIMEOUT_NAMES))


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


def _is_bucket_root(url: str) -> bool:
    """s3://bucket (or s3://bucket/): a listing of it fails only when there is no such bucket."""
    scheme, _, rest = url.partition("://")
    bucket = rest.strip("/")
    return scheme in ("s3", "s3a") and bool(bucket) and "/" not in bucket


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
        if _is_bucket_root(url):  # a bucket that exists lists, if empty
            return FileNotFoundError(errno.ENOENT, f"{url}: the bucket does not exist")
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
