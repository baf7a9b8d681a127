"""`pffs extender`: the cache-locality score and filter as a kube-scheduler extender, for clusters that keep
the default scheduler.

The wire format is `k8s.io/kube-scheduler/extender/v1`: its Go types carry no JSON tags, so the keys are
the Go field names (`Pod`, `Nodes`, `NodeNames`, `FailedNodes`, `FailedAndUnresolvableNodes`, `Error`,
`Host`, `Score`); keys are read case-insensitively, as Go's decoder does. Filter: for a pod that reads pffs
datasets, nodes whose pffs publishes no cache report fail (unresolvably: preemption cannot help); other
pods pass everywhere. Prioritize: 0-10 (MaxExtenderPriority), ten times the fraction of the pod's datasets
the node holds. With `nodeCacheCapable: true` the scheduler sends names only: their reports come from the
API server when the extender is given one (`NodeWatcher`, `pffs extender --kubeconfig/--in-cluster`), else
from the nodes seen in earlier requests; an unknown node passes the filter with score 0; the answer then
carries `NodeNames` (never null), else `Nodes`.

A malformed request gets HTTP 400 with the reason; nothing a request holds can stop the server.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pffs.scheduler.kube.api_client import RestCalls
from pffs.scheduler.kube.informer import Informer
from pffs.scheduler.kube.json_fields import BadObject
from pffs.scheduler.kube.locality import (
    CACHE_ANNOTATION,
    CachedDataset,
    locality,
    node_cache,
    pod_datasets,
)

log = logging.getLogger(__name__)

MAX_SCORE = 10  # extenderv1.MaxExtenderPriority
MAX_BODY = 64 << 20  # a NodeList of thousands of nodes fits
NO_PFFS = "pffs does not run on this node (it publishes no pffs.io/cache report); the pod reads pffs datasets"


class BadRequest(ValueError):
    """The request is not ExtenderArgs: answered with HTTP 400 and this message."""


class NodeReports:
    """The latest cache report of every node seen, for requests that carry node names only. Kept as the
    annotation itself and read when asked, so a report that ages past REPORT_MAX_AGE_S while its node
    stays unchanged (its plugin gone) stops counting then."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._reports: dict[str, Mapping[str, Any]] = {}  # name → the Node with only its cache report
        self._lock = threading.Lock()
        self.clock = clock

    def update(self, name: str, node: Mapping[str, Any]) -> None:
        annotations = (node.get("metadata") or {}).get("annotations") or {}
        slim = {CACHE_ANNOTATION: annotations[CACHE_ANNOTATION]} if CACHE_ANNOTATION in annotations else {}
        with self._lock:
            self._reports[name] = {"metadata": {"annotations": slim}}

    def get(self, name: str) -> tuple[bool, dict[str, CachedDataset] | None]:
        """(known, report)."""
        with self._lock:
            node = self._reports.get(name)
        return node is not None, node_cache(node, self.clock()) if node is not None else None

    def forget(self, name: str) -> None:
        with self._lock:
            self._reports.pop(name, None)

    def follow(self, name: str, node: Mapping[str, Any] | None) -> None:
        """An informer's listener: a Node added or changed (its report), or gone (``None``)."""
        if node is None:
            self.forget(name)
        else:
            self.update(name, node)


class NodeWatcher(threading.Thread):
    """Keeps ``NodeReports`` current from the API server, for kube-scheduler set up with
    ``nodeCacheCapable: true``, which sends node names only: the Nodes are listed once and watched, so a new
    report counts as soon as the CSI plugin publishes it. A server that cannot watch is listed every
    ``interval`` seconds."""

    def __init__(self, reports: NodeReports, api: RestCalls, interval: float) -> None:
        super().__init__(name="pffs-node-watcher", daemon=True)
        self.informer = Informer(api, "/api/v1/nodes", listener=reports.follow)
        self.interval = interval
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.informer.items()  # lists only until the watch runs, or when it cannot
            except Exception as exc:  # the API server down or refusing: keep the last reports, say why
                log.warning("cannot list Nodes for their cache reports (%s); keeping the last ones", exc)
            self.stopped.wait(self.interval)
        self.informer.stop()


