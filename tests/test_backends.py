"""URLs, options, identities and the retry policy."""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

import pytest

from pffs.backends import BackendUnavailableError, RetryPolicy, UnknownSchemeError, open_backend, split_url
from pffs.backends.identity import identity_token
from pffs.backends.retry import is_temporary
from pffs.config import CacheSettings, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10G", 10 << 30),
        ("512M", 512 << 20),
        ("4MiB", 4 << 20),
        ("1.5K", 1536),
        ("4096", 4096),
        (" 2 g ", 2 << 30),
    ],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["12Q", "", "-1G", "G", "1e3M"])
def test_bad_sizes_say_what_a_size_looks_like(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_settings_reject_unknown_fields_and_silly_block_sizes() -> None:
    with pytest.raises(ValueError, match="block_size"):
        CacheSettings(block_size="1K")
    with pytest.raises(ValueError, match="extra"):
        CacheSettings(cache_sise="1G")  # type: ignore[call-arg]
    assert CacheSettings(block_size="8M", cache_size="1G").block_size == 8 << 20


def test_split_url_handles_paths_and_aliases() -> None:
    assert split_url("s3://bkt/a/b") == ("s3", "bkt/a/b")
    assert split_url("s3a://bkt/a") == ("s3", "bkt/a")
    assert split_url("/data/x")[0] == "file"
    assert split_url("relative/x")[1].startswith("/")
    assert split_url("memory://x") == ("memory", "x")


def test_open_backend_paths() -> None:
    backend, path = open_backend("s3://bkt/prefix/")
    assert (backend.protocol, path) == ("s3", "bkt/prefix")
    backend, path = open_backend("file:///tmp/../tmp/data")
    assert (backend.protocol, path) == ("file", "/tmp/data")
    backend, path = open_backend("webhdfs://namenode:9870/user/data")
    assert backend.protocol == "webhdfs" and path == "/user/data"


def test_unknown_scheme_names_the_scheme_and_the_choices() -> None:
    with pytest.raises(UnknownSchemeError, match=r"'nosuch'.*s3://"):
        open_backend("nosuch://x/y")
    with pytest.raises(UnknownSchemeError, match="not a URL"):
        open_backend("1bad://x")


def test_identities_change_with_etag_version_or_mtime() -> None:
    assert identity_token("s3", {"ETag": '"abc"'}) == "etag:abc"
    assert identity_token("s3", {"ETag": '"abc"', "VersionId": "v2"}) == "version:v2"
    assert identity_token("s3", {"ETag": '"abc"', "VersionId": "null"}) == "etag:abc"
    assert identity_token("file", {"mtime": 12.5}) != identity_token("file", {"mtime": 12.75})
    assert identity_token("hdfs", {}) == "unversioned"


class Flaky:
    """Fails with `error` the first `failures` calls, then returns 'ok'."""

    def __init__(self, error: BaseException, failures: int) -> None:
        self.error, self.failures, self.calls = error, failures, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


FAST = RetryPolicy(attempts=4, base_delay_s=0.001, max_delay_s=0.01)


@pytest.mark.parametrize(
    "error", [TimeoutError("timed out"), ConnectionResetError("reset"), OSError(errno.EIO, "500 Internal")]
)
def test_temporary_failures_are_retried(error: BaseException) -> None:
    flaky = Flaky(error, failures=2)
    assert FAST.call(flaky, "s3://bkt/k") == "ok"
    assert flaky.calls == 3


def test_retries_give_up_with_a_clear_error() -> None:
    flaky = Flaky(ConnectionRefusedError("refused"), failures=10)
    with pytest.raises(
        BackendUnavailableError, match=r"s3://bkt/k: backend unavailable after 4 attempts: refused"
    ):
        FAST.call(flaky, "s3://bkt/k")
    assert flaky.calls == 4


@pytest.mark.parametrize(
    ("error", "kind", "message"),
    [
        (FileNotFoundError(errno.ENOENT, "nope"), FileNotFoundError, "s3://bkt/k: no such file"),
        (
            FileNotFoundError("The specified bucket does not exist"),
            FileNotFoundError,
            "bucket does not exist",
        ),
        (PermissionError(errno.EACCES, "Forbidden"), PermissionError, "access denied.*check the credentials"),
        (OSError(errno.EINVAL, "InvalidBucketName"), OSError, "s3://bkt/k: InvalidBucketName"),
    ],
)
def test_permanent_failures_fail_at_once_naming_the_url(
    error: BaseException, kind: type[BaseException], message: str
) -> None:
    flaky = Flaky(error, failures=10)
    with pytest.raises(kind, match=message):
        FAST.call(flaky, "s3://bkt/k")
    assert flaky.calls == 1


def test_backoff_is_capped() -> None:
    policy = RetryPolicy(attempts=10, base_delay_s=0.1, max_delay_s=0.3)
    assert max(policy.delay(i) for i in range(10)) <= 0.3
    start = time.monotonic()
    with pytest.raises(BackendUnavailableError):
        RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.02).call(Flaky(TimeoutError(), 9), "x")
    assert time.monotonic() - start < 5


def test_classification_of_botocore_errors_by_status() -> None:
    class ClientError(Exception):
        def __init__(self, status: int, code: str) -> None:
            self.response = {"ResponseMetadata": {"HTTPStatusCode": status}, "Error": {"Code": code}}

    assert is_temporary(ClientError(503, "SlowDown"))
    assert is_temporary(ClientError(500, "InternalError"))
    assert not is_temporary(ClientError(403, "AccessDenied"))
    assert not is_temporary(ClientError(400, "BadRequest"))


def test_an_upload_gets_time_for_its_size_beyond_the_backend_deadline(tmp_path: Path) -> None:
    """The deadline bounds a hung backend, not a large upload: put_file of 50 MiB under a 1 s deadline runs
    with 1 s + 50 MiB at SLOWEST_TRANSFER_RATE left (a 100 MiB checkpoint failed after 1.6 s before)."""
    from pffs.backends.backend import SLOWEST_TRANSFER_RATE
    from pffs.backends.deadline import timeout_left
    from pffs.backends.options import BackendOptions

    (tmp_path / "store").mkdir()
    backend, root = open_backend(f"file://{tmp_path}/store", BackendOptions(backend_timeout=1))
    seen: list[float] = []
    put_file = backend.fs.put_file

    def timed_put_file(*args: Any, **kwargs: Any) -> None:
        seen.append(timeout_left(3600))
        put_file(*args, **kwargs)

    backend.fs.put_file = timed_put_file  # type: ignore[method-assign]
    large = tmp_path / "large"
    with open(large, "wb") as f:
        f.truncate(50 << 20)
    backend.upload(str(large), f"{root}/large")
    assert 1 + (50 << 20) / SLOWEST_TRANSFER_RATE - 1 < seen[0] <= 1 + (50 << 20) / SLOWEST_TRANSFER_RATE
    small = tmp_path / "small"
    small.write_bytes(b"x")
    backend.upload(str(small), f"{root}/small")
    assert 0 < seen[1] <= 1  # a small upload: the deadline as it is
    assert (tmp_path / "store" / "large").stat().st_size == 50 << 20
