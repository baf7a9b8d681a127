"""One open reads one version, through the mount, whatever other writers do to the object meanwhile.

The cases the reference model (test_mount_model.py) found, as plain tests. The kernel keeps its page cache
per inode: the mount gives each version written by someone else its own inode number, so an old handle's
cached pages can never be the new version's (issue 29: one handle read 1 MiB of A, then 11 MiB of B).
"""

from __future__ import annotations

import errno
import os
import time
import uuid
from pathlib import Path

import pytest
import s3fs
from helpers import pattern, pffs_fs, server_options, sha256
from mounts import mounted

from pffs.testing.s3_server import SeaweedS3

BLOCK = 64 << 10
pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse (FUSE) on this machine"),
]


def read_rest(fd: int) -> bytes | None:
    """The rest of an open file, or None if the mount said its version is gone (ESTALE)."""
    parts = []
    try:
        while chunk := os.read(fd, 1 << 20):
            parts.append(chunk)
    except OSError as exc:
        assert exc.errno == errno.ESTALE, exc
        return None
    return b"".join(parts)


@pytest.mark.parametrize("mode", ["--read-only", "--fixed-modes"])
def test_a_handle_open_before_an_overwrite_never_reads_the_new_version(
    mode: str, s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """The issue's trial: f reads the head of A; B replaces A in S3; after the TTL g opens and reads B
    whole, filling the page cache; then f reads on. f must see the rest of A (or ESTALE), never B."""
    bucket = f"ver-{uuid.uuid4().hex[:10]}"
    raw_s3.mkdir(bucket)
    old, new = pattern(40 * BLOCK, seed=1), pattern(40 * BLOCK + 100, seed=2)
    raw_s3.pipe(f"{bucket}/mix/obj.bin", old)
    extra = (mode, "--dir-ttl", "0.5", "--attr-ttl", "0.3", "--block-size", "64K")
    with mounted(f"s3://{bucket}", tmp_path, s3_env, "--endpoint-url", s3_server.endpoint_url, *extra) as m:
        path = m.path / "mix" / "obj.bin"
        f = os.open(path, os.O_RDONLY)
        try:
            head = os.read(f, BLOCK)
            raw_s3.pipe(f"{bucket}/mix/obj.bin", new)
            time.sleep(1.0)  # past both TTLs: the next open must see B
            g = os.open(path, os.O_RDONLY)
            try:
                assert sha256(read_rest(g) or b"") == sha256(new)
                assert os.fstat(g).st_size == len(new)
            finally:
                os.close(g)
            assert os.fstat(f).st_size == len(old), "the old handle's file changed size under it"
            rest = read_rest(f)
            if rest is not None:
                assert sha256(head + rest) == sha256(old), "one handle read bytes of two versions"
        finally:
            os.close(f)
        assert sha256(path.read_bytes()) == sha256(new)


def test_a_new_open_sees_the_new_version_while_the_kernel_still_trusts_the_old_name(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """A long --attr-ttl and a short --dir-ttl: the kernel still holds the name's old inode when the mount
    learns of B. The open is refused with ESTALE inside the kernel, which looks the name up again and opens
    B's inode: the caller sees B, the old handle A."""
    bucket = f"ver-{uuid.uuid4().hex[:10]}"
    raw_s3.mkdir(bucket)
    old, new = pattern(8 * BLOCK, seed=3), pattern(5 * BLOCK + 7, seed=4)
    raw_s3.pipe(f"{bucket}/obj.bin", old)
    extra = ("--read-only", "--dir-ttl", "0.3", "--attr-ttl", "60", "--block-size", "64K")
    with mounted(f"s3://{bucket}", tmp_path, s3_env, "--endpoint-url", s3_server.endpoint_url, *extra) as m:
        path = m.path / "obj.bin"
        with open(path, "rb", buffering=0) as f:
            head = f.read(BLOCK)
            old_inode = os.fstat(f.fileno()).st_ino
            raw_s3.pipe(f"{bucket}/obj.bin", new)
            time.sleep(0.6)
            with open(path, "rb", buffering=0) as g:
                assert sha256(g.read()) == sha256(new)
                assert os.fstat(g.fileno()).st_ino != old_inode
            rest = read_rest(f.fileno())
            if rest is not None:
                assert sha256(head + rest) == sha256(old)


# Found by the model (read-write, long TTLs): a handle on an object deleted meanwhile got ENOENT (mount and
# SDK), and `> file` on a name deleted elsewhere, while the kernel still knew it, failed with ENOENT.


def test_a_handle_on_an_object_deleted_meanwhile_reads_it_or_gets_estale(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, s3_env: dict[str, str], tmp_path: Path
) -> None:
    bucket = f"ver-{uuid.uuid4().hex[:10]}"
    raw_s3.mkdir(bucket)
    data = pattern(48 * BLOCK, seed=5)
    raw_s3.pipe(f"{bucket}/obj.bin", data)
    tail = len(data) - 100
    extra = ("--read-only", "--block-size", "64K", "--memory-cache-size", "64K")
    with mounted(f"s3://{bucket}", tmp_path, s3_env, "--endpoint-url", s3_server.endpoint_url, *extra) as m:
        fd = os.open(m.path / "obj.bin", os.O_RDONLY)
        sdk = pffs_fs(f"s3://{bucket}", tmp_path / "sdk-cache", block_size="64K", **server_options(s3_server))
        try:
            with sdk.open("obj.bin", "rb") as f:
                assert os.pread(fd, 4096, 0) == data[:4096]
                assert f.read(4096) == data[:4096]
                raw_s3.rm(f"{bucket}/obj.bin")
                with pytest.raises(OSError) as mount_error:
                    os.pread(fd, 100, tail)  # never read: not in any cache
                assert mount_error.value.errno == errno.ESTALE
                f.seek(tail)
                with pytest.raises(OSError) as sdk_error:
                    f.read(100)
                assert sdk_error.value.errno == errno.ESTALE
        finally:
            os.close(fd)


def test_writing_a_name_deleted_elsewhere_makes_it_anew(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, s3_env: dict[str, str], tmp_path: Path
) -> None:
    bucket = f"ver-{uuid.uuid4().hex[:10]}"
    raw_s3.mkdir(bucket)
    raw_s3.pipe(f"{bucket}/keep", b"k")
    extra = ("--attr-ttl", "60", "--dir-ttl", "60")
    with mounted(f"s3://{bucket}", tmp_path, s3_env, "--endpoint-url", s3_server.endpoint_url, *extra) as m:
        (m.path / "a").write_bytes(b"first")
        raw_s3.rm(f"{bucket}/a")
        (m.path / "a").write_bytes(b"second")  # the kernel still knows "a": an open with O_TRUNC
        assert raw_s3.cat(f"{bucket}/a") == b"second"
        assert (m.path / "a").read_bytes() == b"second"
