"""Messages that point the right way (issue 41): each mistake a user makes is one line naming the cause and
the fix, with the right exit status, no traceback and no secret. Run as a user runs pffs: the command in a
subprocess, real FUSE mounts, the real S3 server, and a plain web server of the test's own on loopback."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import s3fs
from helpers import pattern, sha256
from mounts import Mount, drop_page_cache, mounted, pffs

from pffs.testing.s3_server import SeaweedS3

SECRET = "not-a-real-secret-but-never-shown"


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The whole stderr, checked to be one line and no traceback."""
    err = result.stderr
    assert err.count("\n") == 1 and "Traceback" not in err and SECRET not in err, err
    return err.strip()


# a. A mistyped option or command


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["mount", "s3://b", "/mnt/x", "--endpont-url", "http://127.0.0.1:1"],
            "pffs: error: unrecognized arguments: --endpont-url (did you mean --endpoint-url?); "
            "see pffs mount --help",
        ),
        (  # before the command: argparse would take its value for the command
            ["--endpont-url", "http://127.0.0.1:1", "ls", "s3://b"],
            "unrecognized arguments: --endpont-url (did you mean --endpoint-url?); see pffs --help",
        ),
        (["mount", "s3://b", "/mnt/x", "--read-olny"], "--read-olny (did you mean --read-only?)"),
        (["umount", "/mnt/x", "--lazzy"], "--lazzy (did you mean --lazy?); see pffs umount --help"),
        (["mout", "s3://b", "/mnt/x"], "unknown command 'mout' (did you mean 'mount'?); see pffs --help"),
        (["mout", "s3://b", "/mnt/x", "--read-only"], "unknown command 'mout' (did you mean 'mount'?)"),
        (["cache", "clr"], "unknown action 'clr' (did you mean 'clear'?); see pffs cache --help"),
        (["ls"], "the following arguments are required: URL; see pffs ls --help"),
        (["ls", "s3://b", "--frobnicate"], "unrecognized arguments: --frobnicate; see pffs ls --help"),
    ],
)
def test_a_wrong_command_line_is_one_line_with_the_nearest_right_spelling(args: list[str], says: str) -> None:
    result = pffs(*args, env={**os.environ, "AWS_SECRET_ACCESS_KEY": SECRET})
    assert result.returncode == 2
    assert says in one_line(result)
    assert "usage:" not in result.stderr


# b. An endpoint that is some other HTTP server


@pytest.fixture
def web_server(tmp_path: Path) -> Iterator[str]:
    """A plain web server (python -m http.server) on a loopback port: its 404 page for every S3 request."""
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "index.html").write_text("<html>hello</html>")

    class Quiet(SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(tmp_path / "www"), **kwargs)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_an_endpoint_that_is_not_s3_is_said_so_not_a_missing_bucket(web_server: str, tmp_path: Path) -> None:
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": SECRET}
    cache = ["--cache-dir", str(tmp_path / "cache")]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    said = (
        f"does not answer like an S3 server (HTTP 404, text/html, server SimpleHTTP/0.6 Python/"
        f"{sys.version.split()[0]}); check --endpoint-url"
    )
    for args in (
        ["ls", "s3://datasets/imagenet/"],
        ["cat", "s3://datasets/labels.csv"],
        ["mount", "s3://datasets/imagenet", str(mnt)],
        ["mount", "s3://datasets", str(mnt)],
    ):
        result = pffs(*args, "--endpoint-url", web_server, *cache, env=env)
        line = one_line(result)
        assert result.returncode == 1, line
        assert line.startswith("pffs: error: s3://datasets") and said in line, line
        assert f"the endpoint {web_server} does not answer" in line and "bucket" not in line, line
        assert not os.path.ismount(mnt)
    # The SDK says the same
    import pffs as sdk

    options = {"endpoint_url": web_server, "key": "AKIDEXAMPLE", "secret": SECRET}
    with pytest.raises(OSError) as raised:
        sdk.open("s3://datasets/labels.csv", cache_dir=str(tmp_path / "cache"), s3=options).__enter__()
    assert said in str(raised.value) and SECRET not in str(raised.value)


