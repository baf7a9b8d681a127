"""POSIX attributes on S3 through the mount, for real: `rsync -a`, `cp -a` and `tar x` into a pffs mount
over SeaweedFS and back out keep modes, owners, times and bytes (sha256); a new mount with an empty cache
reads them back; s3fs-fuse reads what pffs stored and pffs what s3fs-fuse stored; the kernel enforces the
stored modes for another user; --fixed-modes and --read-only mounts show fixed modes from a LIST, with no
HEAD per file.

SeaweedFS keeps no metadata on a directory's marker object, so a new mount over it shows the default
mode of a directory (the mount that set it shows the one set): directories' attributes are compared in
the mount that set them, files' and symlinks' everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3fs
from helpers import pattern, poll, sha256
from mounts import Mount

from pffs.testing.s3_server import SeaweedS3

pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse (FUSE) on this machine"),
    pytest.mark.timeout(120),
]

NOBODY = 65534
NS = 1_000_000_000


def needs(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"needs {tool} (installed by `make setup`)")


def run(*command: str | Path) -> None:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{command} exited {done.returncode}: {done.stderr[-2000:]}"


def make_tree(root: Path) -> None:
    """Files of several sizes (one spans blocks), modes, owners and times with nanoseconds; a directory
    with its own mode and time; a symlink; an empty file."""
    root.mkdir()
    (root / "sub").mkdir()
    entries = {
        "private.bin": (pattern(300_000, seed=1), 0o600, 1234, 5678),
        "script.sh": (b"#!/bin/sh\necho hi\n", 0o755, 0, 0),
        "empty": (b"", 0o640, 42, 43),
        "sub/readonly.txt": (pattern(5000, seed=2), 0o444, 7, 8),
    }
    for number, (name, (data, mode, uid, gid)) in enumerate(entries.items()):
        path = root / name
        path.write_bytes(data)
        os.chown(path, uid, gid)
        os.chmod(path, mode)
        os.utime(path, ns=(1_600_000_000 * NS + number, 1_500_000_000 * NS + 123_456_789 + number))
    os.symlink("sub/readonly.txt", root / "link")
    os.utime(root / "link", ns=(1_400_000_000 * NS, 1_400_000_000 * NS + 5), follow_symlinks=False)
    os.chmod(root / "sub", 0o750)
    os.utime(root / "sub", ns=(1_300_000_000 * NS, 1_300_000_000 * NS + 999))


def tree_state(root: Path, *, dirs: bool = True) -> dict[str, tuple[object, ...]]:
    """Per entry under root: its type, permission bits, owner, group, mtime (ns) and content (sha256 of a
    file's bytes, a symlink's target)."""
    state: dict[str, tuple[object, ...]] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if stat.S_ISDIR(st.st_mode) and not dirs:
            continue
        if stat.S_ISREG(st.st_mode):
            content: object = hashlib.sha256(path.read_bytes()).hexdigest()
        elif stat.S_ISLNK(st.st_mode):
            content = os.readlink(path)
        else:
            content = None
        kind = stat.S_IFMT(st.st_mode)
        state[str(path.relative_to(root))] = (
            kind,
            oct(stat.S_IMODE(st.st_mode)),
            st.st_uid,
            st.st_gid,
            st.st_mtime_ns,
            content,
        )
    return state


def s3_mount(s3_server: SeaweedS3, bucket: str, tmp_path: Path, *extra: str, name: str = "mnt") -> Mount:
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    cache = tmp_path / f"cache-{name}"
    return Mount(
        f"s3://{bucket}", tmp_path / name, cache, env, "--endpoint-url", s3_server.endpoint_url, *extra
    )


@pytest.mark.parametrize("tool", ["rsync", "cp", "tar"])
def test_copy_tools_keep_modes_times_and_bytes(
    tool: str, s3_server: SeaweedS3, bucket: str, tmp_path: Path
) -> None:
    needs(tool)
    source = tmp_path / "source"
    make_tree(source)
    expected = tree_state(source)
    back = tmp_path / "back"
    with s3_mount(s3_server, bucket, tmp_path) as mount:
        into = mount.path / "copy"
        if tool == "rsync":
            run("rsync", "-a", f"{source}/", f"{into}/")
            run("rsync", "-a", f"{into}/", f"{back}/")
        elif tool == "cp":
            run("cp", "-a", source, into)
            run("cp", "-a", into, back)
        else:
            archive, again = tmp_path / "in.tar", tmp_path / "out.tar"
            run("tar", "--format=posix", "-C", source, "-cf", archive, ".")  # pax: times in ns
            into.mkdir()
            run("tar", "-C", into, "-xpf", archive)
            run("tar", "--format=posix", "-C", into, "-cf", again, ".")
            back.mkdir()
            run("tar", "-C", back, "-xpf", again)
        assert tree_state(into) == expected
    assert tree_state(back) == expected
    if tool != "rsync":
        return  # the stored attributes are the same whichever tool wrote them: one new mount is enough
    # A new mount with an empty cache reads them back from the objects' metadata.
    with s3_mount(s3_server, bucket, tmp_path, name="again") as fresh:
        assert tree_state(fresh.path / "copy", dirs=False) == tree_state(source, dirs=False)


def test_attributes_are_shared_with_s3fs_fuse(
    s3_server: SeaweedS3, bucket: str, tmp_path: Path, raw_s3: s3fs.S3FileSystem
) -> None:
    needs("s3fs")
    with (
        s3_mount(s3_server, bucket, tmp_path) as mount,
        s3fs_fuse_mount(s3_server, bucket, tmp_path) as theirs,
    ):
        ours = mount.path
        # Written by pffs, shown by s3fs-fuse.
        (ours / "by-pffs.txt").write_bytes(b"pffs wrote this")
        os.chown(ours / "by-pffs.txt", 1001, 1002)
        os.chmod(ours / "by-pffs.txt", 0o604)
        os.utime(ours / "by-pffs.txt", ns=(1_234_567_890 * NS, 1_234_567_890 * NS + 123_456_789))
        os.symlink("by-pffs.txt", ours / "pffs-link")
        os.mkfifo(ours / "pffs-fifo", 0o620)
        for name in ("by-pffs.txt", "pffs-link", "pffs-fifo"):
            assert lstat_view(theirs / name) == lstat_view(ours / name), name
        assert os.readlink(theirs / "pffs-link") == "by-pffs.txt"
        assert (theirs / "by-pffs.txt").read_bytes() == b"pffs wrote this"
        # Written by s3fs-fuse, shown by pffs.
        (theirs / "by-s3fs.bin").write_bytes(pattern(70_000, seed=3))
        os.chown(theirs / "by-s3fs.bin", 2001, 2002)
        os.chmod(theirs / "by-s3fs.bin", 0o710)
        os.utime(theirs / "by-s3fs.bin", ns=(1_111_111_111 * NS, 1_222_222_222 * NS + 5))
        os.symlink("../elsewhere", theirs / "s3fs-link")
        os.mkfifo(theirs / "s3fs-fifo", 0o600)
        for name in ("by-s3fs.bin", "s3fs-link", "s3fs-fifo"):
            assert lstat_view(ours / name) == lstat_view(theirs / name), name
        assert os.readlink(ours / "s3fs-link") == "../elsewhere"
        assert sha256((ours / "by-s3fs.bin").read_bytes()) == sha256(pattern(70_000, seed=3))
        assert raw_s3.info(f"{bucket}/by-s3fs.bin")["size"] == 70_000


def lstat_view(path: Path) -> tuple[int, int, int, int, int]:
    st = path.lstat()
    return st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_size


@contextlib.contextmanager
def s3fs_fuse_mount(s3_server: SeaweedS3, bucket: str, tmp_path: Path) -> Iterator[Path]:
    """A real s3fs-fuse mount of the bucket, without its stat cache (it would hide pffs's changes)."""
    passwd = tmp_path / "s3fs.passwd"
    passwd.touch(mode=0o600)
    passwd.write_text(f"{s3_server.access_key}:{s3_server.secret_key}\n")
    where = tmp_path / "s3fs-mnt"
    where.mkdir()
    options = f"url={s3_server.endpoint_url},use_path_request_style,passwd_file={passwd},stat_cache_expire=0"
    log = open(tmp_path / "s3fs.log", "wb")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(["s3fs", bucket, str(where), "-f", "-o", options], stdout=log, stderr=log)
    try:
        poll(
            "s3fs-fuse mounted",
            lambda: os.path.ismount(where),
            30,
            lambda: (tmp_path / "s3fs.log").read_text(),
        )
        yield where
    finally:
        subprocess.run(["fusermount3", "-u", str(where)], capture_output=True, timeout=30)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        subprocess.run(["fusermount3", "-u", "-z", str(where)], capture_output=True, timeout=30)
        log.close()


def as_nobody(root: Path) -> list[str]:
    """What another user (nobody) may do in the mount, tried in a forked child that drops root (the venv's
    python is closed to other users, so no new interpreter): "ok" or the errno, per attempt."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # the test's own folders are closed to others
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        results = []
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            attempts = [
                lambda: os.close(os.open("secret", os.O_RDONLY, dir_fd=root_fd)),
                lambda: os.close(os.open("public", os.O_RDONLY, dir_fd=root_fd)),
                lambda: os.close(os.open("public", os.O_WRONLY, dir_fd=root_fd)),
                lambda: os.close(os.open("new-file", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=root_fd)),
                lambda: os.chmod("public", 0o777, dir_fd=root_fd),
            ]
            for attempt in attempts:
                try:
                    attempt()
                    results.append("ok")
                except OSError as exc:
                    results.append(str(exc.errno))
        finally:
            os.write(writer, ",".join(results).encode())
            os._exit(0)
    os.close(writer)
    os.close(root_fd)
    try:
        with os.fdopen(reader, "rb") as answer:
            return answer.read().decode().split(",")
    finally:
        os.waitpid(pid, 0)


def test_the_kernel_enforces_stored_modes_for_another_user(
    s3_server: SeaweedS3, bucket: str, tmp_path: Path
) -> None:
    with s3_mount(s3_server, bucket, tmp_path, "--allow-other") as mount:
        (mount.path / "secret").write_bytes(b"root only")
        os.chmod(mount.path / "secret", 0o600)
        (mount.path / "public").write_bytes(b"anyone may read")
        os.chmod(mount.path / "public", 0o644)
        outcome = as_nobody(mount.path)
        denied, forbidden = str(errno.EACCES), str(errno.EPERM)
        # secret: no read; public: read, no write; no new file in root's 755 directory; no chmod of
        # another's file.
        assert outcome == [denied, "ok", denied, denied, forbidden]
        assert (mount.path / "secret").read_bytes() == b"root only"  # its owner still reads it


@pytest.mark.parametrize("option", ["--fixed-modes", "--read-only"])
def test_fixed_modes_need_no_head_per_file(
    option: str, s3_server: SeaweedS3, bucket: str, tmp_path: Path, raw_s3: s3fs.S3FileSystem
) -> None:
    files = {f"{bucket}/data/{i:02d}.bin": pattern(1000 + i, seed=i) for i in range(20)}
    raw_s3.pipe(files)
    with s3_mount(s3_server, bucket, tmp_path, option, "--file-mode", "640") as mount:
        before = mount.stats()["backend_requests"]["head"]["requests"]
        for entry in os.scandir(mount.path / "data"):
            st = entry.stat(follow_symlinks=False)
            assert stat.S_IMODE(st.st_mode) == 0o640 and stat.S_ISREG(st.st_mode)
            data = Path(entry.path).read_bytes()
            assert sha256(data) == sha256(files[f"{bucket}/data/{entry.name}"])
        heads = mount.stats()["backend_requests"]["head"]["requests"] - before
        assert heads <= 2, f"{heads} HEADs for 20 listed files"
        path = mount.path / "data" / "00.bin"
        refused = errno.EPERM if option == "--fixed-modes" else errno.EROFS
        for change, expected in (
            (lambda: os.chmod(path, 0o600), refused),
            (lambda: os.chown(path, 1, 1), refused),
            (
                lambda: os.symlink("x", mount.path / "link"),
                errno.ENOTSUP if option == "--fixed-modes" else errno.EROFS,
            ),
        ):
            with pytest.raises(OSError) as exc:
                change()
            assert exc.value.errno == expected


def test_metadata_change_keeps_bytes_etag_and_cached_blocks(
    s3_server: SeaweedS3, bucket: str, tmp_path: Path, raw_s3: s3fs.S3FileSystem
) -> None:
    data = pattern(700_000, seed=11)
    raw_s3.pipe(f"{bucket}/stored.bin", data)
    etag = raw_s3.info(f"{bucket}/stored.bin")["ETag"]
    with s3_mount(s3_server, bucket, tmp_path, "--block-size", "256K") as mount:
        path = mount.path / "stored.bin"
        assert sha256(path.read_bytes()) == sha256(data)
        gets = mount.stats()["backend_requests"]["get"]["requests"]
        os.chmod(path, 0o600)
        os.chown(path, 99, 98)
        os.utime(path, ns=(1_000_000_000 * NS, 1_000_000_000 * NS + 1))
        st = path.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns) == (
            0o600,
            99,
            98,
            NS * NS + 1,
        )
        with open(path, "rb") as f:  # a new open, past the kernel's page cache
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            assert sha256(f.read()) == sha256(data)
        assert mount.stats()["backend_requests"]["get"]["requests"] == gets  # the cached blocks served it
        assert mount.stats()["backend_requests"]["copy"]["requests"] == 3
    assert raw_s3.info(f"{bucket}/stored.bin", refresh=True)["ETag"] == etag
    assert raw_s3.cat(f"{bucket}/stored.bin") == data


@pytest.mark.parametrize("option", [None, "--fixed-modes"])
def test_open_with_o_trunc_and_no_write_empties_the_object(
    option: str | None, s3_server: SeaweedS3, bucket: str, tmp_path: Path, raw_s3: s3fs.S3FileSystem
) -> None:
    raw_s3.pipe(f"{bucket}/full.bin", pattern(10_000, seed=4))
    extra = [option] if option else []
    with s3_mount(s3_server, bucket, tmp_path, *extra) as mount:
        os.close(os.open(mount.path / "full.bin", os.O_WRONLY | os.O_TRUNC))
        assert (mount.path / "full.bin").stat().st_size == 0
    assert raw_s3.cat(f"{bucket}/full.bin") == b""


def test_setgid_directory_gives_its_group_and_devices_are_kept(
    s3_server: SeaweedS3, bucket: str, tmp_path: Path
) -> None:
    with s3_mount(s3_server, bucket, tmp_path) as mount:
        shared = mount.path / "shared"
        shared.mkdir()
        os.chown(shared, 0, 4321)
        os.chmod(shared, 0o2775)
        (shared / "file").write_bytes(b"x")
        (shared / "inner").mkdir()
        assert (shared / "file").stat().st_gid == 4321
        inner = (shared / "inner").stat()
        assert inner.st_gid == 4321 and inner.st_mode & stat.S_ISGID
        os.mknod(mount.path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        st = (mount.path / "null").lstat()
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
        os.mkfifo(mount.path / "pipe", 0o600)  # served by the kernel as a pipe, not as an object
        fifo = os.open(mount.path / "pipe", os.O_RDWR | os.O_NONBLOCK)
        try:
            os.write(fifo, b"through the pipe")
            assert os.read(fifo, 100) == b"through the pipe"
        finally:
            os.close(fifo)
    with s3_mount(s3_server, bucket, tmp_path, name="again") as fresh:
        st = (fresh.path / "null").lstat()
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
        assert (fresh.path / "shared" / "file").stat().st_gid == 4321


def test_directory_times_follow_entries_and_open_files_outlive_unlink(
    s3_server: SeaweedS3, bucket: str, tmp_path: Path
) -> None:
    """What pjdfstest found: a directory's mtime and ctime did not move with its entries; ftruncate's reply
    carried a stale ctime; fstat of a file unlinked while open was ENOENT."""
    with s3_mount(s3_server, bucket, tmp_path) as mount:
        folder = mount.path / "d"
        folder.mkdir()
        os.utime(folder, ns=(NS, NS))  # far in the past: any change below is later
        steps = [
            lambda: (folder / "file").write_bytes(b"x"),
            lambda: os.mkdir(folder / "sub"),
            lambda: os.symlink("file", folder / "link"),
            lambda: os.rename(folder / "file", folder / "moved"),
            lambda: os.unlink(folder / "link"),
            lambda: os.rmdir(folder / "sub"),
        ]
        for step in steps:
            before = folder.stat()
            step()
            after = folder.stat()
            assert after.st_mtime_ns > before.st_mtime_ns and after.st_ctime_ns > before.st_ctime_ns, step

        path = mount.path / "open.bin"
        path.write_bytes(pattern(50_000, seed=6))
        with open(path, "r+b") as f:
            ctime = os.fstat(f.fileno()).st_ctime_ns
            os.ftruncate(f.fileno(), 1000)
            now = os.fstat(f.fileno())
            assert now.st_size == 1000 and now.st_ctime_ns > ctime
            os.unlink(path)
            gone = os.fstat(f.fileno())  # the handle still holds the file
            assert gone.st_nlink == 0 and gone.st_size == 1000
            f.seek(0)
            assert sha256(f.read()) == sha256(pattern(50_000, seed=6)[:1000])
        assert not path.exists()


@pytest.mark.parametrize("option", ["--posix", "--fixed-modes"])
def test_a_mounted_prefix_with_a_folder_marker_object_works(
    option: str, s3_server: SeaweedS3, bucket: str, tmp_path: Path, raw_s3: s3fs.S3FileSystem
) -> None:
    """s3fs-fuse and the AWS console write `ds/` for a folder: a mount of s3://bucket/ds lists, makes
    directories in and reads its root (found by the pjdfstest bench: the root failed with EIO, at times)."""
    raw_s3.pipe({f"{bucket}/ds/": b"", f"{bucket}/ds/a.bin": pattern(70_000, seed=3)})
    extra = () if option == "--posix" else (option,)
    mount = Mount(
        f"s3://{bucket}/ds", tmp_path / "mnt", tmp_path / "cache", s3_mount(s3_server, bucket, tmp_path).env,
        "--endpoint-url", s3_server.endpoint_url, *extra,
    )  # fmt: skip
    with mount:
        for i in range(4):
            assert sorted(os.listdir(mount.path)) == sorted(["a.bin", *(f"d{j}" for j in range(i))])
            (mount.path / f"d{i}").mkdir()
            (mount.path / f"d{i}" / "f").write_bytes(b"x" * i)
        assert sha256((mount.path / "a.bin").read_bytes()) == sha256(pattern(70_000, seed=3))
    assert raw_s3.cat(f"{bucket}/ds/d3/f") == b"xxx"
    # The SDK lists the folder's objects, not its marker (a 0-byte "object" named like the folder).
    import fsspec

    sdk = fsspec.filesystem(
        "pffs", target=f"s3://{bucket}/ds", cache_dir=str(tmp_path / "sdk"), skip_instance_cache=True,
        **s3_server.storage_options(),
    )  # fmt: skip
    assert sorted(sdk.find("")) == ["a.bin", "d0/f", "d1/f", "d2/f", "d3/f"]


def listed_view(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (mode, size), from one listing (scandir), then the entries' stats (from that listing)."""
    return {e.name: (e.stat(follow_symlinks=False).st_mode, e.stat().st_size) for e in os.scandir(folder)}


def test_folders_without_stored_attributes_need_no_head_per_file(
    s3_server: SeaweedS3, bucket: str, tmp_path: Path, raw_s3: s3fs.S3FileSystem
) -> None:
    """A read-write mount (the default) HEADs listed files only in folders where pffs stored attributes
    (it marks them): a dataset written by another tool is listed as a --read-only mount lists it."""
    files = {f"{bucket}/data/{i:02d}.bin": pattern(1000 + i, seed=i) for i in range(20)}
    raw_s3.pipe(files)
    with s3_mount(s3_server, bucket, tmp_path) as mount:
        before = mount.stats()["backend_requests"]["head"]["requests"]
        shown = listed_view(mount.path / "data")
        assert shown == {p.rsplit("/", 1)[1]: (stat.S_IFREG | 0o644, len(d)) for p, d in files.items()}
        for name in shown:
            data = (mount.path / "data" / name).read_bytes()
            assert sha256(data) == sha256(files[f"{bucket}/data/{name}"])
        heads = mount.stats()["backend_requests"]["head"]["requests"] - before
        assert heads <= 2, f"{heads} HEADs for 20 listed files"
        os.chmod(mount.path / "data" / "03.bin", 0o600)  # stores attributes: marks data/
        (mount.path / "out").mkdir()
        (mount.path / "out" / "written").write_bytes(b"by pffs")
        os.chmod(mount.path / "out" / "written", 0o640)
        assert ".pffs-attributes" not in os.listdir(mount.path / "data")
    assert raw_s3.cat(f"{bucket}/data/.pffs-attributes") == b""
    # A new mount (an empty cache, nothing remembered) shows them from the listing of a marked folder.
    with s3_mount(s3_server, bucket, tmp_path, name="again") as mount:
        assert listed_view(mount.path / "data")["03.bin"] == (stat.S_IFREG | 0o600, 1003)
        assert listed_view(mount.path / "out") == {"written": (stat.S_IFREG | 0o640, 7)}
        assert not (mount.path / "data" / ".pffs-attributes").exists()
        # rm -r of a marked folder leaves nothing behind (the marker goes with the folder).
        shutil.rmtree(mount.path / "out")
        assert not (mount.path / "out").exists()
    assert raw_s3.find(f"{bucket}/out") == []


def test_head_every_file_shows_attributes_s3fs_fuse_stored_in_unmarked_folders(
    s3_server: SeaweedS3, bucket: str, tmp_path: Path, raw_s3: s3fs.S3FileSystem
) -> None:
    """s3fs-fuse stores attributes without pffs's marker: listed, they show with --head-every-file (one HEAD
    per file, as s3fs-fuse pays), and as the defaults without it."""
    for i in range(3):
        raw_s3.pipe_file(f"{bucket}/theirs/{i}", b"x" * i, Metadata={"mode": str(stat.S_IFREG | 0o700)})
    with s3_mount(s3_server, bucket, tmp_path, "--head-every-file") as mount:
        assert {mode for mode, _ in listed_view(mount.path / "theirs").values()} == {stat.S_IFREG | 0o700}
        assert mount.stats()["backend_requests"]["head"]["requests"] >= 3
    with s3_mount(s3_server, bucket, tmp_path, name="default") as mount:
        assert {mode for mode, _ in listed_view(mount.path / "theirs").values()} == {stat.S_IFREG | 0o644}
