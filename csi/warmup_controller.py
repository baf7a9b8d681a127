"""The DatasetWarmup controller: resolves each warm-up's dataset and nodes, rolls the nodes' progress up,
deletes finished warm-ups after their TTL, and ungates the pods that wait for a warm-up.

It watches the DatasetWarmups (list, then watch) and acts on each event; every few seconds it also goes
over all of them (TTLs, gated pods). Only the leader of its Lease acts, so the controller Deployment may
run more than one replica. What it writes into a warm-up's status (merge patches of the status
subresource, the top-level keys only; each node plugin writes its own `nodes.<node>`):

    resolved: the dataset as volume attributes (source, endpointUrl, region, blockSize)
    nodes: {<node>: {phase: Pending}}    once, when it chose the nodes
    phase, progress ("42%"), nodesDone ("2/3"), bytesDone/bytesTotal, filesDone/filesTotal,
    startTime, completionTime, lastError, conditions: [Ready]

A pod with the scheduling gate `pffs.io/warmup` and the label `pffs.io/warmup: <name>` is ungated when the
warm-up of that name in its namespace has ended (Succeeded; or Failed, then with a Warning Event: a job
then starts cold rather than never).
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import socket
import threading
import time
from typing import Any

from pffs.csi.cron import Schedule
from pffs.csi.identity import DRIVER_NAME
from pffs.csi.leader import LeaseLeader
from pffs.csi.warmups import (
    ENDED,
    FAILED,
    GATE,
    GROUP,
    LABEL,
    PENDING,
    PLURAL,
    RUNNING,
    SUCCEEDED,
    VERSION,
    now,
    patch_status,
    warmup_watch,
)
from pffs.scheduler.kube.locality import node_cache, normalize_dataset
from pffs.scheduler.kube.names import POD_GROUP_LABEL

log = logging.getLogger(__name__)

RESYNC_S = 30.0
REPORT_GRACE_S = 60.0  # how long gated pods wait for a warm node's report after its warm-up ended
PICKUP_GRACE_S = 120.0  # how long a chosen node's plugin may take to start a warm-up before it is said
NOT_TAKEN_UP = "not taken up after"


class NotYet(Exception):
    """The nodes cannot be chosen yet (the warm-up waits, it has not failed)."""


OWN_ATTRIBUTES = ("source", "endpointUrl", "region", "blockSize")


class WarmupController:
    def __init__(self, api_client: Any, namespace: str) -> None:
        from kubernetes import client

        self.custom: Any = client.CustomObjectsApi(api_client)
        self.core: Any = client.CoreV1Api(api_client)
        self.storage: Any = client.StorageV1Api(api_client)
        self.namespace = namespace
        self.pickup_grace_s = PICKUP_GRACE_S
        identity = f"{socket.gethostname()}-{os.getpid()}"
        self.leader = LeaseLeader(api_client, namespace, "pffs-warmup-controller", identity)
        self._events: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._watch = warmup_watch(self.custom, self._events.put, lambda _: None)
        self._thread = threading.Thread(target=self._run, name="warmup-controller", daemon=True)
        self._stop = threading.Event()

    def start(self) -> None:
        self.leader.start()
        self._thread.start()
        self._watch.start()

    def stop(self) -> None:
        self._stop.set()
        self._watch.stop()
        self._events.put(None)
        self.leader.stop()

    def _run(self) -> None:
        # Events while another replica leads are dropped: a replica that becomes the leader goes over
        # every warm-up first, and again every RESYNC_S (TTLs; anything a lost event left behind).
        leading, last_resync = False, 0.0
        while not self._stop.is_set():
            try:
                item = self._events.get(timeout=1.0)
            except queue.Empty:
                item = None
            if not self.leader.is_leader():
                leading = False
                continue
            if not leading or time.monotonic() - last_resync >= RESYNC_S:
                leading, last_resync = True, time.monotonic()
                self._resync()
            if item is not None:
                self._reconcile_logged(item)

    def _resync(self) -> None:
        try:
            listed = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, _request_timeout=30)
        except Exception as exc:
            log.info("DatasetWarmups: cannot list them (%s)", exc)
            return
        for item in listed.get("items", []):
            self._reconcile_logged(item)

    def _reconcile_logged(self, item: dict[str, Any]) -> None:
        meta = item.get("metadata", {})
        try:
            self.reconcile(item)
        except Exception:
            log.exception("DatasetWarmup %s/%s: reconcile failed", meta.get("namespace"), meta.get("name"))

    # One warm-up

    def reconcile(self, item: dict[str, Any]) -> None:
        meta, spec = item["metadata"], item.get("spec") or {}
        status = item.get("status") or {}
        namespace, name = meta["namespace"], meta["name"]
        if "resolved" not in status and status.get("phase") != FAILED:
            try:
                if "schedule" in spec:
                    Schedule.parse(spec["schedule"])  # a bad one fails the warm-up here, with its message
                resolved = self._resolve(namespace, spec)
                nodes = self._choose_nodes(namespace, spec.get("nodes") or {})
            except ValueError as exc:
                self._fail(item, str(exc))
                return
            except NotYet as exc:  # a PodGroup with no pod bound yet: asked again at the next resync
                if status.get("lastError") != str(exc):
                    patch_status(self.custom, namespace, name, {"phase": PENDING, "lastError": str(exc)})
                return
            patch_status(
                self.custom,
                namespace,
                name,
                {
                    "resolved": resolved,
                    "source": resolved["source"],
                    "nodes": {n: {"phase": PENDING} for n in nodes},
                    "phase": PENDING,
                    "startTime": now(),
                    "progress": "0%",
                    "nodesDone": f"0/{len(nodes)}",
                    "lastError": None,  # (a merge patch's null removes what waiting for a PodGroup said)
                },
            )
            self._event(item, "Normal", "Resolved", f"warming {resolved['source']} on {len(nodes)} node(s)")
            return
        rolled = roll_up(status)
        if "lastError" not in rolled:  # what the nodes say wins; else whether any is not taking it up
            stalled = self._not_taken_up(status, rolled)
            if stalled or str(status.get("lastError", "")).startswith(NOT_TAKEN_UP):
                rolled["lastError"] = stalled  # None (removed) once every node has taken it up
        changed = {k: v for k, v in rolled.items() if status.get(k) != v}
        if changed:
            patch_status(self.custom, namespace, name, changed)
            if changed.get("phase") in ENDED:
                kind = "Normal" if changed["phase"] == SUCCEEDED else "Warning"
                message = f"{rolled['nodesDone']} node(s) warm, {rolled['progress']}"
                self._event(
                    item,
                    kind,
                    changed["phase"],
                    message + (f": {rolled['lastError']}" if rolled.get("lastError") else ""),
                )
        phase = rolled.get("phase", status.get("phase"))
        if phase in ENDED:
            if phase == FAILED or self._reports_warm(status, rolled):
                self._ungate(namespace, name, phase)
            if "schedule" in spec:
                self._again_if_due(item, Schedule.parse(spec["schedule"]), status)
            else:
                self._expire(item, rolled.get("completionTime") or status.get("completionTime"))

    def _not_taken_up(self, status: dict[str, Any], rolled: dict[str, Any]) -> str | None:
        """Why a warm-up still waits PICKUP_GRACE_S after it was resolved: the nodes whose plugin has not
        started it (no pffs node plugin there, or one without warmups.enabled). None otherwise."""
        started = status.get("startTime")
        if rolled.get("phase") != PENDING or not isinstance(started, str):
            return None
        if _age_s(started) < self.pickup_grace_s:
            return None
        waiting = sorted(
            node
            for node, entry in (status.get("nodes") or {}).items()
            if entry.get("phase", PENDING) == PENDING and "startTime" not in entry
        )
        if not waiting:
            return None
        return (
            f"{NOT_TAKEN_UP} {self.pickup_grace_s:.0f} s on {', '.join(waiting)}: is a pffs-csi-node pod "
            "running there, with warmups.enabled (the plugin's --warmups)?"
        )

    def _again_if_due(self, item: dict[str, Any], schedule: Schedule, status: dict[str, Any]) -> None:
        """A scheduled warm-up whose schedule fired since its last run started: run it again (the dataset
        and nodes resolved anew; each node fetches only what its cache lacks)."""
        started = status.get("startTime")
        if not started:
            return
        if not schedule.fired_between(_parse_stamp(started), datetime.datetime.now(datetime.UTC)):
            return
        meta = item["metadata"]
        patch_status(
            self.custom,
            meta["namespace"],
            meta["name"],
            {
                **dict.fromkeys(("resolved", "nodes", "completionTime", "lastError", "conditions")),
                "phase": PENDING,
                "progress": "0%",
                "runs": int(status.get("runs", 1)) + 1,
            },
        )
        self._event(item, "Normal", "Scheduled", f"running again ({meta['name']}'s schedule)")

    def _fail(self, item: dict[str, Any], message: str) -> None:
        meta = item["metadata"]
        patch_status(
            self.custom,
            meta["namespace"],
            meta["name"],
            {"phase": FAILED, "lastError": message, "completionTime": now(), "progress": "0%"},
        )
        self._event(item, "Warning", FAILED, message)
        log.warning("DatasetWarmup %s/%s: %s", meta["namespace"], meta["name"], message)

    def _resolve(self, namespace: str, spec: dict[str, Any]) -> dict[str, str]:
        """The dataset as volume attributes, from the spec, a claim's PersistentVolume or a StorageClass."""
        if "source" in spec:
            found = {k: str(spec[k]) for k in OWN_ATTRIBUTES if k in spec}
        elif "volumeClaim" in spec:
            found = self._from_claim(namespace, spec["volumeClaim"])
        else:
            found = self._from_class(spec["storageClass"])
        if "blockSize" in spec:
            found["blockSize"] = str(spec["blockSize"])
        return {k: v for k, v in found.items() if k in OWN_ATTRIBUTES}

    def _from_claim(self, namespace: str, claim_name: str) -> dict[str, str]:
        from kubernetes.client.exceptions import ApiException

        try:
            claim = self.core.read_namespaced_persistent_volume_claim(
                claim_name, namespace, _request_timeout=10
            )
        except ApiException as exc:
            raise ValueError(f"volumeClaim {claim_name}: {exc.reason} ({exc.status})") from None
        volume_name = claim.spec.volume_name
        if not volume_name:
            raise ValueError(f"volumeClaim {claim_name} is not bound to a volume yet")
        volume = self.core.read_persistent_volume(volume_name, _request_timeout=10)
        csi = volume.spec.csi
        if csi is None or csi.driver != DRIVER_NAME:
            raise ValueError(
                f"volumeClaim {claim_name}: its volume {volume_name} is not a {DRIVER_NAME} volume"
            )
        return dict(csi.volume_attributes or {})

    def _from_class(self, class_name: str) -> dict[str, str]:
        from kubernetes.client.exceptions import ApiException

        try:
            found = self.storage.read_storage_class(class_name, _request_timeout=10)
        except ApiException as exc:
            raise ValueError(f"storageClass {class_name}: {exc.reason} ({exc.status})") from None
        if found.provisioner != DRIVER_NAME:
            raise ValueError(f"storageClass {class_name} is not a {DRIVER_NAME} class")
        return dict(found.parameters or {})

    def _choose_nodes(self, namespace: str, nodes: dict[str, Any]) -> list[str]:
        if "names" in nodes:
            names = list(dict.fromkeys(nodes["names"]))
            known = {n.metadata.name for n in self.core.list_node(_request_timeout=30).items}
            unknown = [n for n in names if n not in known]
            if unknown:
                some = ", ".join(sorted(known)[:5]) + (", ..." if len(known) > 5 else "")
                raise ValueError(
                    f"nodes.names: no node named {', '.join(unknown)} in the cluster"
                    + (f" (its nodes: {some})" if known else " (it has no nodes)")
                )
            return names
        if "podGroup" in nodes:
            selector = f"{POD_GROUP_LABEL}={nodes['podGroup']}"
            pods = self.core.list_namespaced_pod(
                namespace, label_selector=selector, _request_timeout=30
            ).items
            bound = sorted({p.spec.node_name for p in pods if p.spec and p.spec.node_name})
            if not bound:
                raise NotYet(f"no pod of PodGroup {nodes['podGroup']} is bound to a node yet")
            return bound
        selector = ",".join(f"{k}={v}" for k, v in sorted((nodes.get("selector") or {}).items()))
        chosen = [
            n.metadata.name for n in self.core.list_node(label_selector=selector, _request_timeout=30).items
        ]
        if not chosen:
            raise ValueError(f"nodes.selector: no node has the labels {selector or '(none)'}")
        return sorted(chosen)

    # Pods waiting, and the end of a warm-up

    def _reports_warm(self, status: dict[str, Any], rolled: dict[str, Any]) -> bool:
        """Whether every node of a warm-up that succeeded says so in its cache report (what kube-scheduler's
        extender and `pffs scheduler` read: the source of truth for "warm"), or REPORT_GRACE_S passed since
        it ended (a node whose report cannot be written must not hold pods forever)."""
        source = normalize_dataset(status.get("source", ""))
        for node in status.get("nodes") or {}:
            try:
                obj = self.core.read_node(node, _request_timeout=10)
            except Exception:
                break
            cache = node_cache({"metadata": {"annotations": obj.metadata.annotations or {}}}) or {}
            found = cache.get(source)
            if found is None or not found.whole:
                break
        else:
            return True
        ended = rolled.get("completionTime") or status.get("completionTime")
        return isinstance(ended, str) and _age_s(ended) >= REPORT_GRACE_S

    def _ungate(self, namespace: str, name: str, phase: str) -> None:
        pods = self.core.list_namespaced_pod(
            namespace, label_selector=f"{LABEL}={name}", _request_timeout=30
        ).items
        for pod in pods:
            gates = [g.name for g in (pod.spec.scheduling_gates or [])]
            if GATE not in gates:
                continue
            kept = [{"name": g} for g in gates if g != GATE]
            self.core.patch_namespaced_pod(
                pod.metadata.name,
                namespace,
                {"spec": {"schedulingGates": kept}},
                _request_timeout=10,
                _content_type="application/merge-patch+json",
            )
            if phase == FAILED:
                self._pod_event(pod, f"DatasetWarmup {name} failed; the pod starts with its data cold")
            log.info(
                "ungated pod %s/%s (DatasetWarmup %s %s)", namespace, pod.metadata.name, name, phase.lower()
            )

    def _expire(self, item: dict[str, Any], completed: str | None) -> None:
        ttl = (item.get("spec") or {}).get("ttlSecondsAfterFinished")
        if ttl is None or not completed:
            return
        if _age_s(completed) >= ttl:
            meta = item["metadata"]
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], _request_timeout=10
            )
            log.info("DatasetWarmup %s/%s deleted (ttlSecondsAfterFinished)", meta["namespace"], meta["name"])

    def _event(self, item: dict[str, Any], kind: str, reason: str, message: str) -> None:
        meta = item["metadata"]
        involved = {
            "apiVersion": item.get("apiVersion", "pffs.io/v1alpha1"),
            "kind": "DatasetWarmup",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        }
        self._post_event(meta["namespace"], involved, kind, reason, message)

    def _pod_event(self, pod: Any, message: str) -> None:
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod.metadata.name,
            "namespace": pod.metadata.namespace,
            "uid": pod.metadata.uid,
        }
        self._post_event(pod.metadata.namespace, involved, "Warning", "PffsWarmupFailed", message)

    def _post_event(
        self, namespace: str, involved: dict[str, Any], kind: str, reason: str, message: str
    ) -> None:
        stamp = now()
        body = {
            "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
            "involvedObject": involved,
            "type": kind,
            "reason": reason,
            "message": message[:1000],
            "source": {"component": "pffs-warmup-controller"},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(namespace, body, _request_timeout=10)
        except Exception as exc:
            log.info(
                "could not post the Event %s on %s %s: %s", reason, involved["kind"], involved["name"], exc
            )


def _parse_stamp(stamp: str) -> datetime.datetime:
    """A status time stamp (2026-11-27T10:00:00Z, as warmups.now writes them) as a UTC datetime."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def _age_s(stamp: str) -> float:
    """Seconds since a status time stamp."""
    return (datetime.datetime.now(datetime.UTC) - _parse_stamp(stamp)).total_seconds()


def roll_up(status: dict[str, Any]) -> dict[str, Any]:
    """The top-level status from the nodes' entries: phase, progress, totals, end time, last error."""
    nodes = status.get("nodes") or {}
    if not nodes:
        return {}
    phases = [entry.get("phase", PENDING) for entry in nodes.values()]
    out: dict[str, Any] = {
        key: sum(int(entry.get(key, 0)) for entry in nodes.values())
        for key in ("bytesDone", "bytesTotal", "filesDone", "filesTotal")
    }
    done = sum(1 for p in phases if p == SUCCEEDED)
    out["nodesDone"] = f"{done}/{len(nodes)}"
    if all(p in ENDED for p in phases):
        out["phase"] = SUCCEEDED if done == len(nodes) else FAILED
        out["completionTime"] = status.get("completionTime") or now()
    elif any(p != PENDING for p in phases):
        out["phase"] = RUNNING
    else:
        out["phase"] = PENDING
    # Progress: bytes where the nodes know their totals; a node that has not listed yet counts as 0%.
    shares = [
        (
            int(e.get("bytesDone", 0)) / int(e["bytesTotal"])
            if int(e.get("bytesTotal", 0))
            else (1.0 if e.get("phase") == SUCCEEDED else 0.0)
        )
        for e in nodes.values()
    ]
    out["progress"] = f"{100 * sum(shares) / len(shares):.0f}%"
    errors = [f"{n}: {e['lastError']}" for n, e in sorted(nodes.items()) if e.get("lastError")]
    if errors:
        out["lastError"] = errors[0] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
    out["conditions"] = [
        {
            "type": "Ready",
            "status": "True" if out["phase"] == SUCCEEDED else "False",
            "reason": out["phase"],
            "message": f"{out['nodesDone']} node(s) warm",
        }
    ]
    return out
