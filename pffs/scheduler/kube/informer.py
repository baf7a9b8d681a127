"""A live copy of one list of Kubernetes objects (Nodes, Pods, PodGroups): listed once, then kept current
by a watch from the list's resourceVersion, on a thread of its own. So a scheduling cycle reads memory, not
the API server, which then serves a stream of changes instead of every object again and again.

As client-go's reflector: a watch that ends is started again from the last resourceVersion seen (bookmarks
move it on while nothing changes); 410 Gone (the server no longer has that version) means list again; any
other failure, list again after a backoff. A server that does not watch (it answers ``watch=1`` with a list,
as the tests' small API server does) is listed at each ``items()`` call instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from pffs.scheduler.kube.api_client import ApiError, RestCalls, WatchStream, WatchUnsupported

log = logging.getLogger(__name__)

# Called with (key, object) for each object added or changed, (key, None) for each one gone.
Listener = Callable[[str, Mapping[str, Any] | None], None]


def _key(obj: Any) -> str | None:
    metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(metadata, Mapping) or not isinstance(metadata.get("name"), str):
        return None  # the snapshot reports malformed objects; here they are simply not tracked
    namespace = metadata.get("namespace")
    return f"{namespace}/{metadata['name']}" if isinstance(namespace, str) and namespace else metadata["name"]


class Informer:
    """``items()``: the objects of ``path`` as last seen. The first call lists (raising ApiError if that
    fails: the caller decides, e.g. a missing CRD's 404) and starts the watch."""

    def __init__(
        self,
        api: RestCalls,
        path: str,
        *,
        listener: Listener | None = None,
        watch_seconds: int = 300,
        backoff: float = 1.0,
    ) -> None:
        self.api, self.path, self.listener = api, path, listener
        self.watch_seconds, self.backoff = watch_seconds, backoff
        self._lock = threading.Lock()
        self._store: dict[str, Any] = {}
        self.resource_version = ""
        self.watching = threading.Event()  # set while a watch is connected and the store current
        self.watch_supported = True
        self.relists = 0  # lists after the first: 410 Gone, a broken watch
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream: WatchStream | None = None

    def items(self) -> list[Any]:
        if self.watching.is_set():
            with self._lock:
                return list(self._store.values())
        if self._thread is not None and self._thread.is_alive():
            # the watch is reconnecting: this cycle lists for itself rather than act on an old copy
            return self._list()
        items = self._list()
        if self.watch_supported and not self._stopped.is_set():
            self._thread = threading.Thread(target=self._run, name=f"pffs-watch {self.path}", daemon=True)
            self._thread.start()
        return items

    def stop(self) -> None:
        """Stop watching: the thread ends now, its connection closed."""
        self._stopped.set()
        self.watching.clear()
        stream = self._stream
        if stream is not None:
            stream.close()

    def _list(self) -> list[Any]:
        items, version = self.api.list_all(self.path)
        fresh = {key: obj for obj in items if (key := _key(obj)) is not None}
        with self._lock:
            gone = self._store.keys() - fresh.keys()
            self._store, self.resource_version = fresh, version
        if self.listener:
            for key in gone:
                self.listener(key, None)
            for key, obj in fresh.items():
                self.listener(key, obj)
        return items

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._watch()
            except WatchUnsupported as exc:
                log.info("%s: %s; listing it at each cycle instead", self.path, exc.message)
                self.watch_supported = False
                return
            except ApiError as exc:
                self.watching.clear()
                if self._stopped.is_set():
                    return
                if exc.status != 410:
                    log.warning(
                        "watching %s failed: %s; listing again in %.0fs", self.path, exc, self.backoff
                    )
                    if self._stopped.wait(self.backoff):
                        return
                else:
                    log.info("watching %s: %s; listing again", self.path, exc.message)
                try:
                    self._list()
                    self.relists += 1
                except ApiError as list_error:
                    log.warning("listing %s failed: %s", self.path, list_error)
                    self._stopped.wait(self.backoff)
            except Exception:  # a bug must not end the watch silently: say it, list again
                self.watching.clear()
                log.exception("watching %s failed", self.path)
                self._stopped.wait(self.backoff)

    def _watch(self) -> None:
        """One watch stream, from the last resourceVersion to its end (the server's timeout)."""
        self._stream = self.api.watch(self.path, self.resource_version, self.watch_seconds)
        if self._stopped.is_set():  # stop() came while connecting
            self._stream.close()
        self.watching.set()
        for event in self._stream:
            if self._stopped.is_set():
                return
            kind, obj = event["type"], event["object"]
            if kind == "ERROR":  # a Status: 410 when the version is too old to follow from
                code = obj.get("code") if isinstance(obj.get("code"), int) else 0
                raise ApiError("GET", self.path, code, str(obj.get("message") or "watch error"))
            version = obj.get("metadata", {}).get("resourceVersion") if isinstance(obj, Mapping) else None
            if kind != "BOOKMARK":
                self._apply(kind, obj)
            if isinstance(version, str) and version:
                self.resource_version = version

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        key = _key(obj)
        if key is None:
            return
        with self._lock:
            if kind == "DELETED":
                self._store.pop(key, None)
            else:
                self._store[key] = obj
        if self.listener:
            self.listener(key, None if kind == "DELETED" else obj)
