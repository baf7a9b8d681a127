"""Retries that spend the deadline, through a fault proxy of our own (pffs.testing.fault_proxy) in front of
the test SeaweedFS: with half the requests answered 503 SlowDown and a tenth stalled mid-body, a mount and
the SDK read every object byte for byte, and the retries show in the counters (`pffs stats`, Prometheus's
source) and in one INFO line per episode; with everything stalled, every concurrent waiter on one uncached
object or one new name fails by the deadline, not one deadline after another (issue 43)."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs
from helpers import pattern, pffs_fs, sha256
from mounts import mounted, pffs
from test_mount import env_for

from pffs.testing.fault_proxy import FaultProxy
from pffs.testing.s3_server import SeaweedS3

pytestmark = pytest.mark.timeout(300)

SHORT_DEADLINE_S = 6.0
MARGIN_S = 4.0  # a last wait that ends at the deadline, the FUSE round trip, a busy 2-core machine
WAITERS = 4


@pytest.fixture
def proxy(s3_server: SeaweedS3) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.endpoint_url, seed=43) as proxy:
        yield proxy


@pytest.fixture
def data(raw_s3: s3fs.S3FileSystem) -> Iterator[tuple[str, dict[str, bytes]]]:
    """A bucket of objects put in place through the server itself (not the proxy)."""
    bucket = f"faults-{uuid.uuid4().hex[:12]}"
    raw_s3.mkdir(bucket)
    objects = {f"d/obj{i:02d}.bin": pattern(100_000 + i * 61_000, seed=100 + i) for i in range(16)}
    raw_s3.pipe({f"{bucket}/{name}": body for name, body in objects.items()})
    yield bucket, objects


def totals(report: dict[str, Any]) -> dict[str, int]:
    """The retry counters added up over the request kinds."""
    names = ("retries", "throttled", "timeouts", "resets", "server_errors", "errors")
    return {name: sum(int(row.get(name, 0)) for row in report.values()) for name in names}


def read_all(paths: dict[str, Callable[[], bytes]]) -> dict[str, bytes | BaseException]:
    """Each read, 8 at a time: its bytes or its error."""

    def one(read: Callable[[], bytes]) -> bytes | BaseException:
        try:
            return read()
        except Exception as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return dict(zip(paths, pool.map(one, paths.values()), strict=True))


def test_half_throttled_a_tenth_stalled_every_read_is_exact_and_counted(
    s3_server: SeaweedS3, proxy: FaultProxy, data: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    bucket, objects = data
    proxy.set(throttle=0.5, stall=0.1)
    # The SDK, with the default deadline (30 s: a per-attempt timeout of 6 s).
    fs = pffs_fs(
        f"s3://{bucket}",
        tmp_path / "sdk-cache",
        endpoint_url=proxy.endpoint_url,
        key=s3_server.access_key,
        secret=s3_server.secret_key,
    )
    got = read_all({name: (lambda name=name: fs.cat_file(name)) for name in objects})
    failed = {name: repr(v) for name, v in got.items() if isinstance(v, BaseException)}
    assert not failed, f"SDK reads failed through 50% 503s and 10% stalls: {failed}"
    for name, body in objects.items():
        assert sha256(got[name]) == sha256(body), name  # type: ignore[arg-type]
    sdk = totals(fs.vfs.backend.requests.snapshot())
    assert sdk["retries"] > 0 and sdk["throttled"] > 0 and sdk["errors"] == 0, sdk
    sdk_stalls = proxy.counts["stalled"]

    # A mount, through the same proxy (-v: the episodes' INFO lines in its log).
    extra = ("--endpoint-url", proxy.endpoint_url, "--metadata-ttl", "600", "-v")
    with mounted(f"s3://{bucket}", tmp_path, env_for(s3_server), *extra) as mount:
        got = read_all({name: (lambda name=name: (mount.path / name).read_bytes()) for name in objects})
        failed = {name: repr(v) for name, v in got.items() if isinstance(v, BaseException)}
        assert not failed, f"mount reads failed through 50% 503s and 10% stalls: {failed}\n{mount.log()}"
        for name, body in objects.items():
            assert sha256(got[name]) == sha256(body), name  # type: ignore[arg-type]
        counted = totals(mount.stats()["backend_requests"])
        assert counted["retries"] > 0 and counted["throttled"] > 0, counted
        # `pffs stats` shows them, as JSON and as text
        shown = pffs("stats", str(mount.path), "--json", env=mount.env)
        assert shown.returncode == 0, shown.stderr
        assert totals(json.loads(shown.stdout)["backend_requests"])["throttled"] >= counted["throttled"]
        text = pffs("stats", str(mount.path), env=mount.env)
        assert "backend retries" in text.stdout and "throttled" in text.stdout, text.stdout
        log = mount.log_file.read_text()
        assert " answered after " in log and "throttled" in log, log[-3000:]
    # Stalls happened and were retried: each is a timed-out attempt of the SDK or the mount.
    assert proxy.counts["stalled"] > 0, proxy.counts
    assert sdk["timeouts"] + counted["timeouts"] > 0, (sdk, counted, proxy.counts, sdk_stalls)


def timed_failures(calls: list[Callable[[], Any]]) -> list[tuple[float, BaseException | None]]:
    """All calls at once, each on its own thread: (seconds it took, its error or None)."""
    results: list[tuple[float, BaseException | None]] = [(0.0, None)] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i: int) -> None:
        start.wait()
        began = time.monotonic()
        try:
            calls[i]()
        except BaseException as exc:
            results[i] = (time.monotonic() - began, exc)
        else:
            results[i] = (time.monotonic() - began, None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def assert_all_fail_by_the_deadline(results: list[tuple[float, BaseException | None]], what: str) -> None:
    slowest = max(seconds for seconds, _ in results)
    print(f"{what}: failed after {sorted(round(s, 2) for s, _ in results)} s")  # shown with -s
    errors = [error for _, error in results]
    assert all(isinstance(e, OSError) for e in errors), f"{what}: not every waiter failed: {errors}"
    assert all(e.errno in (errno.ETIMEDOUT, errno.EIO, errno.ECONNREFUSED) for e in errors), errors  # type: ignore[union-attr]
    assert slowest < SHORT_DEADLINE_S + MARGIN_S, (
        f"{what}: the last of {len(results)} waiters failed after {slowest:.1f} s "
        f"(--backend-timeout {SHORT_DEADLINE_S:g}): {sorted(round(s, 1) for s, _ in results)}"
    )


def test_everything_stalled_every_waiter_fails_by_the_deadline(
    s3_server: SeaweedS3, proxy: FaultProxy, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """A stall of everything (45 s, longer than the deadline): waiters on one uncached object and on one
    new name share the first one's deadline, through the mount (where the kernel sends them one after
    the other) and through the SDK (where they are concurrent calls)."""
    bucket = f"stall-{uuid.uuid4().hex[:12]}"
    raw_s3.mkdir(bucket)
    cold = pattern(3 << 20, seed=7)
    raw_s3.pipe({f"{bucket}/data/cold.bin": cold, f"{bucket}/other/new.bin": b"n"})

    extra = ("--endpoint-url", proxy.endpoint_url, "--backend-timeout", str(SHORT_DEADLINE_S))
    extra += ("--metadata-ttl", "600", "--no-prefetch-dirs")
    with mounted(f"s3://{bucket}", tmp_path, env_for(s3_server), *extra) as mount:
        assert os.stat(mount.path / "data" / "cold.bin").st_size == len(cold)  # known, not read
        with proxy.stall_everything():
            stalled_at = time.monotonic()
            results = timed_failures(
                [lambda: (mount.path / "data" / "cold.bin").read_bytes() for _ in range(WAITERS)]
            )
            assert_all_fail_by_the_deadline(results, "mount readers of one uncached object")
            results = timed_failures(
                [lambda: os.stat(mount.path / "other" / "new.bin") for _ in range(WAITERS)]
            )
            assert_all_fail_by_the_deadline(results, "mount lookups of one new name")
            assert time.monotonic() - stalled_at < 45  # all within the 45 s stall
        # the stall over: the same object and name answer, exactly
        assert sha256((mount.path / "data" / "cold.bin").read_bytes()) == sha256(cold)
        assert os.stat(mount.path / "other" / "new.bin").st_size == 1

    fs = pffs_fs(
        f"s3://{bucket}",
        tmp_path / "sdk-cache",
        endpoint_url=proxy.endpoint_url,
        key=s3_server.access_key,
        secret=s3_server.secret_key,
        backend_timeout=SHORT_DEADLINE_S,
        metadata_ttl=600,
    )
    assert fs.info("data/cold.bin")["size"] == len(cold)
    with proxy.stall_everything():
        stalled_at = time.monotonic()
        results = timed_failures([lambda: fs.cat_file("data/cold.bin") for _ in range(WAITERS)])
        assert_all_fail_by_the_deadline(results, "SDK readers of one uncached object")
        results = timed_failures([lambda: fs.info("other/new.bin") for _ in range(WAITERS)])
        assert_all_fail_by_the_deadline(results, "SDK lookups of one new name")
        assert time.monotonic() - stalled_at < 45
    assert sha256(fs.cat_file("data/cold.bin")) == sha256(cold)
    assert fs.info("other/new.bin")["size"] == 1
    assert proxy.counts["held"] > 0
