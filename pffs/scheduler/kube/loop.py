"""`pffs scheduler`'s loop: the Kubernetes edge of the scheduling core.

Each cycle reads Nodes, Pods and scheduler-plugins PodGroups from watched copies (``informer.py``: listed
once, then followed with a watch), translates them into the core's objects (``snapshot.py``), runs one
session (``core/session.run_session``) and carries out what it decided (``actions.py``): a Binding per placed
pod, an Eviction per evicted pod, a PodScheduled=False condition for pods that wait. Everything is plain
Kubernetes JSON over a small REST layer (``api_client.py``): easy to test.

A pod this scheduler bound counts on its node at once, before the watch brings the bound pod back (an
"assumed" pod, as kube-scheduler's cache has them): otherwise the next cycle would see the room still free
and fill it twice.

A malformed object is one `BadObject` message: the pod is reported (log and Event) and skipped, the loop
goes on.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pffs.scheduler.core.objects import Placement, PodGroup, Queue
from pffs.scheduler.kube.actions import (
    bind,
    evict,
    mark_unschedulable,
    post_pod_event,
    post_scheduling_failure,
)
from pffs.scheduler.kube.api_client import ApiError, RestCalls
from pffs.scheduler.kube.informer import Informer
from pffs.scheduler.kube.json_fields import BadObject, name_of, object_key
from pffs.scheduler.kube.names import GPUS_ANNOTATION, MIN_MEMBER_ANNOTATION, PODGROUP_API, SCHEDULER_NAME
from pffs.scheduler.kube.prometheus import SchedulerStats
from pffs.scheduler.kube.snapshot import Snapshot, build_snapshot
from pffs.scheduler.kube.taints import tolerates
from pffs.scheduler.kube.warm_before_bind import (
    WARMUP_API,
    Hold,
    cold_nodes,
    warm_deadline,
    warmup_objects,
)

if TYPE_CHECKING:
    from pffs.scheduler.core.session import SessionResult, Weights

log = logging.getLogger(__name__)

RunSession = Callable[..., "SessionResult"]

# How long a bound pod is assumed on its node without the watch showing it there: far longer than a watch
# event takes; past it the watched copy (re-listed if the watch broke) is trusted again.
ASSUME_SECONDS = 30.0

# Bindings in flight at once: one POST each, sent in parallel as kube-scheduler's binding goroutines send
# them (one after another, 1,000 pods took 3 s of round trips to the API server alone).
BIND_PARALLELISM = 16


@dataclass
class CycleReport:
    bound: list[tuple[str, str]] = field(default_factory=list)  # (pod key, node)
    evicted: list[str] = field(default_factory=list)
    pending: dict[str, str] = field(default_factory=dict)  # group -> why
    errors: list[str] = field(default_factory=list)


class Scheduler:
    """One scheduler: ``cycle()`` lists, decides and acts once; ``run()`` repeats until ``stop`` is set."""

    def __init__(
        self,
        api: RestCalls,
        queues: Sequence[Queue],
        *,
        weights: Weights | None = None,
        scheduler_name: str = SCHEDULER_NAME,
        run_session: RunSession | None = None,
        stats: SchedulerStats | None = None,
    ) -> None:
        self.api = api
        self.stats = stats or SchedulerStats()
        self.queues = list(queues)
        self.weights = weights
        self.scheduler_name = scheduler_name
        self._run_session = run_session
        self._reported: dict[str, str] = {}  # object -> last problem reported, so each is said once
        self._evicting: dict[str, set[str]] = {}  # group -> pods evicted for it, not gone yet
        self._podgroups_absent = False
        self._nodes = Informer(api, "/api/v1/nodes")
        self._pods = Informer(api, "/api/v1/pods")
        self._podgroups = Informer(api, PODGROUP_API)
        self._assumed: dict[str, tuple[Placement, float]] = {}  # pod key -> its binding, when
        self._holds: dict[str, Hold] = {}  # group -> placements waiting for warm nodes (warm before bind)
        self._binder = concurrent.futures.ThreadPoolExecutor(BIND_PARALLELISM, thread_name_prefix="bind")

    def close(self) -> None:
        for informer in (self._nodes, self._pods, self._podgroups):
            informer.stop()
        self._binder.shutdown(wait=True)

    def cycle(self) -> CycleReport:
        report = CycleReport()
        nodes = self._nodes.items()
        listed = self._pods.items()
        self._release_holds(nodes, listed, report)
        held = {p.pod.name: p for hold in self._holds.values() for p in hold.placements}
        pods = self._with_assumed(listed, held)
        snap = build_snapshot(nodes, pods, self._list_podgroups(), self.queues, self.scheduler_name)
        snap.ours -= held.keys()  # held, not bound: never a pod to evict
        for what, problem in snap.problems.items():
            self._report_problem(what, problem)
        live = {key for p in pods if (key := _safe_key(p))}
        for name, victims in list(self._evicting.items()):
            victims &= live
            if not victims:
                del self._evicting[name]
        # A group whose victims are still terminating waits, so the freed room is not preempted twice.
        offered = []
        for group in snap.groups:
            if group.name in self._evicting:
                snap.waiting[group.name] = (
                    f"waiting for {len(self._evicting[group.name])} evicted pods to terminate"
                )
            else:
                offered.append(group)
        report.pending.update(snap.waiting)
        result = self._session()(snap.nodes, self.queues, offered, snap.running, self.weights)
        self._act(snap, offered, result, report)
        for name, why in report.pending.items():
            self._mark_pending(name, why, snap)
        return report

    def run(self, interval: float, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                report = self.cycle()
                seconds = time.monotonic() - started
                self.stats.cycle_done(
                    len(report.bound),
                    len(report.evicted),
                    len(report.errors),
                    len(report.pending),
                    seconds,
                    time.time(),
                )
                log.log(
                    logging.INFO if report.bound or report.evicted else logging.DEBUG,
                    "cycle: %d bound, %d evicted, %d groups pending (%.2fs)",
                    len(report.bound),
                    len(report.evicted),
                    len(report.pending),
                    time.monotonic() - started,
                )
            except ApiError as exc:
                self.stats.cycle_failed(time.monotonic() - started)
                log.error("cycle failed: %s; retrying in %.0fs", exc, interval)
            except Exception:  # a bug must not stop scheduling: log it once per cycle and go on
                self.stats.cycle_failed(time.monotonic() - started)
                log.exception("cycle failed")
            stop.wait(max(0.0, interval - (time.monotonic() - started)))
        self.close()

    def _with_assumed(self, pods: list[Any], held: Mapping[str, Placement]) -> list[Any]:
        """The pods, those bound here but not yet seen bound, and those `held` for warm-up (pod key ->
        its placement), shown on their nodes (with their GPUs)."""
        if not self._assumed and not held:
            return pods
        now = time.monotonic()
        out = []
        for pod in pods:
            key = _safe_key(pod)
            assumed = self._assumed.get(key) if key else None
            if key in held and not _field(pod, "spec").get("nodeName"):
                pod = _as_bound(pod, held[key])
            elif assumed is not None:
                placement, when = assumed
                if _field(pod, "spec").get("nodeName") or now - when > ASSUME_SECONDS:
                    del self._assumed[key]  # the watch caught up (or never will: trust it)
                else:
                    pod = _as_bound(pod, placement)
            out.append(pod)
        live = {_safe_key(p) for p in pods}
        for key in self._assumed.keys() - live:
            del self._assumed[key]  # deleted meanwhile
        return out

    def _session(self) -> RunSession:
        if self._run_session is None:
            from pffs.scheduler.core.session import run_session

            self._run_session = run_session
        return self._run_session

    def _list_podgroups(self) -> list[Any]:
        try:
            items = self._podgroups.items()
        except ApiError as exc:
            if exc.status != 404:
                raise
            if not self._podgroups_absent:
                log.warning(
                    "the PodGroup CRD (scheduling.x-k8s.io/v1alpha1) is not installed: gangs take their "
                    "min member from the pod annotation %s",
                    MIN_MEMBER_ANNOTATION,
                )
            self._podgroups_absent = True
            return []
        self._podgroups_absent = False
        return items

    def _act(
        self, snap: Snapshot, offered: list[PodGroup], result: SessionResult, report: CycleReport
    ) -> None:
        report.pending.update(result.pending)
        by_group: dict[str, list[Placement]] = {}
        for placement in result.placements:
            by_group.setdefault(placement.pod.group, []).append(placement)
        evictions = [e for e in result.evictions if e.pod.name in snap.ours]
        refused = [e.pod.name for e in result.evictions if e.pod.name not in snap.ours]
        evicted_nodes = {e.node for e in evictions}
        if refused:
            # The core chose a pod this scheduler did not place: leave it, and hold back what needed the room.
            log.warning("not evicting pods of other schedulers: %s", ", ".join(sorted(refused)))
            evicted_nodes |= {e.node for e in result.evictions}
            evictions = []
        for eviction in evictions:
            self._evict(eviction, report)
        # Only pods actually evicted are waited for: one refused (429, a PodDisruptionBudget) stays running,
        # so waiting for it would hold the group forever; the group is offered again next cycle instead.
        evicted = set(report.evicted)
        to_bind: list[Placement] = []
        for group, placements in by_group.items():
            why = self._hold_back(placements, snap, evicted_nodes) or self._warm_first(
                group, placements, snap
            )
            if why:
                report.pending[group] = why
                if evicted:
                    self._evicting.setdefault(group, set()).update(evicted)
                continue
            to_bind.extend(placements)
            self._reported.pop(group, None)  # if it waits again later, say so again
        self._bind_all(to_bind, report)

    def _hold_back(self, placements: list[Placement], snap: Snapshot, evicted_nodes: set[str]) -> str:
        """Why a group's placements must wait (empty: bind them). All or nothing, as the gang."""
        for p in placements:
            if p.node in evicted_nodes:
                return f"preempting pods on {p.node}; binds once they are gone"
            pod_obj, node_obj = snap.pods.get(p.pod.name), snap.node_objects.get(p.node)
            if pod_obj is None or node_obj is None:
                return f"pod {p.pod.name} or node {p.node} is not in the snapshot"
            if not tolerates(pod_obj, node_obj):
                return f"pod {p.pod.name} does not tolerate the taints of node {p.node}"
        return ""

    # Warm before bind (warm_before_bind.py)

    def _warm_first(self, group: str, placements: list[Placement], snap: Snapshot) -> str:
        """Why a placed group waits for warm nodes (empty: bind it now). A group that asks to warm first
        and whose nodes are not warm yet is held, and DatasetWarmups are made for its nodes."""
        pods = [snap.pods[p.pod.name] for p in placements]
        try:
            deadline = warm_deadline(pods)
        except BadObject as exc:
            return str(exc)
        datasets = tuple(dict.fromkeys(d for p in placements for d in p.pod.datasets))
        if deadline is None or not datasets:
            return ""
        hold = Hold(group, placements, datasets, deadline)
        if not cold_nodes(datasets, {n: snap.node_objects.get(n) for n in hold.nodes}):
            return ""
        namespace = placements[0].pod.name.split("/", 1)[0]
        try:
            for body in warmup_objects(group, pods, datasets, hold.nodes):
                made = self.api.request("POST", WARMUP_API.format(namespace=namespace), body)
                log.info(
                    "group %s: DatasetWarmup %s/%s warms %s on %s",
                    group,
                    namespace,
                    made.get("metadata", {}).get("name"),
                    body["spec"]["source"],
                    ", ".join(hold.nodes),
                )
        except ApiError as exc:
            # No CRD (404) or no right to make one (403): the job starts cold rather than never.
            self._pods_event(placements, "Warning", "WarmBeforeBind", f"cannot warm first, binding: {exc}")
            return ""
        self._holds[group] = hold
        return hold.why()

    def _release_holds(self, nodes: list[Any], pods: list[Any], report: CycleReport) -> None:
        """Binds each held group whose nodes are warm now, or whose deadline passed; forgets those whose
        pods went (or were bound by someone else)."""
        if not self._holds:
            return
        by_name = {name_of(n): n for n in nodes}
        unbound = {key for p in pods if (key := _safe_key(p)) and not _field(p, "spec").get("nodeName")}
        for group, hold in list(self._holds.items()):
            if any(p.pod.name not in unbound for p in hold.placements):
                del self._holds[group]
                continue
            cold = cold_nodes(hold.datasets, {n: by_name.get(n) for n in hold.nodes})
            waited = time.monotonic() - hold.started
            if cold and not hold.overdue():
                report.pending[group] = hold.why()
                continue
            del self._holds[group]
            if cold:
                message = (
                    f"deadline of {hold.deadline_s:g} s passed with {', '.join(cold)} not warm: "
                    f"bound cold to {', '.join(hold.nodes)}"
                )
                self._pods_event(hold.placements, "Warning", "WarmBeforeBindDeadline", message)
            else:
                message = f"{', '.join(hold.datasets)} warm on {', '.join(hold.nodes)} after {waited:.1f} s"
                self._pods_event(hold.placements, "Normal", "WarmBeforeBind", message)
            log.info("group %s: %s", group, message)
            self._reported.pop(group, None)
            self._bind_all(hold.placements, report)

    def _pods_event(self, placements: list[Placement], kind: str, reason: str, message: str) -> None:
        for placement in placements:
            namespace, name = placement.pod.name.split("/", 1)
            try:
                post_pod_event(self.api, namespace, name, kind, reason, message, self.scheduler_name)
            except ApiError as exc:
                log.debug("could not post an Event for %s: %s", placement.pod.name, exc)

    def _bind_all(self, placements: list[Placement], report: CycleReport) -> None:
        """Posts the Bindings in parallel; what they did is recorded here, on the loop's own thread."""
        errors = list(self._binder.map(self._post_binding, placements))
        for placement, error in zip(placements, errors, strict=True):
            if error is not None:
                report.errors.append(str(error))
                log.warning(
                    "binding %s to %s failed: %s (retried next cycle)",
                    placement.pod.name,
                    placement.node,
                    error,
                )
                continue
            log.info(
                "bound %s to %s%s",
                placement.pod.name,
                placement.node,
                f" GPUs {placement.gpus}" * bool(placement.gpus),
            )
            report.bound.append((placement.pod.name, placement.node))
            self._assumed[placement.pod.name] = (placement, time.monotonic())

    def _post_binding(self, placement: Placement) -> ApiError | None:
        try:
            bind(self.api, placement)
        except ApiError as exc:
            return exc
        return None

    def _evict(self, placement: Placement, report: CycleReport) -> None:
        try:
            evict(self.api, placement)
        except ApiError as exc:
            report.errors.append(str(exc))
            # 429: a PodDisruptionBudget forbids it now; 404: already gone.
            log.warning("evicting %s failed: %s", placement.pod.name, exc)
            return
        log.info("evicted %s from %s (preempted)", placement.pod.name, placement.node)
        report.evicted.append(placement.pod.name)

    def _mark_pending(self, group: str, why: str, snap: Snapshot) -> None:
        """Say once (per reason) why a group waits: a log line and PodScheduled=False on its pods."""
        if self._reported.get(group) == why:
            return
        self._reported[group] = why
        log.info("group %s waits: %s", group, why)
        for key in snap.members.get(group, []):
            try:
                mark_unschedulable(self.api, key, why)
            except ApiError as exc:
                log.debug("could not set PodScheduled on %s: %s", key, exc)

    def _report_problem(self, what: str, problem: str) -> None:
        if self._reported.get(what) == problem:
            return
        self._reported[what] = problem
        log.warning("skipping %s: %s", what, problem)
        if not what.startswith("Pod ") or "/" not in what:
            return
        namespace, name = what.removeprefix("Pod ").split("/", 1)
        try:
            post_scheduling_failure(self.api, namespace, name, problem, self.scheduler_name)
        except ApiError as exc:
            log.debug("could not post an Event for %s: %s", what, exc)


def _safe_key(obj: Any) -> str:
    """The pod's 'namespace/name', or "" for a malformed one (the snapshot reports it)."""
    if not isinstance(obj, Mapping):
        return ""
    try:
        return object_key(obj, "Pod")
    except BadObject:
        return ""


def _field(obj: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """obj[name] if it is an object, else empty (the snapshot reports malformed pods)."""
    value = obj.get(name)
    return value if isinstance(value, Mapping) else {}


def _as_bound(pod: Mapping[str, Any], placement: Placement) -> dict[str, Any]:
    """A copy of ``pod`` as its Binding makes it: on the node, with its GPUs' annotation."""
    bound: dict[str, Any] = {**pod, "spec": {**_field(pod, "spec"), "nodeName": placement.node}}
    if placement.gpus:
        metadata = _field(pod, "metadata")
        annotations = _field(metadata, "annotations")
        gpus = ",".join(map(str, placement.gpus))
        bound["metadata"] = {**metadata, "annotations": {**annotations, GPUS_ANNOTATION: gpus}}
    return bound