def test_a_missing_bucket_on_a_real_s3_server_is_still_a_missing_bucket(
    s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    result = pffs(
        "ls", "s3://pffs-no-such-bucket/x/", "--endpoint-url", s3_server.endpoint_url,
        "--cache-dir", str(tmp_path / "c"), env=s3_env,
    )  # fmt: skip
    assert result.returncode == 1
    assert "the bucket does not exist" in one_line(result)


# c. and d. A source that does not exist


def start(mount: Mount) -> str:
    """Mounts as Mount.start does, and returns what `pffs mount` said on stderr."""
    mount.path.mkdir(parents=True, exist_ok=True)
    result = pffs(
        "mount", mount.source, str(mount.path), "--cache-dir", str(mount.cache_dir),
        "--log-file", str(mount.log_file), *mount.extra, env=mount.env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    mount.pid = int(result.stderr.split("(pid ", 1)[1].split(",", 1)[0])
    assert os.path.ismount(mount.path)
    return result.stderr


def test_a_missing_bucket_fails_either_way_and_says_so(
    s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    common = ["--endpoint-url", s3_server.endpoint_url, "--cache-dir", str(tmp_path / "cache")]
    for mode in ([], ["--read-only"]):
        result = pffs("mount", "s3://pffs-no-such-bucket/train", str(mnt), *common, *mode, env=s3_env)
        line = one_line(result)
        assert result.returncode == 1, line
        assert (
            f"s3://pffs-no-such-bucket/train: the bucket pffs-no-such-bucket does not exist at "
            f"{s3_server.endpoint_url}; pffs does not create buckets" in line
        ), line
        assert "create the bucket first" in line and "starts empty" not in line, line
        assert not os.path.ismount(mnt)


def test_a_missing_prefix_fails_read_only_naming_the_nearest(
    raw_s3: s3fs.S3FileSystem, bucket: str, s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    raw_s3.pipe({f"{bucket}/imagenet/train/a.jpg": b"a", f"{bucket}/coco/b.jpg": b"b"})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    common = ["--endpoint-url", s3_server.endpoint_url, "--cache-dir", str(tmp_path / "cache"), "--read-only"]
    result = pffs("mount", f"s3://{bucket}/imagnet/train", str(mnt), *common, env=s3_env)
    line = one_line(result)
    assert result.returncode == 1
    assert line == (
        f"pffs: error: s3://{bucket}/imagnet/train does not exist (nothing to read; a read-write mount of "
        f"it starts empty); did you mean s3://{bucket}/imagenet/train?"
    )
    result = pffs("mount", f"s3://{bucket}/zzzzqqq", str(mnt), *common, env=s3_env)
    assert result.returncode == 1
    assert one_line(result) == (
        f"pffs: error: s3://{bucket}/zzzzqqq does not exist (nothing to read; a read-write mount of it "
        "starts empty)"
    )
    assert not os.path.ismount(mnt)


def test_a_read_write_mount_of_a_missing_prefix_says_it_starts_empty(
    raw_s3: s3fs.S3FileSystem, bucket: str, s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    raw_s3.pipe({f"{bucket}/imagenet/a.jpg": b"a"})
    extra = ("--endpoint-url", s3_server.endpoint_url)
    mount = Mount(f"s3://{bucket}/imagnet", tmp_path / "mnt", tmp_path / "cache", s3_env, *extra)
    try:  # a typo: the nearest name is said, at mount time and in the log
        stderr = start(mount)
        said = (
            f"pffs: warning: s3://{bucket}/imagnet does not exist yet: mounted empty, and the first file "
            f"written creates it; did you mean s3://{bucket}/imagenet? (then pffs umount {mount.path} and "
            "mount that)"
        )
        assert said in stderr.splitlines(), stderr
        assert said.removeprefix("pffs: warning: ") in mount.log()
        assert os.listdir(mount.path) == []
    finally:
        mount.kill()
    fresh = Mount(f"s3://{bucket}/run-7", tmp_path / "mnt2", tmp_path / "cache", s3_env, *extra)
    try:  # a new prefix: legitimate, said plainly
        lines = start(fresh).splitlines()
        assert lines[1:] == [
            f"pffs: warning: s3://{bucket}/run-7 does not exist yet: mounted empty, and the first file "
            "written creates it"
        ], lines
        (fresh.path / "x.txt").write_text("made")
    finally:
        fresh.kill()
    assert raw_s3.cat(f"{bucket}/run-7/x.txt") == b"made"


# e. pffs umount of a mount that processes still use


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def open_fd(pid: int, inside: Path) -> str | None:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{inside}/"):
                return fd
        except OSError:
            continue
    return None


def test_umount_of_a_busy_mount_names_who_holds_it_and_lazy_detaches_only_when_asked(
    raw_s3: s3fs.S3FileSystem, bucket: str, s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    raw_s3.pipe({f"{bucket}/d/f.bin": b"data"})
    with mounted(f"s3://{bucket}", tmp_path, s3_env, "--endpoint-url", s3_server.endpoint_url) as mount:
        inside = subprocess.Popen(["sleep", "600"], cwd=mount.path / "d")
        reader = subprocess.Popen(
            [sys.executable, "-c", "import sys; f = open(sys.argv[1], 'rb'); sys.stdin.read()",
             str(mount.path / "d" / "f.bin")],
            stdin=subprocess.PIPE, cwd=tmp_path,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while (fd := open_fd(reader.pid, mount.path)) is None:
                assert time.monotonic() < deadline and reader.poll() is None
                time.sleep(0.05)
            result = mount.umount()
            line = one_line(result)
            assert result.returncode == 1, line
            uses = {inside.pid: "its working directory", reader.pid: "1 open file"}
            held = ", ".join(f"pid {pid} ({comm(pid)}: {uses[pid]})" for pid in sorted(uses))
            assert line == (
                f"pffs: error: {mount.path} is busy, still used by {held}: end them or move them out of it "
                f"(cd elsewhere, close the files), then pffs umount again; or pffs umount --lazy "
                f"{mount.path} detaches it now and serves them until they let go"
            )
            assert os.path.ismount(mount.path) and os.listdir(mount.path) == ["d"]  # still there, serving
            result = pffs("umount", "--lazy", str(mount.path), env=s3_env)
            assert result.returncode == 0, result.stderr
            assert f"pffs: detached {mount.path}; still used by pid" in one_line(result)
            assert not os.path.ismount(mount.path)
            # Those who held it go on: the working directory and the open file still read
            assert os.listdir(f"/proc/{inside.pid}/cwd") == ["f.bin"]
            with open(f"/proc/{reader.pid}/fd/{fd}", "rb") as again:
                assert again.read() == b"data"
        finally:
            for process in (inside, reader):
                process.kill()
                process.wait(timeout=30)
        assert mount.pid is not None
        deadline = time.monotonic() + 30
        while Path(f"/proc/{mount.pid}").exists():  # they let go: the mount ends
            assert time.monotonic() < deadline, mount.log()
            time.sleep(0.05)
        assert "(pffs umount --lazy): detached on request, and the last process using it let go [exit 0]" in (
            mount.log()
        ), mount.log()


def test_umount_of_an_idle_mount_is_as_before(
    bucket: str, s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    with mounted(f"s3://{bucket}", tmp_path, s3_env, "--endpoint-url", s3_server.endpoint_url) as mount:
        result = pffs("umount", "-l", str(mount.path), env=s3_env)  # nobody uses it: a plain unmount
        assert result.returncode == 0 and result.stderr == "", result.stderr
        assert not os.path.ismount(mount.path)
        assert "SIGTERM: unmounted on request [exit 0]" in mount.log()


# f. The stats of a cold epoch served by the directory prefetch


def test_stats_of_a_cold_epoch_served_by_the_prefetch_read_as_what_happened(
    raw_s3: s3fs.S3FileSystem, bucket: str, s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    files = {f"{i:04d}.bin": pattern(20_000 + i, seed=i) for i in range(120)}
    raw_s3.pipe({f"{bucket}/epoch/{k}": v for k, v in files.items()})
    with mounted(f"s3://{bucket}", tmp_path, s3_env, "--endpoint-url", s3_server.endpoint_url) as mount:
        names = sorted(files)
        random.Random(3).shuffle(names)  # an epoch in a shuffled order, one file at a time
        for name in names:
            assert sha256((mount.path / "epoch" / name).read_bytes()) == sha256(files[name]), name
        report = json.loads(pffs("stats", str(mount.path), "--json").stdout)["cache"]
        table = pffs("stats", str(mount.path)).stdout
    ahead, misses = report["prefetch_hits"], report["misses"]
    assert ahead > 50 and report["memory_hits"] + report["disk_hits"] == 0, report  # fetched ahead, read
    assert report["block_reads"] == ahead + misses == len(files)
    assert report["hit_ratio"] == 0.0 and report["prefetch_hit_ratio"] == round(ahead / len(files), 4)
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in table.splitlines()[:12])
    assert rows["block reads"] == f"120: 0 hits, {ahead} prefetch hits, {misses} misses", table
    assert rows["hit ratio"] == "0.0% (hits: blocks cached before this run asked for them)", table
    assert rows["prefetch hit ratio"] == (
        f"{ahead / 120:.1%} (prefetch hits: blocks fetched ahead of their reader, then served from the cache)"
    ), table
    assert rows["hits memory / disk"] == "0 / 0", table
    assert rows["bytes served from memory / disk"].endswith("(hits and prefetch hits)"), table
    # The cache directory's totals read the same way
    drop_page_cache()
    table = pffs("stats", "--cache-dir", str(tmp_path / "cache")).stdout
    assert f"120: 0 hits, {ahead} prefetch hits, {misses} misses" in table, table


def test_a_read_write_mount_of_a_missing_local_folder_makes_it_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "datasets" / "imagenet").mkdir(parents=True)
    source = tmp_path / "datasets" / "imagnet"
    mount = Mount(str(source), tmp_path / "mnt", tmp_path / "cache", dict(os.environ))
    try:
        lines = start(mount).splitlines()
        assert lines[1:] == [
            f"pffs: warning: {source} did not exist: made it, empty; did you mean "
            f"{tmp_path / 'datasets' / 'imagenet'}? (then pffs umount {mount.path} and mount that)"
        ], lines
        assert source.is_dir()
    finally:
        mount.kill()
