"""Edges of a real mount (issue 43, point 5): keys a folder tree cannot hold as they are (an object `a` beside
objects under `a/`), the cache directory deleted under a live mount, and `pffs umount` letting go of the
cache's file system. Real FUSE mounts over the SeaweedFS S3 server, bytes checked by sha256."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3fs
from helpers import pattern, pffs_fs, server_options, sha256
from mounts import Mount, drop_page_cache
from test_mount import env_for, new_bucket

from pffs.backends.urls import open_backend
from pffs.testing.s3_server import SeaweedS3
from pffs.vfs.namespace import staged_info
from pffs.vfs.staging import Staging

pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse (FUSE) on this machine"),
]

MIB = 1 << 20


def s3_mount(server: SeaweedS3, bucket: str, tmp_path: Path, *extra: str, name: str = "mnt") -> Mount:
    env = env_for(server)
    return Mount(
        f"s3://{bucket}",
        tmp_path / name,
        tmp_path / "cache",
        env,
        "--endpoint-url",
        server.endpoint_url,
        *extra,
    )


# Shadowed keys: a directory hides a file of the same name (Mountpoint for S3's rule)


@pytest.mark.parametrize("mode", [(), ("--read-only",)], ids=["read-write", "read-only"])
def test_a_directory_hides_the_object_of_its_name_in_lookups_stats_and_listings(
    mode: tuple[str, ...], s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    bucket = new_bucket(raw_s3)
    files = {
        "a": pattern(1000, seed=1),  # hidden by the directory a/
        "a/b": pattern(5 * MIB + 17, seed=2),  # more than one 4 MiB block
        "a/c/d": pattern(4096, seed=3),
        "s": pattern(77, seed=4),  # hidden by s/, which is listed before it is looked up
        "s/t": pattern(300_000, seed=5),
        "plain": pattern(123, seed=6),
    }
    raw_s3.pipe({f"{bucket}/{key}": value for key, value in files.items()})
    with s3_mount(s3_server, bucket, tmp_path, *mode) as mount:
        # Looked up by path first (no listing of the root yet: a HEAD finds the object `a`)
        data = (mount.path / "a" / "b").read_bytes()
        assert sha256(data) == sha256(files["a/b"])
        assert stat.S_ISDIR(os.stat(mount.path / "a").st_mode)
        assert sorted(os.listdir(mount.path / "a")) == ["b", "c"]
        assert sha256((mount.path / "a" / "c" / "d").read_bytes()) == sha256(files["a/c/d"])
        # Listed first: each name once, the directory wins
        names = os.listdir(mount.path)
        assert sorted(names) == ["a", "plain", "s"], names
        kinds = {e.name: e.is_dir(follow_symlinks=False) for e in os.scandir(mount.path)}
        assert kinds == {"a": True, "plain": False, "s": True}
        assert stat.S_ISDIR(os.stat(mount.path / "s").st_mode)
        assert sha256((mount.path / "s" / "t").read_bytes()) == sha256(files["s/t"])
        assert sha256((mount.path / "plain").read_bytes()) == sha256(files["plain"])
        with pytest.raises(IsADirectoryError):
            (mount.path / "a").read_bytes()
        walked = sorted(
            os.path.relpath(os.path.join(top, f), mount.path)
            for top, _, found in os.walk(mount.path)
            for f in found
        )
        assert walked == ["a/b", "a/c/d", "plain", "s/t"]
        log = mount.log()
        assert "changed in the store" not in log and "a bug" not in log, log
    # A mount of the prefix a/: the directory, not the object
    env, where = env_for(s3_server), ("--endpoint-url", s3_server.endpoint_url)
    with Mount(f"s3://{bucket}/a", tmp_path / "sub", tmp_path / "cache", env, *where, *mode) as mount:
        assert sorted(os.listdir(mount.path)) == ["b", "c"]
        assert sha256((mount.path / "b").read_bytes()) == sha256(files["a/b"])
    # The SDK reads keys, not a folder tree: both the object `a` and `a/b`
    sdk = pffs_fs(f"s3://{bucket}", tmp_path / "sdk-cache", **server_options(s3_server))
    assert sha256(sdk.cat_file("a")) == sha256(files["a"])
    assert sha256(sdk.cat_file("a/b")) == sha256(files["a/b"])


def test_the_hidden_object_shows_again_once_nothing_is_stored_under_its_name(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    bucket = new_bucket(raw_s3)
    raw_s3.pipe({f"{bucket}/x": b"the object x", f"{bucket}/x/y": b"under x"})
    with s3_mount(s3_server, bucket, tmp_path, "--read-only", "--dir-ttl", "0", "--attr-ttl", "0") as mount:
        assert (mount.path / "x" / "y").read_bytes() == b"under x"
        raw_s3.rm(f"{bucket}/x/y")
        deadline = time.monotonic() + 30
        while os.path.isdir(mount.path / "x") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (mount.path / "x").read_bytes() == b"the object x"
        assert os.listdir(mount.path) == ["x"]


def test_keys_a_folder_tree_cannot_show_break_nothing(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """A folder marker with bytes in it, a marker beside an object of its name, doubled slashes: the mount
    lists and reads what it shows, and logs no bug."""
    bucket = new_bucket(raw_s3)
    raw_s3.pipe(
        {
            f"{bucket}/t": b"object t",
            f"{bucket}/t/": b"",
            f"{bucket}/w/": b"a marker with bytes",
            f"{bucket}/u//v": b"two slashes",
            f"{bucket}/ok": b"fine",
        }
    )
    with s3_mount(s3_server, bucket, tmp_path) as mount:
        shown: dict[str, bytes | None] = {}
        for top, dirs, found in os.walk(mount.path):
            for name in found:
                path = os.path.join(top, name)
                shown[os.path.relpath(path, mount.path)] = Path(path).read_bytes()
            for name in dirs:
                shown[os.path.relpath(os.path.join(top, name), mount.path) + "/"] = None
        assert shown["ok"] == b"fine"
        assert shown.get("u/v") == b"two slashes" or "u//v" not in shown
        assert "w/" in shown  # a folder, empty
        assert ("t" in shown) != ("t/" in shown), shown  # one or the other, never both
        assert len(os.listdir(mount.path)) == len(set(os.listdir(mount.path)))
        log = mount.log()
        assert "a bug" not in log and "Traceback" not in log, log


# The cache directory deleted under a live mount


def delete(folder: Path) -> None:
    """rm -rf, again while the mount writes in it (its stats, a lock file) as it goes."""
    deadline = time.monotonic() + 30
    while folder.exists():
        try:
            shutil.rmtree(folder)
        except OSError:
            if time.monotonic() > deadline:
                raise


def test_a_cache_directory_deleted_under_the_mount_is_made_again_and_df_and_umount_work(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    bucket = new_bucket(raw_s3)
    files = {f"f{i}": pattern(3 * MIB + i, seed=10 + i) for i in range(3)}
    raw_s3.pipe({f"{bucket}/{key}": value for key, value in files.items()})
    mount = s3_mount(s3_server, bucket, tmp_path)
    with mount:
        assert sha256((mount.path / "f0").read_bytes()) == sha256(files["f0"])  # on disk in the cache
        fd = os.open(mount.path / "open-for-writing", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"staged in the directory deleted")
        delete(mount.cache_dir)
        with pytest.raises(OSError) as lost:
            os.close(fd)  # staged in the folder deleted: lost with it, and close says so
        assert lost.value.errno == errno.EIO
        df = subprocess.run(["df", str(mount.path)], capture_output=True, text=True, timeout=60)
        assert df.returncode == 0, df.stderr
        assert (mount.cache_dir / "staging").is_dir()  # made again
        drop_page_cache()
        for key, value in files.items():  # from the backend now (no disk cache), byte for byte
            assert sha256((mount.path / key).read_bytes()) == sha256(value), key
        (mount.path / "written").write_bytes(b"staged in the new directory")
        assert raw_s3.cat(f"{bucket}/written") == b"staged in the new directory"
        said = [line for line in mount.log().splitlines() if "was deleted under the mount" in line]
        assert len(said) == 1, mount.log()
        # Deleted again, and unmounted at once (no df first): pffs umount still finds the mount
        delete(mount.cache_dir)
        result = mount.umount()
        assert result.returncode == 0, result.stderr
        assert not os.path.ismount(mount.path)
        assert "unmounted" in mount.log()


# pffs umount lets go of the cache's file system


@contextlib.contextmanager
def tmpfs(path: Path) -> Iterator[Path]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        if os.path.ismount(path):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("slow_supervisor", [False, True], ids=["plain", "slow-supervisor"])
def test_after_pffs_umount_the_cache_file_system_unmounts_at_once(
    slow_supervisor: bool, s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """Its cache, staging, log and record on a file system of their own (a tmpfs): once `pffs umount`
    returns, no process of the mount holds a file there, so umount of it is not "target is busy". The
    supervisor, which holds the log open, exits just after the serving process: on a busy node that can
    take a while (here: stopped for 2 s while pffs umount runs)."""
    bucket = new_bucket(raw_s3)
    data = pattern(2 * MIB + 5, seed=21)
    raw_s3.pipe(f"{bucket}/data", data)
    with tmpfs(tmp_path / "cachefs") as cachefs:
        # the log (which the supervisor holds open) lands beside the cache, on the tmpfs too
        mount = Mount(
            f"s3://{bucket}",
            tmp_path / "mnt",
            cachefs / "cache",
            env_for(s3_server),
            "--endpoint-url",
            s3_server.endpoint_url,
        )
        resume: threading.Timer | None = None
        try:
            mount.start()
            assert mount.pid is not None
            assert sha256((mount.path / "data").read_bytes()) == sha256(data)
            (mount.path / "out").write_bytes(b"x" * 1000)
            supervisor = parent_of(mount.pid)
            assert b"mount-supervisor" in Path(f"/proc/{supervisor}/cmdline").read_bytes()
            if slow_supervisor:
                os.kill(supervisor, signal.SIGSTOP)
                resume = threading.Timer(2.0, os.kill, (supervisor, signal.SIGCONT))
                resume.start()
            result = mount.umount()
            assert result.returncode == 0, result.stderr
            busy = subprocess.run(["umount", str(cachefs)], capture_output=True, text=True)
            assert busy.returncode == 0, busy.stderr
        finally:
            if resume is not None:
                resume.cancel()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(supervisor, signal.SIGCONT)
            mount.kill()
    assert raw_s3.cat(f"{bucket}/out") == b"x" * 1000


def test_a_stat_racing_the_last_close_never_measures_a_reused_descriptor(tmp_path: Path) -> None:
    """A getattr that finds a file being written just as its last close uploads and drops the staged copy
    (seen in CI as rsync's chown failing with EBADF): the dropped copy answers None, so the stored object
    answers instead, and never through whatever file the next open gave the closed descriptor's number."""
    store = tmp_path / "store"
    store.mkdir()
    backend, root = open_backend(str(store))
    staging = Staging(tmp_path / "staging", backend)
    staged = staging.create(f"{root}/f")
    staged.write(0, b"written")
    assert staged_info(staged) is not None and staged.size() == len(b"written")
    number = staged.fd
    staging.release(staged)
    assert (store / "f").read_bytes() == b"written"
    other = tmp_path / "other"
    other.write_bytes(pattern(4096))
    reused = os.open(other, os.O_RDONLY)
    try:
        assert reused == number, "the next open did not reuse the descriptor's number; the check says nothing"
        assert staged.size() is None
        assert staged_info(staged) is None
        with pytest.raises(OSError) as raised:
            staged.read(0, 10)
        assert raised.value.errno == errno.EBADF
    finally:
        os.close(reused)
