"""`pffs mount --engine native`: the mount served by the native core (pffs._core.NativeMount, Rust: fuser
with several threads on one /dev/fuse connection, names and blocks without Python per request).

Python still does what happens once: the source is checked and its messages said by pffs.fuse.mount as for
the Python engine, the bucket's endpoint, region and credentials come from botocore (Backend.native_getter),
and this module waits for the mount to end while signals are handled, then says how it ended.

What the engine does not do yet (issue 44 lands in steps), and refuses with one line rather than serving
differently: writes (--read-only is required), https endpoints (its client speaks plain http), sources other
than S3, cache groups. It reads the node's disk tier itself; the blocks it fetches are written there by
the engine too, and published in the disk tier's index, which stays in Python for now (Upkeep).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pffs import _core
from pffs.backends.backend import Backend, S3Backend
from pffs.backends.s3_native import CREDENTIALS_REFRESH_S, Credentials
from pffs.cache.disk_tier import WRITE_BEHIND_BYTES, DiskTier
from pffs.fuse import mount_record
from pffs.fuse.ending import DETACH_SIGNAL, Ending, how_serving_ended
from pffs.fuse.metrics import start_metrics_server
from pffs.fuse.mountpoint import force_unmount, in_mount_table, raise_read_ahead
from pffs.fuse.options import MountOptions
from pffs.processes import public_url
from pffs.vfs.vfs import shared_block_cache

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often the wait for the mount's end lets Python's signal handlers run
UPKEEP_EVERY_S = 2.0  # how often the engine's report learns the disk tier's usage


class EngineUnsupportedError(ValueError):
    """A mount the native engine does not serve yet: one line naming what to change."""


def check_supported(options: MountOptions, backend: Backend) -> None:
    """Raises EngineUnsupportedError unless the native engine serves this mount as the Python one would."""
    why = None
    if not options.read_only:
        why = "serves read-only mounts only so far: add --read-only"
    elif not options.source.startswith(("s3://", "s3a://")):
        why = "serves S3 sources only so far"
    elif options.peers is not None:
        why = "does not join cache groups yet: drop the --peer options"
    elif not isinstance(backend, S3Backend) or backend.native_getter() is None:
        why = "cannot send this bucket's requests itself (a proxy or extra options are set)"
    if why:
        raise EngineUnsupportedError(f"--engine native {why}; or mount with --engine python (the default)")


def serve_native(
    options: MountOptions,
    backend: Backend,
    root: str,
    notices: list[str],
    ready: Callable[[tuple[str, ...]], None],
    record: Path,
    supervisor: int | None,
) -> Ending:
    """Mounts `root` (bucket/prefix) at the mountpoint with the native engine and serves until unmounted or
    signalled; how it ended."""
    getter = backend.native_getter() if isinstance(backend, S3Backend) else None
    assert getter is not None  # check_supported
    bucket, _, prefix = root.partition("/")
    endpoint, credentials = getter.bucket_target(bucket)
    if endpoint.scheme != "http":
        raise EngineUnsupportedError(
            f"--engine native speaks plain http only so far, and {public_url(options.source)} is reached "
            "over https; mount with --engine python (the default)"
        )
    prefix = prefix.strip("/")
    cache = options.cache
    block_size = cache.block_size
    ahead_blocks = max(1, cache.readahead_size // block_size)
    # The node's disk tier, as the Python engine opens it (its index, bound and writer stay in Python);
    # the native engine reads its block files itself.
    disk = shared_block_cache(cache.model_copy(update={"direct_io": True})).disk
    mount = _core.NativeMount(
        str(options.mountpoint),
        (
            endpoint.host,
            endpoint.connect_host,
            endpoint.port,
            endpoint.path_prefix,
            getter.region,
            (credentials.access_key, credentials.secret_key, credentials.token) if credentials else None,
            (getter.connect_timeout, getter.read_timeout, options.backend.backend_timeout),
        ),
        (bucket, prefix + "/" if prefix else ""),
        (cache.memory_cache_size, block_size, ahead_blocks, cache.fetch_workers),
        (cache.metadata_ttl, cache.stale_if_error, options.attr_ttl),
        (
            os.getuid() if options.uid is None else options.uid,
            os.getgid() if options.gid is None else options.gid,
            options.file_mode,
            options.dir_mode,
            options.allow_other,
            options.threads,
            options.source.replace(",", "_"),
            public_url(options.source),
            f"s3://{bucket}/{prefix + '/' if prefix else ''}",
        ),
        (str(cache.cache_dir), WRITE_BEHIND_BYTES) if disk is not None else None,
    )
    upkeep = Upkeep(mount, disk, lambda: getter.bucket_target(bucket)[1])
    raise_read_ahead(options.mountpoint)
    if options.metrics_port:
        start_metrics_server(lambda: _report(mount), options.metrics_address, options.metrics_port)
    log.info(
        "mounted %s at %s (pid %d, native engine, %d threads)",
        public_url(options.source),
        options.mountpoint,
        os.getpid(),
        options.threads,
    )
    ready(tuple(notices))
    mount_record.running(record, public_url(options.source), options.mountpoint, options.log_file, supervisor)
    signalled, detached = _wait_for_the_end(mount, options.mountpoint)
    upkeep.finish()
    report = _report(mount)
    log.info(
        "native engine: %d reads, %d blocks fetched (%d failed, %d ahead of their reader), %d memory hits, "
        "%d listings",
        report["reads"],
        report["backend_requests"]["get"]["requests"],
        report["backend_requests"]["get"]["errors"],
        report["cache"]["prefetches"],
        report["cache"]["memory_hits"],
        report["backend_requests"]["list"]["requests"],
    )
    listed = not signalled and in_mount_table(options.mountpoint)
    return how_serving_ended(signalled, listed, options.mountpoint, detached)


def _wait_for_the_end(mount: Any, mountpoint: Path) -> tuple[str | None, bool]:
    """Waits until the kernel ends the session, unmounting on SIGTERM, SIGINT or SIGHUP and detaching on
    DETACH_SIGNAL (pffs umount --lazy); the signal that ended it, if one did, and whether it detached."""
    received: list[int] = []

    def note(signum: int, _frame: object) -> None:
        received.append(signum)

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, DETACH_SIGNAL)
    previous = {s: signal.signal(s, note) for s in handled}
    signalled: str | None = None
    detached = False
    try:
        while not mount.wait(POLL_S):
            while received:
                signum = received.pop(0)
                name = signal.Signals(signum).name
                if signum == DETACH_SIGNAL and not detached:
                    log.info(
                        "%s (pffs umount --lazy): detaching %s now; serving the processes that still use "
                        "it until they let go",
                        name,
                        mountpoint,
                    )
                    detached = True
                    force_unmount(mountpoint)
                elif signum != DETACH_SIGNAL and signalled is None:
                    log.info("%s: unmounting", name)
                    signalled = name
                    mount.unmount()
        mount.unmount()  # joins the serving threads (the kernel ended the session already)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return signalled, detached


class Upkeep:
    """What the native engine needs of Python while it serves, done by one thread off the path of every
    request: the block files it wrote published in the disk tier's index (which stays in Python: a row,
    then the rename into place), the disk tier's usage told to its report, and its credentials renewed
    (temporary ones expire)."""

    def __init__(
        self, mount: Any, disk: DiskTier | None, credentials: Callable[[], Credentials | None]
    ) -> None:
        self.mount = mount
        self.disk = disk
        self.credentials = credentials
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pffs-native-upkeep", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self._tell_usage()
        said = renewed = time.monotonic()
        while True:
            taken = self.mount.take_written(UPKEEP_EVERY_S) if self.disk is not None else []
            if self.disk is None:
                self.closed.wait(UPKEEP_EVERY_S)
            elif taken:
                self.disk.adopt(taken)
            now = time.monotonic()
            if now - said >= UPKEEP_EVERY_S:
                self._tell_usage()
                said = now
            if now - renewed >= CREDENTIALS_REFRESH_S:
                self._renew_credentials()
                renewed = now
            if not taken and self.closed.is_set():
                return

    def _tell_usage(self) -> None:
        if self.disk is None:
            return
        try:
            evictions = self.disk.stats.snapshot().get("disk_evictions", 0)
            self.mount.set_disk_usage(
                self.disk.used_bytes(), self.disk.capacity_bytes, self.disk.bound_bytes(), evictions
            )
        except Exception as exc:  # the disk tier failing must not stop the writes
            log.info("could not read the disk cache's usage: %s", exc)

    def _renew_credentials(self) -> None:
        try:
            creds = self.credentials()
        except Exception as exc:  # the ones in use go on until they are refused
            log.warning("could not renew the S3 credentials (%s); the native engine keeps the last ones", exc)
            return
        self.mount.set_credentials(
            (creds.access_key, creds.secret_key, creds.token) if creds is not None else None
        )

    def finish(self) -> None:
        """Writes what the engine queued, then stops."""
        self.closed.set()
        self.mount.close_writes()
        self.thread.join()
        if self.disk is not None:
            self.disk.close()


def _report(mount: Any) -> dict[str, Any]:
    """The engine's report: the Python engine's shape (pffs stats, pffs.fuse.metrics), made natively."""
    report: dict[str, Any] = json.loads(mount.report())
    return report