class Extender:
    def __init__(self, reports: NodeReports | None = None) -> None:
        self.reports = reports or NodeReports()

    def filter(self, body: Any) -> dict[str, Any]:
        pod, nodes, names = self._args(body)
        datasets = pod_datasets(pod)
        failed: dict[str, str] = {}
        if datasets:
            for name, known, report in self._candidates(nodes, names):
                if known and report is None:
                    failed[name] = NO_PFFS
        result: dict[str, Any] = {"FailedNodes": {}, "FailedAndUnresolvableNodes": failed, "Error": ""}
        if nodes is not None:
            kept = [n for n in nodes if _name(n) not in failed]
            result["Nodes"] = {"apiVersion": "v1", "kind": "NodeList", "items": kept}
            result["NodeNames"] = None
        else:
            assert names is not None
            result["Nodes"] = None
            result["NodeNames"] = [n for n in names if n not in failed]
        return result

    def prioritize(self, body: Any) -> list[dict[str, Any]]:
        pod, nodes, names = self._args(body)
        datasets = pod_datasets(pod)
        return [
            {"Host": name, "Score": round(MAX_SCORE * locality(datasets, report))}
            for name, _, report in self._candidates(nodes, names)
        ]

    def _candidates(
        self, nodes: list[Mapping[str, Any]] | None, names: list[str] | None
    ) -> list[tuple[str, bool, dict[str, CachedDataset] | None]]:
        """(name, known, cache report) of every candidate node, remembering the reports of full nodes."""
        if nodes is not None:
            out = []
            for node in nodes:
                name, report = _name(node), node_cache(node)
                self.reports.update(name, node)
                out.append((name, True, report))
            return out
        assert names is not None
        return [(name, *self.reports.get(name)) for name in names]

    @staticmethod
    def _args(body: Any) -> tuple[Mapping[str, Any], list[Mapping[str, Any]] | None, list[str] | None]:
        if not isinstance(body, Mapping):
            raise BadRequest("the body must be a JSON object (ExtenderArgs)")
        fields = {str(k).lower(): v for k, v in body.items()}
        pod = fields.get("pod")
        if not isinstance(pod, Mapping):
            raise BadRequest("Pod is missing or not an object")
        node_list, names = fields.get("nodes"), fields.get("nodenames")
        if node_list is None and names is None:
            raise BadRequest("neither Nodes nor NodeNames is given")
        nodes = None
        if node_list is not None:
            items = node_list.get("items") if isinstance(node_list, Mapping) else None
            if not isinstance(items, list) or not all(isinstance(n, Mapping) for n in items):
                raise BadRequest("Nodes must be a NodeList: an object with a list of Node objects in items")
            for node in items:
                _name(node)
            nodes = items
        elif not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadRequest("NodeNames must be a list of strings")
        return pod, nodes, names if nodes is None else None


def _name(node: Mapping[str, Any]) -> str:
    metadata = node.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not name:
        raise BadRequest("a Node in Nodes.items has no metadata.name")
    return name


class _Handler(BaseHTTPRequestHandler):
    extender: Extender  # set on the subclass made by make_server()
    protocol_version = "HTTP/1.1"
    timeout = 30.0  # socket timeout: a client that stalls mid-request cannot hold a thread

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/healthz":
            self._send(HTTPStatus.OK, {"status": "ok"})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"Error": f"no such path: {self.path}"})

    def do_POST(self) -> None:
        verb = self.path.rstrip("/").rsplit("/", 1)[-1]
        handle = {"filter": self.extender.filter, "prioritize": self.extender.prioritize}.get(verb)
        if handle is None:
            self._send(HTTPStatus.NOT_FOUND, {"Error": f"no such verb: {self.path} (filter, prioritize)"})
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._send(HTTPStatus.LENGTH_REQUIRED, {"Error": "Content-Length is required"})
            self.close_connection = True  # the unread body (chunked, say) must not be read as a request
            return
        if not 0 <= length <= MAX_BODY:
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"Error": f"body over {MAX_BODY} bytes"})
            self.close_connection = True
            return
        try:
            raw = self.rfile.read(length)
        except OSError:  # timed out mid-body, or the client went away
            self.close_connection = True
            return
        if len(raw) < length:  # the client closed early
            self.close_connection = True
            return
        try:
            body = json.loads(raw)
            self._send(HTTPStatus.OK, handle(body))
        except RecursionError:  # nested deeper than the decoder goes
            self._send(HTTPStatus.BAD_REQUEST, {"Error": f"bad {verb} request: JSON nested too deeply"})
        except (ValueError, BadObject) as exc:  # JSONDecodeError, BadRequest and BadObject are ValueErrors
            log.info("bad %s request: %s", verb, exc)
            self._send(HTTPStatus.BAD_REQUEST, {"Error": f"bad {verb} request: {exc}"})
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("%s failed", verb)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"Error": f"{verb} failed: {type(exc).__name__}"})

    def _send(self, status: HTTPStatus, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def make_server(
    address: str, port: int, extender: Extender | None = None, *, timeout: float = 30.0
) -> ThreadingHTTPServer:
    """The extender's HTTP server, bound (port 0: a free one; see server.server_address). ``timeout``: how
    long a connection may stay silent (mid-request or idle between keep-alive requests)."""
    attributes = {"extender": extender or Extender(), "timeout": timeout}
    handler = type("ExtenderHandler", (_Handler,), attributes)
    server = ThreadingHTTPServer((address, port), handler)
    server.daemon_threads = True
    return server
