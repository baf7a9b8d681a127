"""pffs's own S3 GET client (pffs.backends.s3_native) against the AWS signing example and a real S3 server:
the same bytes as s3fs, version pinning, errors, reconnection after the server restarts."""

from __future__ import annotations

import calendar
import time
from pathlib import Path
from typing import Any

import pytest
import s3fs
from helpers import pattern, sha256

from pffs.backends import ObjectChangedError
from pffs.backends.backend import S3Backend
from pffs.backends.options import BackendOptions
from pffs.backends.s3_native import Credentials, SigV4
from pffs.backends.urls import open_backend
from pffs.testing.s3_server import SeaweedS3


def test_signature_matches_the_aws_documentation_example() -> None:
    # The GET Object example of Amazon S3's "Authenticating Requests (AWS Signature Version 4)".
    now = calendar.timegm(time.strptime("20130524T000000Z", "%Y%m%dT%H%M%SZ"))
    creds = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    headers = SigV4("us-east-1").sign(
        creds, "examplebucket.s3.amazonaws.com", "/test.txt", "", {"range": "bytes=0-9"}, now
    )
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )
    assert "wJalrXUtnFEMI" not in repr(creds)


def _backend(server: SeaweedS3, native: bool, **options: Any) -> S3Backend:
    opts = BackendOptions(
        endpoint_url=server.endpoint_url,
        access_key_id=options.pop("key", server.access_key),
        secret_access_key=options.pop("secret", server.secret_key),
        native_s3_gets=native,
    )
    backend, _ = open_backend("s3://unused", opts)
    assert isinstance(backend, S3Backend)
    return backend


def test_native_gets_read_the_same_bytes_as_s3fs(raw_s3: Any, bucket: str, s3_server: SeaweedS3) -> None:
    data = pattern(3 * 1024 * 1024 + 11, seed=40)
    raw_s3.pipe(f"{bucket}/dir/a b+c.bin", data)  # a key that needs URL encoding
    native, plain = _backend(s3_server, True), _backend(s3_server, False)
    info = native.stat(f"{bucket}/dir/a b+c.bin")
    ranges = [(0, 1), (0, len(data)), (1 << 20, (2 << 20) + 5), (len(data) - 7, len(data))]
    for start, end in ranges:
        got = native.read_range(info, start, end)
        assert sha256(bytes(got)) == sha256(plain.read_range(info, start, end)) == sha256(data[start:end])
    assert native.native_gets and native._native is not None  # it did not fall back
    assert native.requests.snapshot()["get"]["requests"] == len(ranges)
    into = memoryview(bytearray(100))
    assert native.read_range(info, 5, 105, into=into) is into and bytes(into) == data[5:105]


def test_native_gets_stay_pinned_to_the_version_opened(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3
) -> None:
    raw_s3.pipe(f"{bucket}/k", pattern(1000, seed=1))
    backend = _backend(s3_server, True)
    old = backend.stat(f"{bucket}/k")
    raw_s3.pipe(f"{bucket}/k", pattern(1000, seed=2))  # same size, new ETag
    with pytest.raises(ObjectChangedError, match=f"s3://{bucket}/k"):
        backend.read_range(old, 0, 1000)


def test_native_gets_report_missing_objects_and_bad_credentials_clearly(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3
) -> None:
    raw_s3.pipe(f"{bucket}/k", b"0123456789")
    info = _backend(s3_server, True).stat(f"{bucket}/k")
    raw_s3.rm(f"{bucket}/k")
    # A read of a version is pinned to it: the version gone is ESTALE ("open it again"), not ENOENT.
    with pytest.raises(ObjectChangedError, match=f"s3://{bucket}/k"):
        _backend(s3_server, True).read_range(info, 0, 10)

    raw_s3.pipe(f"{bucket}/k", b"0123456789")
    bad = _backend(s3_server, True, secret="wrong-secret-456")
    with pytest.raises(PermissionError) as err:
        bad.read_range(info, 0, 10)
    assert "access denied" in str(err.value) and "wrong-secret-456" not in str(err.value)


def test_native_gets_reconnect_after_the_server_restarts(tmp_path: Path) -> None:
    with SeaweedS3(tmp_path / "own-server") as server:
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        raw.mkdir("restart")
        data = pattern(200_000, seed=3)
        raw.pipe("restart/k", data)
        backend = _backend(server, True)
        info = backend.stat("restart/k")
        assert bytes(backend.read_range(info, 0, 1000)) == data[:1000]  # a kept-alive connection now
        server.stop()
        server.start()  # same ports: the kept connection is dead, a new one must be made
        assert sha256(bytes(backend.read_range(info, 0, len(data)))) == sha256(data)
        assert backend.native_gets


