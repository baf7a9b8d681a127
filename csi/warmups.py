"""DatasetWarmup resources (pffs.io/v1alpha1): what the controller and the node plugins share.

The CRD is deploy/helm/pffs-csi/crds/datasetwarmups.pffs.io.yaml. The controller (warmup_controller.py)
writes into a warm-up's status the dataset resolved into volume attributes (`status.resolved`) and the
nodes it chose (`status.nodes.<node>`); each node plugin (warmup_node.py) warms its own node and writes only
its own entry. Both write with JSON merge patches of the status subresource, so they never conflict.
"""

from __future__ import annotations

import base64
import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "pffs.io", "v1alpha1", "datasetwarmups", "DatasetWarmup"
GATE = "pffs.io/warmup"  # a pod's scheduling gate, removed when the warm-up its label names has ended
LABEL = "pffs.io/warmup"  # on a pod: the name of the DatasetWarmup (same namespace) it waits for
PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"
ENDED = (SUCCEEDED, FAILED)
MERGE_PATCH = "application/merge-patch+json"
WATCH_S = 300
MAX_BACKOFF_S = 30.0


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def patch_status(custom: Any, namespace: str, name: str, status: dict[str, Any]) -> None:
    """A merge patch of the warm-up's status: only the keys given change."""
    custom.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        name,
        {"status": status},
        _request_timeout=10,
        _content_type=MERGE_PATCH,
    )


def secret_values(core: Any, namespace: str, name: str) -> dict[str, str]:
    """A Secret's keys and decoded values (credentials: never logged)."""
    secret = core.read_namespaced_secret(name, namespace, _request_timeout=10)
    return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}


def own_namespace() -> str | None:
    """The namespace of the pod this runs in (its service account's), if it runs in one."""
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or None
    except OSError:
        return None


class WarmupWatch:
    """A thread: lists every DatasetWarmup, then watches them, calling `seen(object)` for each one added or
    changed and `gone(object)` for each deleted; after a failure it lists again, with backoff."""

    def __init__(
        self,
        custom: Any,
        seen: Callable[[dict[str, Any]], None],
        gone: Callable[[dict[str, Any]], None],
        name: str,
    ) -> None:
        self.custom = custom
        self.seen = seen
        self.gone = gone
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._failing = False

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
                listed = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, _request_timeout=30)
                for item in listed.get("items", []):
                    self.seen(item)
                version = listed.get("metadata", {}).get("resourceVersion")
                if self._failing:
                    log.info("DatasetWarmups: the API server answers again")
                self._failing, backoff = False, 1.0
                while not self._stop.is_set() and version:
                    self._watch = watch.Watch()
                    version = self._follow(version)
            except Exception as exc:
                if not self._failing:
                    log.warning("DatasetWarmups: cannot list or watch them (%s); retrying with backoff", exc)
                self._failing = True
                self._stop.wait(backoff)
                backoff = min(MAX_BACKOFF_S, 2 * backoff)

    def _follow(self, version: str) -> str | None:
        stream = self._watch.stream(
            self.custom.list_cluster_custom_object,
            GROUP,
            VERSION,
            PLURAL,
            resource_version=version,
            timeout_seconds=WATCH_S,
            _request_timeout=WATCH_S + 30,
        )
        for event in stream:
            kind, item = event["type"], event["object"]
            if kind == "ERROR":  # 410 Gone most often: list again
                return None
            if kind == "DELETED":
                self.gone(item)
            else:
                self.seen(item)
            version = item.get("metadata", {}).get("resourceVersion", version)
        return version
