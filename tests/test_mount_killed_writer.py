"""A writer killed mid-write publishes nothing: the stored object stays byte for byte (issue 41).

Real programs (a plain Python writer, dd, torch.save, torch's FileSystemWriter) write onto a real read-write
mount of the S3 server and are killed by a signal while the file is open; the object in the bucket must be
the one before, the partial bytes kept aside in staging/killed with a counter and a log line. The same
programs ending normally (or a writer that fsyncs before it is killed) still publish.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3fs
from helpers import pattern, poll, sha256
from mounts import Mount, mounted
from test_mount import env_for, new_bucket

from pffs.testing.s3_server import SeaweedS3

pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse (FUSE) on this machine"),
]

# Writes 1 MiB chunks of one byte value for ever (argv: path, byte, "fsync-first" or "plain"); with
# fsync-first it writes and fsyncs 3 MiB of byte value 7 first.
ENDLESS_WRITER = textwrap.dedent(
    """
    import os, sys
    path, value, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(path, "wb") as f:
        if mode == "fsync-first":
            f.write(bytes([7]) * (3 << 20))
            f.flush()
            os.fsync(f.fileno())
            print("fsynced", flush=True)
        while True:
            f.write(bytes([value]) * (1 << 20))
            f.flush()
    """
)

# torch.save of a 128 MiB state dict (argv: path, seed); prints the sha256 of what it saved when done (the
# same save to a local file of the same name: the name is in the archive).
TORCH_SAVE = textwrap.dedent(
    """
    import hashlib, os, sys, tempfile, torch
    path, seed = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(seed)
    state = {f"layer{i}": torch.randn(8 << 20) for i in range(4)}
    torch.save(state, path)
    with tempfile.TemporaryDirectory() as local:
        torch.save(state, os.path.join(local, os.path.basename(path)))
        with open(os.path.join(local, os.path.basename(path)), "rb") as f:
            print(hashlib.sha256(f.read()).hexdigest(), flush=True)
    """
)

# torch.distributed.checkpoint's own FileSystemWriter, one process without a process group (argv: dir, seed).
DCP_SAVE = textwrap.dedent(
    """
    import sys, torch
    import torch.distributed.checkpoint as dcp
    path, seed = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(seed)
    state = {f"layer{i}": torch.randn(8 << 20) for i in range(4)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=2))
    print("saved", flush=True)
    """
)


@pytest.fixture
def rw(s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, tmp_path: Path) -> Iterator[tuple[Mount, str]]:
    bucket = new_bucket(raw_s3)
    extra = ("--endpoint-url", s3_server.endpoint_url, "--dir-ttl", "1")
    with mounted(f"s3://{bucket}", tmp_path, env_for(s3_server), *extra) as mount:
        yield mount, bucket


def staged_bytes(mount: Mount) -> int:
    """Bytes in the files being written (not those kept aside from killed writers)."""
    return sum(p.stat().st_size for p in (mount.cache_dir / "staging").glob("*.data"))


def kept(mount: Mount) -> list[tuple[Path, dict[str, object]]]:
    folder = mount.cache_dir / "staging" / "killed"
    return [(p, json.loads(p.with_suffix(".json").read_text())) for p in sorted(folder.glob("*.data"))]


def start(program: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", program, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def kill_once_staged(mount: Mount, writer: subprocess.Popen[str], at_least: int, sig: int) -> None:
    """Kills the writer while its file is open and at least `at_least` bytes of it are staged. Polled often,
    so the kill lands mid-write and not once a file is complete and being closed (a close that has begun
    publishes, as it should: 0.2 s polls missed that window on CI)."""
    try:
        mid_write = lambda: staged_bytes(mount) >= at_least or writer.poll() is not None  # noqa: E731
        poll("the writer to be mid-write", mid_write, every_s=0.005)
        assert writer.poll() is None, f"the writer ended before it was killed: {writer.communicate()}"
        writer.send_signal(sig)
        assert writer.wait(timeout=60) == -sig
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


def assert_kept_aside(mount: Mount, url: str, sig: int, filled_with: int | None = None) -> None:
    """One file kept from a killed writer, named in its sidecar, the log and the stats."""
    poll("the killed write to be counted", lambda: mount.stats()["killed_writes"] == 1, logs=mount.log)
    [(data, record)] = kept(mount)
    assert record["url"] == url and record["signal"] == signal.Signals(sig).name
    assert record["size"] == data.stat().st_size > 0
    if filled_with is not None:  # what the writer wrote, as far as it got
        written = data.read_bytes()
        assert written.count(filled_with) == len(written)
    assert f"{url} was not uploaded: its writer (pid {record['pid']}" in mount.log()
    assert staged_bytes(mount) == 0 and mount.stats()["uploads_pending"] == 0


def stored(raw_s3: s3fs.S3FileSystem, prefix: str) -> dict[str, str]:
    """sha256 of every object under prefix (not the `name/` marker of a mkdir)."""
    raw_s3.invalidate_cache()
    return {key: sha256(raw_s3.cat(key)) for key in raw_s3.find(prefix) if not key.endswith("/")}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_python_writer_leaves_the_old_object(
    rw: tuple[Mount, str], raw_s3: s3fs.S3FileSystem, sig: int
) -> None:
    mount, bucket = rw
    old = pattern(5 << 20, seed=1)
    raw_s3.pipe(f"{bucket}/model.bin", old)
    writer = start(ENDLESS_WRITER, str(mount.path / "model.bin"), "3", "plain")
    kill_once_staged(mount, writer, 8 << 20, sig)
    assert_kept_aside(mount, f"s3://{bucket}/model.bin", sig, filled_with=3)
    assert sha256(raw_s3.cat(f"{bucket}/model.bin")) == sha256(old)
    # Readers through the mount see the stored object again, not the partial one.
    poll("the mount to show the stored object", lambda: (mount.path / "model.bin").stat().st_size == len(old))
    assert sha256((mount.path / "model.bin").read_bytes()) == sha256(old)
    # And the file can be written again, normally.
    (mount.path / "model.bin").write_bytes(b"new")
    assert raw_s3.cat(f"{bucket}/model.bin") == b"new"


def test_a_killed_new_file_is_never_created(rw: tuple[Mount, str], raw_s3: s3fs.S3FileSystem) -> None:
    mount, bucket = rw
    writer = start(ENDLESS_WRITER, str(mount.path / "fresh.bin"), "4", "plain")
    kill_once_staged(mount, writer, 4 << 20, signal.SIGKILL)
    assert_kept_aside(mount, f"s3://{bucket}/fresh.bin", signal.SIGKILL)
    assert not raw_s3.exists(f"{bucket}/fresh.bin")


def test_what_was_fsynced_before_the_kill_is_published(
    rw: tuple[Mount, str], raw_s3: s3fs.S3FileSystem
) -> None:
    mount, bucket = rw
    raw_s3.pipe(f"{bucket}/log.bin", b"old")
    writer = start(ENDLESS_WRITER, str(mount.path / "log.bin"), "5", "fsync-first")
    assert writer.stdout is not None and writer.stdout.readline().strip() == "fsynced"
    kill_once_staged(mount, writer, 8 << 20, signal.SIGKILL)
    assert_kept_aside(mount, f"s3://{bucket}/log.bin", signal.SIGKILL)
    assert sha256(raw_s3.cat(f"{bucket}/log.bin")) == sha256(bytes([7]) * (3 << 20))


def test_a_killed_dd_leaves_the_old_object_and_a_finished_one_publishes(
    rw: tuple[Mount, str], raw_s3: s3fs.S3FileSystem
) -> None:
    mount, bucket = rw
    old = pattern(3 << 20, seed=2)
    raw_s3.pipe(f"{bucket}/disk.img", old)
    target = f"of={mount.path / 'disk.img'}"
    dd = subprocess.Popen(
        ["dd", "if=/dev/zero", target, "bs=1M", "count=100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    kill_once_staged(mount, dd, 16 << 20, signal.SIGKILL)
    assert_kept_aside(mount, f"s3://{bucket}/disk.img", signal.SIGKILL, filled_with=0)
    assert sha256(raw_s3.cat(f"{bucket}/disk.img")) == sha256(old)
    done = subprocess.run(["dd", "if=/dev/zero", target, "bs=1M", "count=20"], capture_output=True)
    assert done.returncode == 0, done.stderr
    assert sha256(raw_s3.cat(f"{bucket}/disk.img")) == sha256(bytes(20 << 20))


def test_a_killed_torch_save_leaves_the_previous_checkpoint_loadable(
    rw: tuple[Mount, str], raw_s3: s3fs.S3FileSystem
) -> None:
    mount, bucket = rw
    path = str(mount.path / "ckpt.pt")
    first = start(TORCH_SAVE, path, "1")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    saved = raw_s3.cat(f"{bucket}/ckpt.pt")
    assert sha256(saved) == out.strip()  # a normal save publishes, exactly
    second = start(TORCH_SAVE, path, "2")
    kill_once_staged(mount, second, 32 << 20, signal.SIGKILL)
    assert_kept_aside(mount, f"s3://{bucket}/ckpt.pt", signal.SIGKILL)
    assert sha256(raw_s3.cat(f"{bucket}/ckpt.pt")) == sha256(saved)
    load = subprocess.run(
        [sys.executable, "-c", "import sys, torch; print(len(torch.load(sys.argv[1])))", path],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert load.returncode == 0 and load.stdout.strip() == "4", load.stderr


def test_a_killed_filesystem_writer_leaves_the_previous_checkpoint(
    rw: tuple[Mount, str], raw_s3: s3fs.S3FileSystem
) -> None:
    mount, bucket = rw
    path = str(mount.path / "dcp")
    first = start(DCP_SAVE, path, "1")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0 and out.strip() == "saved", err
    before = stored(raw_s3, f"{bucket}/dcp/")
    assert any(key.endswith(".distcp") for key in before) and f"{bucket}/dcp/.metadata" in before
    second = start(DCP_SAVE, path, "2")
    kill_once_staged(mount, second, 16 << 20, signal.SIGKILL)  # two shards of 64 MiB, written at once
    poll("the killed shard to be counted", lambda: mount.stats()["killed_writes"] >= 1, logs=mount.log)
    assert stored(raw_s3, f"{bucket}/dcp/") == before
    load = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, torch, torch.distributed.checkpoint as dcp\n"
            "torch.manual_seed(1)\n"
            "want = {f'layer{i}': torch.randn(8 << 20) for i in range(4)}\n"
            "got = {k: torch.empty_like(v) for k, v in want.items()}\n"
            "dcp.load(got, storage_reader=dcp.FileSystemReader(sys.argv[1]))\n"
            "print(all(torch.equal(got[k], want[k]) for k in want))",
            path,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert load.returncode == 0 and load.stdout.strip() == "True", load.stderr
