"""The node plugin's part of DatasetWarmups: warm this node's cache for the warm-ups that chose it.

Each node plugin watches the DatasetWarmups and warms those whose status names its node (the controller
chose it) and that are not over there, one at a time, into the node's shared disk cache (the one volumes
without a `cacheSize` of their own read), with the spec's rate as a bound on bytes fetched per second. It
patches its own entry, `status.nodes.<node>`, with files and bytes done about once a second. Blocks
already cached are skipped, so a warm-up that a plugin restart interrupted goes on without fetching again
what it had. A warm-up that ends adds its dataset to the node's cache report (pffs.io/cache), which
`pffs extender` and `pffs scheduler` read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pffs.backends.backend import ObjectInfo
from pffs.backends.urls import open_backend
from pffs.csi.attributes import backend_options, cache_settings, parse_attributes, parse_credentials
from pffs.csi.rpc import Abort
from pffs.csi.volumes import VolumeManager
from pffs.csi.warmups import (
    ENDED,
    FAILED,
    RUNNING,
    SUCCEEDED,
    now,
    patch_status,
    secret_values,
    warmup_watch,
)
from pffs.scheduler.kube.locality import normalize_dataset
from pffs.vfs import Vfs

log = logging.getLogger(__name__)

PROGRESS_S = 1.0  # how often a running warm-up's progress is written


class RateLimit:
    """At most `per_second` bytes a second, over all threads (None: no bound)."""

    def __init__(self, per_second: int | None) -> None:
        self.per_second = per_second
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        if not self.per_second:
            return
        with self._lock:
            start = max(self._next, time.monotonic())
            self._next = start + n / self.per_second
        time.sleep(max(0.0, start - time.monotonic()))


class NodeWarmer:
    def __init__(
        self, api_client: Any, node_id: str, manager: VolumeManager, namespace: str | None, workers: int = 8
    ) -> None:
        from kubernetes import client

        self.custom: Any = client.CustomObjectsApi(api_client)
        self.core: Any = client.CoreV1Api(api_client)
        self.node_id = node_id
        self.manager = manager
        self.namespace = namespace  # where warm-ups' credential Secrets live (the plugin's own)
        self.workers = workers
        self.after_warmed: Callable[[], object] | None = None  # publishes the cache report at once
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._queued: set[str] = set()  # uids waiting or being warmed
        self._deleted: set[str] = set()
        self._lock = threading.Lock()
        self._watch = warmup_watch(self.custom, self._seen, self._gone)
        self._thread = threading.Thread(target=self._run, name="warmup-node", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._watch.start()

    def stop(self) -> None:
        self._watch.stop()
        self._queue.put(None)

    def _seen(self, item: dict[str, Any]) -> None:
        status = item.get("status") or {}
        mine = (status.get("nodes") or {}).get(self.node_id)
        if mine is None or mine.get("phase") in ENDED or "resolved" not in status:
            return
        uid = item["metadata"]["uid"]
        with self._lock:
            if uid in self._queued:
                return
            self._queued.add(uid)
        self._queue.put(item)

    def _gone(self, item: dict[str, Any]) -> None:
        with self._lock:
            self._deleted.add(item["metadata"]["uid"])

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            uid = item["metadata"]["uid"]
            try:
                self.warm(item)
            except Exception:
                log.exception("warm-up %s/%s failed", item["metadata"]["namespace"], item["metadata"]["name"])
            finally:
                with self._lock:
                    self._queued.discard(uid)

    def _report(self, item: dict[str, Any], entry: dict[str, Any]) -> None:
        meta = item["metadata"]
        try:
            patch_status(self.custom, meta["namespace"], meta["name"], {"nodes": {self.node_id: entry}})
        except Exception as exc:  # progress is best effort; the end is reported again below if it fails
            log.info("warm-up %s/%s: could not report progress (%s)", meta["namespace"], meta["name"], exc)

    def warm(self, item: dict[str, Any]) -> None:
        meta, spec, status = item["metadata"], item.get("spec") or {}, item.get("status") or {}
        name = f"{meta['namespace']}/{meta['name']}"
        entry: dict[str, Any] = {"phase": RUNNING, "startTime": now()}
        try:
            vfs, files = self._open(status["resolved"], spec)
        except Exception as exc:
            self._report(item, {"phase": FAILED, "lastError": _one_line(exc), "completionTime": now()})
            log.warning("warm-up %s: %s", name, _one_line(exc))
            return
        entry.update(filesTotal=len(files), bytesTotal=sum(f.size for f in files), filesDone=0, bytesDone=0)
        entry.update(bytesFetched=0)
        self._report(item, entry)
        log.info(
            "warm-up %s: %d files, %d bytes into this node's cache", name, len(files), entry["bytesTotal"]
        )
        limit = RateLimit(spec.get("bytesPerSecond"))
        lock = threading.Lock()
        errors: list[str] = []

        def warm_file(info: ObjectInfo) -> None:
            for index in range(vfs.reader.block_count(info)):
                if meta["uid"] in self._deleted:
                    return
                start, end = vfs.reader.block_range(info, index)
                try:
                    fetched = vfs.reader.warm_block(info, index)
                except OSError as exc:
                    with lock:
                        errors.append(f"{info.path}: {_one_line(exc)}")
                    return
                if fetched:
                    limit.take(fetched)
                with lock:
                    entry["bytesDone"] += end - start
                    entry["bytesFetched"] += fetched
            with lock:
                entry["filesDone"] += 1

        with ThreadPoolExecutor(self.workers, thread_name_prefix="warmup") as pool:
            futures = [pool.submit(warm_file, info) for info in files]
            last = time.monotonic()
            while not all(f.done() for f in futures):
                time.sleep(0.05)
                if time.monotonic() - last >= PROGRESS_S:
                    last = time.monotonic()
                    with lock:
                        self._report(item, dict(entry))
        if meta["uid"] in self._deleted:
            return
        # The node's cache report says so first, then the warm-up's status: whoever acts on the status
        # (the controller ungating pods, `pffs scheduler` binding a gang) finds the report already current.
        vfs.reader.cache.wait_for_disk()
        cached = sum(vfs.reader.cached_bytes(f) for f in files)
        self.manager.record_warmed(
            normalize_dataset(status["resolved"]["source"]), [(f.cache_id, f.size) for f in files], cached
        )
        if self.after_warmed is not None:
            self.after_warmed()
        entry["completionTime"] = now()
        entry["phase"] = FAILED if errors else SUCCEEDED
        if errors:
            entry["lastError"] = f"{len(errors)} object(s) failed, e.g. {errors[0]}"
        self._report(item, entry)
        log.info("warm-up %s: %s (%d bytes fetched)", name, entry["phase"].lower(), entry["bytesFetched"])

    def _open(self, resolved: dict[str, str], spec: dict[str, Any]) -> tuple[Vfs, list[ObjectInfo]]:
        try:
            attributes = parse_attributes(resolved, "the warm-up's dataset")
        except Abort as exc:
            raise ValueError(exc.message) from None
        secrets: dict[str, str] = {}
        if spec.get("secretName"):
            if self.namespace is None:
                raise ValueError("the node plugin does not know its namespace to read secretName from")
            secrets = secret_values(self.core, self.namespace, spec["secretName"])
        try:
            credentials = parse_credentials(secrets, f"Secret {spec.get('secretName')}")
        except Abort as exc:
            raise ValueError(exc.message) from None
        backend, root = open_backend(attributes.source, backend_options(attributes, credentials))
        node_cache = self.manager.config.cache
        vfs = Vfs(backend, cache_settings(attributes, node_cache, node_cache.cache_dir))
        files: list[ObjectInfo] = []
        for path in spec.get("paths") or [""]:
            files += vfs.walk_files(f"{root.rstrip('/')}/{path}".rstrip("/") if path else root)
        return vfs, files


def _one_line(exc: BaseException) -> str:
    """An error as one readable line. The kubernetes client's ApiException prints the answer's headers
    and body (a `(404) ... HTTPHeaderDict(...)` dump): its status, reason and the API server's own message
    instead."""
    status = getattr(exc, "status", None)
    if status is not None and hasattr(exc, "reason"):
        message = ""
        with contextlib.suppress(ValueError, AttributeError):  # a body that is not a JSON Status
            message = str(json.loads(getattr(exc, "body", None) or "{}").get("message", ""))
        return f"HTTP {status} {exc.reason}" + (f": {message}" if message else "")
    return " ".join(str(exc).split())[:500] or type(exc).__name__