def test_native_heads_give_what_botocore_gives_attributes_included(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3
) -> None:
    """A read-write mount asks a HEAD of every file it shows (for the attributes stored with it): through
    the native client, with the same answer as botocore's, and the same errors."""
    from pffs.backends.posix_metadata import PosixAttributes

    attributes = PosixAttributes(mode=0o100640, uid=1234, gid=56, mtime_ns=1_614_834_367_123_456_789)
    native, plain = _backend(s3_server, True), _backend(s3_server, False)
    native.write_bytes(f"{bucket}/dir/with attrs.bin", b"x" * 1000, attributes)
    raw_s3.pipe(f"{bucket}/dir/plain.bin", b"y" * 77)
    first = native.stat(f"{bucket}/dir/plain.bin")  # before any GET: through s3fs (see _head_object)
    native.read_range(first, 0, 77)  # the GET that makes the native client in this process
    assert native._native is not None
    heads: list[str] = []
    native_head = native._native.head
    native._native.head = lambda b, k: heads.append(k) or native_head(b, k)  # type: ignore[method-assign]
    for name in ("dir/with attrs.bin", "dir/plain.bin"):
        path = f"{bucket}/{name}"
        assert native.stat(path) == plain.stat(path)
    info = native.stat(f"{bucket}/dir/with attrs.bin")
    assert info.posix == attributes and info.size == 1000
    assert heads == ["dir/with attrs.bin", "dir/plain.bin", "dir/with attrs.bin"]  # all native
    assert native.native_gets  # it did not fall back
    assert native.stat(f"{bucket}/dir").is_dir  # a prefix: the HEAD's 404, then one LIST
    with pytest.raises(FileNotFoundError, match="no such file"):
        native.stat(f"{bucket}/dir/missing.bin")
    bad = _backend(s3_server, True, secret="wrong-secret-456")
    with pytest.raises(PermissionError) as err:
        bad.stat(f"{bucket}/dir/plain.bin")
    assert "wrong-secret-456" not in str(err.value)


def test_a_plain_setup_reads_and_heads_without_making_s3fs_client(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3
) -> None:
    """Keys given and an endpoint on an IP address leave botocore nothing to decide: the native client is
    set up from the options alone, and a stat and a read of an object make no s3fs client (what keeps
    `pffs cat` of a cached object from importing botocore and aiohttp)."""
    data = pattern(300_000, seed=41)
    raw_s3.pipe(f"{bucket}/p/x y.bin", data)
    native = _backend(s3_server, True)
    assert native._plain_ok
    info = native.stat(f"{bucket}/p/x y.bin")
    assert sha256(bytes(native.read_range(info, 0, len(data)))) == sha256(data)
    assert native._fs is None  # no s3fs client was made
    assert info == _backend(s3_server, False).stat(f"{bucket}/p/x y.bin")  # as s3fs sees it
    with pytest.raises(FileNotFoundError):
        native.stat(f"{bucket}/p/missing.bin")
    snapshot = native.requests.snapshot()
    assert (snapshot["head"]["requests"], snapshot["get"]["requests"], snapshot["list"]["requests"]) == (
        2,
        1,
        1,
    )
    assert snapshot["head"]["not_found"] == 1  # the missing one: its HEAD's 404, then a LIST for a prefix
    assert native.find(f"{bucket}/p")[0].path == f"{bucket}/p/x y.bin"  # listings: through s3fs, alike


@pytest.mark.parametrize(
    ("endpoint", "env", "keys", "plain"),
    [
        ("http://127.0.0.1:8333", {}, True, True),
        ("http://localhost:8333", {"AWS_REGION": "eu-west-1"}, True, True),
        ("http://[::1]:8333", {}, True, True),
        ("http://127.0.0.1:8333", {"AWS_ACCESS_KEY_ID": "A", "AWS_SECRET_ACCESS_KEY": "S"}, False, True),
        ("http://127.0.0.1:8333", {}, False, False),  # keys from botocore's other sources: its choice
        ("http://127.0.0.1:8333", {"AWS_PROFILE": "team"}, True, False),
        ("http://127.0.0.1:8333", {"AWS_CONFIG_FILE": "/etc/aws.conf"}, True, False),
        ("http://127.0.0.1:8333", {"http_proxy": "http://proxy:3128"}, True, False),
        ("https://127.0.0.1:8333", {}, True, False),  # TLS settings are botocore's
        ("http://minio.internal:9000", {}, True, False),  # a host name: botocore picks the addressing
        (None, {}, True, False),  # AWS itself: regions, redirects
    ],
)
def test_the_plain_native_client_only_where_botocore_would_decide_nothing(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    endpoint: str | None,
    env: dict[str, str],
    keys: bool,
    plain: bool,
) -> None:
    from pffs.backends.s3_native import plain_getter

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws/config
    cleared = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
               "AWS_CONFIG_FILE", "http_proxy", "HTTP_PROXY", "AWS_REGION", "AWS_DEFAULT_REGION")  # fmt: skip
    for name in cleared:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    creds = Credentials("key", "secret") if keys else None
    assert (plain_getter(endpoint, None, creds, False, 5.0, 30.0) is not None) == plain
    if plain:
        assert plain_getter(endpoint, None, None, True, 5.0, 30.0) is not None  # anonymous
