"""pffs's own S3 GET client (pffs.backends.s3_native) against the AWS signing example and a real S3 server:
the same bytes as s3fs, version pinning, errors, reconnection after the server restarts."""

from __future__ import annotations

import calendar
import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import s3fs
from helpers import pattern, sha256

from pffs.backends import ObjectChangedError
from pffs.backends.backend import S3Backend
from pffs.backends.deadline import deadline
from pffs.backends.options import BackendOptions
from pffs.backends.s3_native import Credentials, NativeS3Getter, SigV4
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


def test_http_gets_are_the_native_cores_and_survive_a_fork(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over http a GET is native/core/src/backends/s3_get.rs's (the Python wire code is never reached),
    and a child forked after the parent kept a connection makes its own: both read exact bytes."""
    data = pattern(5 * 1024 * 1024 + 3, seed=41)
    raw_s3.pipe(f"{bucket}/fork/k", data)
    backend = _backend(s3_server, True)
    info = backend.stat(f"{bucket}/fork/k")

    def no_python_wire(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the GET went through the Python client")

    monkeypatch.setattr(NativeS3Getter, "_exchange", staticmethod(no_python_wire))
    assert sha256(bytes(backend.read_range(info, 0, len(data)))) == sha256(data)  # keeps its connection
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own connection, exact bytes
        ok = sha256(bytes(backend.read_range(info, 7, len(data)))) == sha256(data[7:])
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1", "the forked child read wrong bytes or failed"
    os.waitpid(pid, 0)
    os.close(read)
    assert sha256(bytes(backend.read_range(info, 1, len(data) - 1))) == sha256(data[1:-1])


def test_a_native_get_from_a_server_that_never_answers_ends_at_the_deadline() -> None:
    """Connections accepted, never answered (a frozen gateway): the GET ends with TimeoutError when the
    call's deadline says, not at the read timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        port = listener.getsockname()[1]
        getter = NativeS3Getter(
            lambda bucket: f"http://127.0.0.1:{port}/{bucket}/",
            "us-east-1",
            lambda: Credentials("AKIA", "secret"),
            connect_timeout=5,
            read_timeout=60,
        )
        began = time.monotonic()
        with deadline(1.5), pytest.raises(TimeoutError):
            getter.get("b", "k", 0, memoryview(bytearray(10)))
        assert 1.4 < time.monotonic() - began < 10
    finally:
        stop.set()
        thread.join()
        listener.close()
        for sock in held:
            sock.close()


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


# Uploads: one PUT, or a multipart upload of parts sent at once (pffs.backends.backend.S3Backend.upload).

PART = 5 << 20  # S3's least part size: a few parts from small files


def _uploader(server: SeaweedS3, **options: Any) -> S3Backend:
    backend = _backend(server, True, **options)
    backend.upload_part_size = PART
    return backend


def _pending_uploads(raw_s3: Any, bucket: str) -> list[Any]:
    found = raw_s3.call_s3("list_multipart_uploads", Bucket=bucket)
    return list(found.get("Uploads", []))


@pytest.mark.parametrize("size", [0, 1000, PART, 2 * PART + 17, 7 * PART - 1])
def test_native_uploads_are_byte_exact_in_one_put_or_in_parts(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, tmp_path: Path, size: int
) -> None:
    """A file up to the part size goes in one PUT, a larger one in parts sent at once and completed in
    order; the object is the file, byte for byte, with the POSIX attributes given (read back by s3fs)."""
    from pffs.backends.posix_metadata import PosixAttributes

    data = pattern(size, seed=size % 251)
    local = tmp_path / "file"
    local.write_bytes(data)
    backend = _uploader(s3_server)
    backend.upload(str(local), f"{bucket}/up/plain.bin")
    assert sha256(raw_s3.cat_file(f"{bucket}/up/plain.bin")) == sha256(data)
    parts = -(-size // PART)
    assert backend.requests.snapshot()["put"]["requests"] == (1 if parts <= 1 else parts + 2)
    assert backend.native_puts and backend._fs is None  # native throughout: no s3fs client made
    attributes = PosixAttributes(mode=0o100600, uid=7, gid=8, mtime_ns=1_700_000_000_123_456_789)
    backend.upload(str(local), f"{bucket}/up/a file+.bin", attributes)
    assert sha256(raw_s3.cat_file(f"{bucket}/up/a file+.bin")) == sha256(data)
    assert backend.stat(f"{bucket}/up/a file+.bin").posix == attributes
    assert _pending_uploads(raw_s3, bucket) == []


def test_a_multipart_upload_that_fails_leaves_the_object_as_it_was_and_no_parts(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    """A part refused for good (here: access denied on part 3 of 6): the upload fails with that error,
    the object at the path is the previous one, byte for byte, and the parts sent are dropped."""
    old = pattern(3 * PART + 5, seed=1)
    raw_s3.pipe(f"{bucket}/ckpt.pt", old)
    local = tmp_path / "new"
    local.write_bytes(pattern(6 * PART - 3, seed=2))
    backend = _uploader(s3_server)
    native = backend._native_getter()
    assert native is not None
    send = native.upload_part

    def upload_part(bucket_: str, key: str, upload_id: str, number: int, body: Any) -> str:
        if number == 3:
            raise PermissionError(13, "injected: part 3 refused")
        return send(bucket_, key, upload_id, number, body)

    native.upload_part = upload_part  # type: ignore[method-assign]
    with pytest.raises(PermissionError, match="part 3 refused"):
        backend.upload(str(local), f"{bucket}/ckpt.pt")
    assert sha256(raw_s3.cat_file(f"{bucket}/ckpt.pt")) == sha256(old)
    assert _pending_uploads(raw_s3, bucket) == []  # aborted


def test_an_upload_cut_off_by_the_server_stopping_leaves_the_previous_object_exact(tmp_path: Path) -> None:
    """The S3 server stops while parts are being sent: the upload fails within its deadline, and once the
    server is back the object is the previous one, byte for byte (nothing was completed)."""
    with SeaweedS3(tmp_path / "own-server") as server:
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        raw.mkdir("stops")
        old = pattern(PART + 1, seed=3)
        raw.pipe("stops/ckpt.pt", old)
        local = tmp_path / "new"
        local.write_bytes(pattern(5 * PART, seed=4))
        opts = BackendOptions(
            endpoint_url=server.endpoint_url,
            access_key_id=server.access_key,
            secret_access_key=server.secret_key,
            backend_timeout=2,
        )
        backend, _ = open_backend("s3://stops", opts)
        assert isinstance(backend, S3Backend)
        backend.upload_part_size, backend.upload_concurrency = PART, 1
        native = backend._native_getter()
        assert native is not None
        send = native.upload_part

        def upload_part(bucket_: str, key: str, upload_id: str, number: int, body: Any) -> str:
            if number == 2 and server.process is not None and server.process.poll() is None:
                server.stop()
            return send(bucket_, key, upload_id, number, body)

        native.upload_part = upload_part  # type: ignore[method-assign]
        with pytest.raises(OSError, match=r"s3://stops/ckpt\.pt"):
            backend.upload(str(local), "stops/ckpt.pt")
        server.start()
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        assert sha256(raw.cat_file("stops/ckpt.pt")) == sha256(old)


def test_a_part_altered_on_the_way_is_refused_by_the_server_and_sent_again(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each part carries its Content-MD5: the server refuses bytes that do not match (BadDigest), and the
    part is sent again (here the first digest of part 2 is wrong); the object is exact."""
    from pffs.backends import s3_native

    data = pattern(3 * PART + 99, seed=5)
    local = tmp_path / "file"
    local.write_bytes(data)
    digest = s3_native.FileRange.md5
    wrong: list[int] = []

    def md5(self: Any) -> str:
        if self.offset == PART and not wrong:
            wrong.append(self.offset)
            return "AAAAAAAAAAAAAAAAAAAAAA=="
        return digest(self)

    monkeypatch.setattr(s3_native.FileRange, "md5", md5)
    backend = _uploader(s3_server)
    backend.upload(str(local), f"{bucket}/altered.bin")
    assert wrong == [PART]
    assert sha256(raw_s3.cat_file(f"{bucket}/altered.bin")) == sha256(data)
    assert backend.requests.snapshot()["put"]["requests"] == 4 + 2  # one part twice


def test_uploads_go_through_s3fs_where_the_native_client_cannot(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    from pffs.backends.s3_native import NotHandled

    data = pattern(2 * PART + 1, seed=6)
    local = tmp_path / "file"
    local.write_bytes(data)
    backend = _uploader(s3_server)
    native = backend._native_getter()
    assert native is not None

    def create(*args: Any) -> str:
        raise NotHandled("injected")

    native.create_multipart_upload = create  # type: ignore[method-assign]
    backend.upload(str(local), f"{bucket}/fallback.bin")
    assert not backend.native_puts
    assert sha256(raw_s3.cat_file(f"{bucket}/fallback.bin")) == sha256(data)


def test_native_listing_and_delete_see_what_s3fs_sees(raw_s3: Any, bucket: str, s3_server: SeaweedS3) -> None:
    """The LIST a DCP save's finish makes (names and sizes right under a folder, page after page) and the
    DELETE of its stale shards, through the native client: the same as s3fs sees, no s3fs client made."""
    names = ["a.bin", "b b.bin", "c&d<e>.bin", "f+g.bin", "h.distcp", "i", "j.json"]
    raw_s3.pipe({f"{bucket}/ck/{name}": b"x" * (i * 1000 + 1) for i, name in enumerate(names)})
    raw_s3.pipe(f"{bucket}/ck/sub/deeper.bin", b"y")  # a folder: not listed
    raw_s3.pipe(f"{bucket}/ckpt-other/k.bin", b"z")  # a sibling with the same prefix: not listed
    backend = _backend(s3_server, True)
    expected = {name: i * 1000 + 1 for i, name in enumerate(names)}
    assert backend.sizes_under(f"{bucket}/ck") == expected
    native = backend._native_getter()
    assert native is not None
    paged = native.list_sizes(bucket, "ck/", page=3)  # three pages
    assert paged == {f"ck/{name}": size for name, size in expected.items()}
    backend.remove(f"{bucket}/ck/c&d<e>.bin")
    backend.remove(f"{bucket}/ck/never-was.bin")  # S3 answers the same
    del expected["c&d<e>.bin"]
    assert backend.sizes_under(f"{bucket}/ck/") == expected
    assert backend._fs is None  # no s3fs client made
    assert sorted(raw_s3.ls(f"{bucket}/ck", detail=False)) == sorted(
        [f"{bucket}/ck/{name}" for name in expected] + [f"{bucket}/ck/sub"]
    )
