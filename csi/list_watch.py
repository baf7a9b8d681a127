"""List, then watch, a kind of Kubernetes object, for as long as the process runs (the informer pattern,
without its cache): what the node plugin and the controller use to follow Nodes and DatasetWarmups.

One list gives every object and a resourceVersion; a watch from that version gives each change after it.
A watch request ends every WATCH_S and goes on from the last version seen; a version too old to watch
from (410 Gone, an ERROR event) or a failure lists again, after a backoff while the API server fails.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

WATCH_S = 300
MAX_BACKOFF_S = 30.0


def _items(answer: Any) -> list[Any]:
    return list(answer["items"] if isinstance(answer, dict) else answer.items)


def _version(obj: Any) -> str | None:
    """The resourceVersion of a list answer or an object, typed (V1Node) or a dict (custom objects)."""
    if isinstance(obj, dict):
        return obj.get("metadata", {}).get("resourceVersion")
    return getattr(obj.metadata, "resource_version", None)


class ListWatch:
    def __init__(
        self,
        what: str,
        list_call: Callable[..., Any],
        args: tuple[Any, ...],
        listed: Callable[[list[Any]], None],
        changed: Callable[[str, Any], None],
    ) -> None:
        """`listed(objects)` after each list; `changed(kind, object)` for each ADDED, MODIFIED or DELETED."""
        self.what = what
        self.list_call = list_call
        self.args = args
        self.listed = listed
        self.changed = changed
        self._stop = threading.Event()
        self._watch: Any = None
        self._failing = False
        self._thread = threading.Thread(target=self._run, name=f"watch {what}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        from kubernetes import watch

        backoff = 1.0
        while not self._stop.is_set():
            try:
                answer = self.list_call(*self.args, _request_timeout=30)
                self.listed(_items(answer))
                version = _version(answer)
                if self._failing:
                    log.info("%s: the API server answers again", self.what)
                self._failing, backoff = False, 1.0
                while not self._stop.is_set() and version:
                    self._watch = watch.Watch()
                    version = self._follow(version)
            except Exception as exc:
                if not self._failing:
                    log.warning("%s: cannot list or watch them (%s); retrying with backoff", self.what, exc)
                self._failing = True
                self._stop.wait(backoff)
                backoff = min(MAX_BACKOFF_S, 2 * backoff)

    def _follow(self, version: str) -> str | None:
        """Watches from `version` until the request ends; the version to go on from, or None to list again."""
        stream = self._watch.stream(
            self.list_call,
            *self.args,
            resource_version=version,
            timeout_seconds=WATCH_S,
            _request_timeout=WATCH_S + 30,
        )
        for event in stream:
            kind, obj = event["type"], event["object"]
            if kind == "ERROR":  # most often 410 Gone: the version is too old to watch from
                return None
            self.changed(kind, obj)
            version = _version(obj) or version
        return version
