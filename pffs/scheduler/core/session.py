"""One scheduling session over a snapshot: enqueue, allocate (gangs), backfill, preempt and reclaim.

``run_session`` is a pure function: it reads the nodes, queues, groups and running pods, and returns what to
bind and what to evict; it does no I/O and is deterministic. Ties between equally scored nodes go to the
lowest node name (nodes are sorted by name), ties between groups to the lowest group name.

1. Enqueue. A group with no running pod is admitted only if its minimum (its ``min_member`` pods' requests)
   fits its queue's ``capability`` on top of the queue's usage. A non-overcommit queue rejects it (the group
   waits; the reason names the resource); an overcommit queue admits it and marks it overcommitted. Running
   groups of an overcommit queue that is over its capability are marked too: those whose admission (in
   ``created`` order) took the queue past it, and so is a new group whose placement in this session takes
   its overcommit queue past it. A group whose queue is unknown, or with a pod of a negative request, waits.
2. Allocate. Groups are taken in weight-fair order: the queue with the lowest dominant share divided by its
   weight first (shares recomputed after every group), then higher priority, then earlier ``created``. A
   group needs ``min_member`` minus its running pods placed now, all of them or none: its pods (largest first)
   are placed tentatively and rolled back if the gang is not complete. A non-overcommit queue's usage never
   passes its capability. If the weighted scores strand a gang, it is tried once more without the locality
   and ToR scores, so locality can only reorder feasible choices, never lose a gang.
3. Backfill. The first gang that waits for room (and that an empty cluster could hold) becomes the reserved
   gang. Every placement after it in the order — later groups, and then the pods beyond ``min_member`` of
   every group — from a group of no higher priority may only use room the reserved gang cannot use: on each
   node, the number of the reserved gang's pods that fit must not drop. Small pods run in leftover room, and
   the reserved gang's room grows as pods finish instead of being eaten by a stream of small ones. A gang
   that its queue's quota keeps out (its minimum would pass the capability) waits for quota: no reservation.
4. Preempt and reclaim. For each group still waiting for room, in order: victims are running groups of its
   queue with lower priority (preempt), and running groups of reclaimable queues above their guaranteed, when
   the waiting group's queue stays within its own guaranteed (reclaim); a victim queue is never taken below
   its guaranteed. Victims are ordered overcommitted first, then lowest priority, then newest; they are
   removed whole, one by one, until the waiting group fits (simulated); then each chosen victim whose return
   would still let the group fit is given back; at the end, every victim that fits back beside all of the
   session's placements is given back too, so each evicted group is needed. If the group would not fit
   even with every candidate gone, nothing is evicted. Room freed for one group is not used by another in
   the same session, and an evicted group places nothing this session (it runs again later, whole).

Feasibility: CPU and memory fit; ``node_selector`` labels match; ``gpu_models`` (if any) holds the node's
model; a sharing pod (one GPU, ``gpu_milli`` < 1000) needs one GPU with that much free; a k-GPU pod needs k
fully free GPUs (and takes ``gpu_milli`` on each).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from pffs.scheduler.core import scoring
from pffs.scheduler.core.arrays import BoolArray, FloatArray, IntArray
from pffs.scheduler.core.fragmentation import ANY_MODEL, CONTESTED_CPU, NodeCapacities, TypicalShapes
from pffs.scheduler.core.objects import (
    MILLI,
    RESOURCE_NAMES,
    Node,
    Placement,
    Pod,
    PodGroup,
    Queue,
    Resources,
    is_sharing,
    uses_gpus,
)
from pffs.scheduler.core.scoring import GroupContext
from pffs.scheduler.core.state import ClusterState


@dataclass
class Weights:
    """Each plugin's weight; 0 switches it off.

    ``binpack`` is off by default: on the openb traces (bench/scheduler_session.py, seeds 42-51) it took
    2.1-4.5 points of GPU allocation from the session, which with it off places like the trace policy
    (``PffsPolicy``, ahead of FGD); on the gang bench (bench/scheduler_gangs.py) utilisation and gang waits
    were the same without it."""

    binpack: float = 0.0
    fragmentation: float = 1.0
    topology: float = 1.0
    tor: float = 1.0
    locality: float = 1.0


@dataclass
class SessionResult:
    placements: list[Placement]  # new pods to bind (whole gangs only)
    evictions: list[Placement]  # running pods to evict (whole groups only)
    overcommitted: list[str]  # admitted groups marked overcommitted
    pending: dict[str, str]  # group name -> one-line reason it still waits (quota, no fit, ...)


def _usage_key(r: Resources) -> tuple[int, int, int]:
    return (r.cpu_milli, r.memory_mib, r.gpu_milli)


def sharing_slots(state: ClusterState, pod: Pod, nodes: IntArray, weights: Weights) -> IntArray:
    """The GPU a sharing pod takes on each of ``nodes``: the one its fragmentation score was taken on (the
    trace policy's choice), or without that score the first that fits."""
    if weights.fragmentation > 0 and state.typical is not None:
        prefer = None
        if weights.topology > 0:  # among equally scored GPUs, one in the NVLink group with fewest whole
            whole = scoring.whole_gpus_per_link(state, nodes)
            prefer = np.einsum("mg,mwg->mw", whole, state.nvlink_onehot[nodes])
        return scoring.best_sharing_gpus(state, state.typical, pod, nodes, prefer)
    return np.asarray(np.argmax(state.gpu_free[nodes] >= pod.gpu_milli, axis=1), dtype=np.int64)


def choose_gpus(state: ClusterState, node: int, pod: Pod, weights: Weights) -> tuple[int, ...]:
    """The GPU slots the pod takes on ``node`` (it must fit there)."""
    if not uses_gpus(pod):
        return ()
    free = state.gpu_free[node]
    if is_sharing(pod):
        return (int(sharing_slots(state, pod, np.array([node]), weights)[0]),)
    full = np.flatnonzero(free >= MILLI)
    k = pod.gpu_count
    if weights.topology <= 0:
        return tuple(int(s) for s in full[:k])
    for onehot in (state.nvlink_onehot[node], state.numa_onehot[node]):
        per = onehot[full].sum(axis=0)  # full GPUs per domain
        ok = np.flatnonzero(per >= k)
        if len(ok):
            # best fit: the domain with fewest free GPUs that holds the pod keeps the roomier ones whole
            dom = int(ok[np.argmin(per[ok])])
            inside = full[onehot[full, dom] == 1]
            return tuple(int(s) for s in inside[:k])
    # no single domain: take from the NVLink groups with most free GPUs first (fewest groups spanned)
    link = state.nvlink_onehot[node][full].argmax(axis=1)
    per = np.bincount(link)
    order = sorted(range(len(full)), key=lambda j: (-per[link[j]], link[j], full[j]))
    return tuple(sorted(int(full[j]) for j in order[:k]))


@dataclass
class _Plan:
    group: PodGroup
    queue: Queue
    need: int  # pods to place for the group to reach min_member
    pending: list[Pod]  # its pods not running yet, largest first
    admitted_over: bool = False
    reason: str = ""
    extras: list[Pod] = field(default_factory=list)


Assignment = tuple[Pod, int, tuple[int, ...]]


def _pod_size(pod: Pod) -> tuple[int, int, int, str]:
    return (-pod.gpu_count * pod.gpu_milli, -pod.cpu_milli, -pod.memory_mib, pod.name)


def _pod_shape(pod: Pod) -> tuple[object, ...]:
    return (
        pod.cpu_milli,
        pod.memory_mib,
        pod.gpu_count,
        pod.gpu_milli,
        pod.gpu_models,
        tuple(sorted(pod.node_selector.items())),
    )


def _fmt(r: Resources) -> str:
    return f"cpu {r.cpu_milli}m, memory {r.memory_mib}Mi, gpu {r.gpu_milli}m"


def _sum(pods: Iterable[Pod]) -> Resources:
    total = Resources()
    for p in pods:
        total = total + p.request
    return total


class _Session:
    def __init__(
        self,
        nodes: Sequence[Node],
        queues: Sequence[Queue],
        groups: Sequence[PodGroup],
        running: Sequence[Placement],
        weights: Weights,
    ) -> None:
        self.state = ClusterState(nodes)
        self.weights = weights
        self.queues = {q.name: q for q in queues}
        self.groups = {g.name: g for g in sorted(groups, key=lambda g: g.name)}
        self.state.queue_of = {g.name: g.queue for g in self.groups.values() if g.queue in self.queues}
        self.placements: list[Placement] = []
        self.placed_groups: set[str] = set()
        self.evicted: dict[str, list[Placement]] = {}
        self.overcommitted: set[str] = set()
        self.pending: dict[str, str] = {}
        self._locality: dict[str, FloatArray] = {}
        self.running_by_group: dict[str, list[tuple[Placement, int, tuple[int, ...]]]] = {}
        for p in sorted(running, key=lambda p: (p.pod.group, p.pod.name)):
            node = self.state.index.get(p.node)
            slots: tuple[int, ...] = ()
            if node is not None:
                slot_of = self.state.slot_of[node]
                slots = tuple(slot_of[g] for g in p.gpus if g in slot_of)
                self.state.assign(node, p.pod, slots)
            elif p.pod.group in self.state.queue_of:
                self.state.add_usage(p.pod, +1)  # on a node we do not see: still counts against the queue
            self.running_by_group.setdefault(p.pod.group, []).append((p, -1 if node is None else node, slots))
        self.state.typical = self._typical_shapes()

    def _typical_shapes(self) -> TypicalShapes | None:
        """The session's pod shapes by frequency (FGD's 'typical pods', the rare ones few nodes can run, and
        the GPU models a shape is bound to), weighted for the stranded-GPU measure
        (``TypicalShapes.for_stranding``) as the trace policy's are; and whether the CPU is contested, as
        the trace policy decides it (``cpu_only_demand``)."""
        state = self.state
        counts = Counter(
            (
                p.cpu_milli,
                p.gpu_milli if uses_gpus(p) else 0,
                p.gpu_count if uses_gpus(p) else 0,
                "|".join(sorted(p.gpu_models)) if uses_gpus(p) and state.model_bit else "",
            )
            for g in self.groups.values()
            for p in g.pods
        )
        if not any(share for _, share, _, _ in counts):
            return None

        def model_mask(spec: str) -> int:
            """A spec's models as bits (a model no node has: no bit); "" accepts any model."""
            return sum(state.model_bit.get(m, 0) for m in spec.split("|")) if spec else ANY_MODEL

        nodes = NodeCapacities(state.cpu_cap, state.gpu_count, state.model_bits)
        counted = TypicalShapes.from_counts(counts, model_mask, nodes=nodes)
        state.cpu_contested = counted.cpu_only_demand(nodes) >= CONTESTED_CPU
        return counted.for_stranding(nodes)

    # --- scoring and placing -------------------------------------------------------------------------

    def locality(self, group: PodGroup) -> FloatArray:
        vec = self._locality.get(group.name)
        if vec is None:
            vec = self._locality[group.name] = scoring.group_locality(self.state, group)
        return vec

    def best_node(
        self, pod: Pod, ctx: GroupContext, weights: Weights, allowed: BoolArray | None
    ) -> int | None:
        mask = self.state.fits(pod)
        if allowed is not None:
            mask &= allowed
        cand = np.flatnonzero(mask)
        if len(cand) == 0:
            return None
        if len(cand) == 1:
            return int(cand[0])
        total = np.zeros(len(cand))
        for name, plugin in scoring.PLUGINS.items():
            w = getattr(weights, name)
            if w > 0:
                total += w * plugin(self.state, pod, ctx, cand)
        return int(cand[int(np.argmax(total))])  # first maximum: lowest node name

    def quota_ok(self, queue: Queue, pod: Pod) -> bool:
        if queue.overcommit:
            return True
        used = self.state.usage.get(queue.name, Resources()) + pod.request
        return used.fits_within(queue.capability)

    def try_pods(
        self,
        plan: _Plan,
        pods: Sequence[Pod],
        need: int,
        weights: Weights,
        guard: Callable[[Pod], BoolArray | None] | None = None,
    ) -> tuple[list[Assignment], int]:
        """Place ``need`` of ``pods`` (in order, skipping those that do not fit) or none; returns the
        assignments (applied to the state) and the best count reached."""
        done: list[Assignment] = []
        ctx = GroupContext(plan.group, need, self.locality(plan.group))
        for k, pod in enumerate(pods):
            if len(done) >= need or len(pods) - k < need - len(done):
                break
            if not self.quota_ok(plan.queue, pod):
                continue
            ctx.remaining = need - len(done)
            node = self.best_node(pod, ctx, weights, guard(pod) if guard else None)
            if node is None:
                continue
            slots = choose_gpus(self.state, node, pod, weights)
            self.state.assign(node, pod, slots)
            done.append((pod, node, slots))
        if len(done) >= need:
            return done, len(done)
        reached = len(done)
        self.undo(done)
        return [], reached

    def undo(self, done: Iterable[Assignment]) -> None:
        for pod, node, slots in reversed(list(done)):
            self.state.unassign(node, pod, slots)

    def place_gang(
        self, plan: _Plan, guard: Callable[[Pod], BoolArray | None] | None = None
    ) -> tuple[list[Assignment], int]:
        done, reached = self.try_pods(plan, plan.pending, plan.need, self.weights, guard)
        if not done and (self.weights.locality > 0 or self.weights.tor > 0) and plan.need > 1:
            # the soft group scores must not strand a gang: once more on packing, topology, fragments only
            plain = replace(self.weights, locality=0.0, tor=0.0)
            done, again = self.try_pods(plan, plan.pending, plan.need, plain, guard)
            reached = max(reached, again)
        return done, reached

    def commit(self, done: list[Assignment]) -> None:
        for pod, node, slots in done:
            gpus = self.state.nodes[node].gpus
            self.placements.append(
                Placement(pod, self.state.nodes[node].name, tuple(gpus[s].index for s in slots))
            )
            self.placed_groups.add(pod.group)

    # --- the actions ---------------------------------------------------------------------------------

    def enqueue(self) -> list[_Plan]:
        self._mark_running_overcommitted()
        plans = []
        for group in self.groups.values():
            queue = self.queues.get(group.queue)
            running_pods = {p.pod.name for p, _, _ in self.running_by_group.get(group.name, [])}
            pending = sorted((p for p in group.pods if p.name not in running_pods), key=_pod_size)
            need = max(0, group.min_member - len(running_pods))
            if queue is None:
                if pending or need:
                    self.pending[group.name] = f"queue {group.queue!r} is unknown"
                continue
            negative = [
                p.name for p in group.pods if min(p.cpu_milli, p.memory_mib, p.gpu_count, p.gpu_milli) < 0
            ]
            if negative:
                self.pending[group.name] = f"pod {negative[0]!r} has a negative request"
                continue
            if not pending:
                if need:
                    self.pending[group.name] = (
                        f"{len(running_pods)} of min_member {group.min_member} pods exist"
                    )
                continue
            plan = _Plan(group, queue, need, pending)
            if need > len(pending):
                self.pending[group.name] = (
                    f"group has {len(group.pods)} pods, fewer than min_member {group.min_member}"
                )
                continue
            if not running_pods:  # a new group: admission against the queue's capability
                minimum = _sum(pending[:need])
                total = self.state.usage.get(queue.name, Resources()) + minimum
                over = total.exceeding(queue.capability)
                if over and not queue.overcommit:
                    self.pending[group.name] = (
                        f"quota: queue {queue.name!r} would exceed its capability in {', '.join(over)} "
                        f"(usage + minimum = {_fmt(total)})"
                    )
                    continue
                if over:
                    plan.admitted_over = True
                    self.overcommitted.add(group.name)
            plan.extras = pending[need:]
            plan.pending = pending[:need] if need else []
            plans.append(plan)
        return plans

    def _mark_running_overcommitted(self) -> None:
        for queue in self.queues.values():
            if not queue.overcommit:
                continue
            if not self.state.usage.get(queue.name, Resources()).exceeding(queue.capability):
                continue
            names = [g for g in self.running_by_group if self.state.queue_of.get(g) == queue.name]
            names.sort(key=lambda g: (self.groups[g].created, g))  # admission order
            acc = Resources()
            for g in names:
                acc = acc + _sum(p.pod for p, _, _ in self.running_by_group[g])
                if acc.exceeding(queue.capability):
                    self.overcommitted.add(g)

    def fair_order(self, plans: list[_Plan]) -> Iterable[_Plan]:
        """Yield plans lowest queue share (per weight) first, then priority, then age; shares are re-read
        after each plan is handled."""
        by_queue: dict[str, list[_Plan]] = {}
        for plan in sorted(plans, key=lambda p: (-p.group.priority, p.group.created, p.group.name)):
            by_queue.setdefault(plan.queue.name, []).append(plan)
        while by_queue:
            name = min(
                by_queue,
                key=lambda q: (
                    self.state.share(self.queues[q]),
                    -by_queue[q][0].group.priority,
                    by_queue[q][0].group.created,
                    q,
                ),
            )
            plan = by_queue[name].pop(0)
            if not by_queue[name]:
                del by_queue[name]
            yield plan

    def allocate_and_backfill(self, plans: list[_Plan]) -> list[_Plan]:
        waiting: list[_Plan] = []
        reserved: _Plan | None = None
        guard: Callable[[Pod], BoolArray | None] | None = None
        failed_shapes: set[tuple[object, ...]] = set()
        handled: list[_Plan] = []
        for plan in self.fair_order(plans):
            handled.append(plan)
            if plan.need == 0:
                continue
            g = guard if reserved is not None and plan.group.priority <= reserved.group.priority else None
            shape = (plan.queue.name, plan.need, tuple(_pod_shape(p) for p in plan.pending), g is not None)
            if shape in failed_shapes:  # an identical gang already failed on this (only fuller) state
                reached = 0
                done: list[Assignment] = []
            else:
                done, reached = self.place_gang(plan, g)
            if done:
                self.commit(done)
                self._mark_if_over(plan)
                continue
            failed_shapes.add(shape)
            plan.reason = self._no_fit_reason(plan, reached)
            waiting.append(plan)
            if (
                reserved is None
                and plan.need > 1
                and not plan.reason.startswith("quota")
                and self._ever_fits(plan)
            ):
                reserved = plan
                guard = self._make_guard(plan)
        # the pods beyond min_member, of groups that have their minimum
        for plan in handled:
            if not plan.extras or (plan.need and plan.group.name not in self.placed_groups):
                continue
            g = guard if reserved is not None and plan.group.priority <= reserved.group.priority else None
            for pod in plan.extras:
                done, _ = self.try_pods(plan, [pod], 1, self.weights, g)
                self.commit(done)
        return waiting

    def _mark_if_over(self, plan: _Plan) -> None:
        """A new group of an overcommit queue whose placement took the queue past its capability."""
        queue = plan.queue
        used = self.state.usage.get(queue.name, Resources())
        if (
            queue.overcommit
            and plan.group.name not in self.running_by_group
            and used.exceeding(queue.capability)
        ):
            self.overcommitted.add(plan.group.name)

    def _no_fit_reason(self, plan: _Plan, reached: int) -> str:
        need = plan.need
        queue = plan.queue
        if not queue.overcommit:  # the smallest ``need`` pending pods must fit the quota, else none can run
            total = self.state.usage.get(queue.name, Resources()) + _sum(plan.pending[-need:])
            over = total.exceeding(queue.capability)
            if over:
                return f"quota: queue {queue.name!r} is at its capability in {', '.join(over)}"
        return f"no fit: {reached} of the {need} pods needed for min_member {plan.group.min_member} fit now"

    def _ever_fits(self, plan: _Plan) -> bool:
        """Whether the gang fits an empty cluster (a gang that never can must not reserve room)."""
        saved = (self.state.cpu_free, self.state.mem_free, self.state.gpu_free, self.state.group_nodes)
        saved_usage = dict(self.state.usage)
        self.state.cpu_free = self.state.cpu_cap.copy()
        self.state.mem_free = self.state.mem_cap.copy()
        slots = np.arange(self.state.gpu_free.shape[1])
        self.state.gpu_free = np.where(slots[None, :] < self.state.gpu_count[:, None], MILLI, 0).astype(
            np.int64
        )
        self.state.group_nodes = {}
        # the empty cluster's scores must not outlive it: the per-node versions do not see this swap
        saved_scores = self.state.score_cache
        self.state.score_cache = {}
        try:
            queue = replace(plan.queue, overcommit=True)  # room only: quota is not the question here
            done, _ = self.place_gang(replace(plan, queue=queue))
            return bool(done)
        finally:
            self.state.cpu_free, self.state.mem_free, self.state.gpu_free, self.state.group_nodes = saved
            self.state.usage = saved_usage
            self.state.score_cache = saved_scores

    def _make_guard(self, reserved: _Plan) -> Callable[[Pod], BoolArray | None]:
        shapes = list(
            {(p.cpu_milli, p.memory_mib, p.gpu_count, p.gpu_milli): p for p in reserved.pending}.values()
        )
        state = self.state

        def guard(pod: Pod) -> BoolArray:
            # nodes where placing ``pod`` leaves room for as many of the reserved gang's pods as now
            allowed = np.ones(state.n_nodes, dtype=bool)
            cand = np.flatnonzero(state.fits(pod))
            if len(cand) == 0:
                return allowed
            slots = sharing_slots(state, pod, cand, self.weights) if is_sharing(pod) else None
            rows = scoring.gpu_rows_after(state, pod, cand, slots)
            for shape in shapes:
                reach = state.static_mask(shape)[cand]
                now = scoring.fit_counts(
                    state.cpu_free[cand], state.mem_free[cand], state.gpu_free[cand], shape
                )
                after = scoring.fit_counts(
                    state.cpu_free[cand] - pod.cpu_milli, state.mem_free[cand] - pod.memory_mib, rows, shape
                )
                allowed[cand] &= ~reach | (after >= now)
            return allowed

        return guard

    def preempt_and_reclaim(self, waiting: list[_Plan]) -> None:
        for plan in waiting:
            if plan.group.name in self.placed_groups or plan.group.name in self.evicted:
                continue  # an evicted group runs again in a later session, whole
            victims = self._victim_candidates(plan)
            if victims:
                held = list(self.evicted)  # room freed for earlier groups is theirs: out of play for this one
                self._hold(held, +1)
                try:
                    self._evict_for(plan, victims)
                finally:
                    self._hold(held, -1)
            if plan.group.name not in self.placed_groups:
                self.pending[plan.group.name] = plan.reason
        # a later eviction can free more than its beneficiary took: give back every victim that now fits
        for name in reversed(list(self.evicted)):
            if self._restore_fits(name):
                del self.evicted[name]
                del self.pending[name]

    def _victim_candidates(self, plan: _Plan) -> list[str]:
        queue = plan.queue
        minimum = _sum(plan.pending)
        used = self.state.usage.get(queue.name, Resources()) + minimum
        guaranteed = queue.guaranteed
        declared = [r for r in RESOURCE_NAMES if getattr(guaranteed, r) > 0]
        may_reclaim = bool(declared) and all(getattr(used, r) <= getattr(guaranteed, r) for r in declared)
        reach = np.zeros(self.state.n_nodes, dtype=bool)
        for pod in plan.pending:
            reach |= self.state.static_mask(pod)
        out = []
        for name, pods in self.running_by_group.items():
            if name in self.evicted or name in self.placed_groups or name not in self.state.queue_of:
                continue
            victim = self.groups[name]
            vq = self.queues[victim.queue]
            if not any(node >= 0 and reach[node] for _, node, _ in pods):
                continue  # frees nothing the waiting group could use
            if victim.queue == queue.name:
                if victim.priority < plan.group.priority:
                    out.append(name)
            elif may_reclaim and vq.reclaimable:
                out.append(name)
        out.sort(
            key=lambda g: (g not in self.overcommitted, self.groups[g].priority, -self.groups[g].created, g)
        )
        return out

    def _above_guaranteed(self, queue: Queue, freed: Resources) -> bool:
        """Whether the queue, after giving up ``freed``, still holds its guaranteed in what ``freed`` uses."""
        used = self.state.usage.get(queue.name, Resources())
        return all(
            getattr(used, r) - getattr(freed, r) >= getattr(queue.guaranteed, r)
            for r in RESOURCE_NAMES
            if getattr(freed, r) > 0
        )

    def _hold(self, names: list[str], sign: int) -> None:
        """Take the node room of evicted groups back (+1) or give it up again (-1), quotas untouched."""
        for name in names:
            for p, node, slots in self.running_by_group[name]:
                if node < 0:
                    continue
                if sign > 0:
                    self.state.assign(node, p.pod, slots)
                else:
                    self.state.unassign(node, p.pod, slots)
                self.state.add_usage(p.pod, -sign)

    def _remove(self, name: str) -> None:
        for p, node, slots in self.running_by_group[name]:
            if node >= 0:
                self.state.unassign(node, p.pod, slots)
            else:
                self.state.add_usage(p.pod, -1)

    def _restore(self, name: str) -> None:
        for p, node, slots in self.running_by_group[name]:
            if node >= 0:
                self.state.assign(node, p.pod, slots)
            else:
                self.state.add_usage(p.pod, +1)

    def _restore_fits(self, name: str) -> bool:
        """Put an evicted group back if that over-allocates nothing and keeps its queue within quota."""
        self._restore(name)
        nodes = [node for _, node, _ in self.running_by_group[name] if node >= 0]
        st = self.state
        ok = all(st.cpu_free[n] >= 0 and st.mem_free[n] >= 0 and (st.gpu_free[n] >= 0).all() for n in nodes)
        queue = self.queues[self.groups[name].queue]
        if not queue.overcommit:
            ok = ok and st.usage.get(queue.name, Resources()).fits_within(queue.capability)
        if not ok:
            self._remove(name)
        return ok

    def _fits_now(self, plan: _Plan) -> bool:
        done, _ = self.place_gang(plan)
        self.undo(done)
        return bool(done)

    def _evict_for(self, plan: _Plan, candidates: list[str]) -> None:
        chosen: list[str] = []
        fits = False
        for name in candidates:
            victim = self.groups[name]
            if victim.queue != plan.queue.name:
                freed = _sum(p.pod for p, _, _ in self.running_by_group[name])
                if not self._above_guaranteed(self.queues[victim.queue], freed):
                    continue
            self._remove(name)
            chosen.append(name)
            if self._fits_now(plan):
                fits = True
                break
        if not fits:
            for name in reversed(chosen):
                self._restore(name)
            return
        # give back every victim the group does not need (latest chosen are the most likely to be needed)
        for name in list(reversed(chosen[:-1])):
            self._restore(name)
            if self._fits_now(plan):
                chosen.remove(name)
            else:
                self._remove(name)
        done, _ = self.place_gang(plan)
        assert done, "the group fitted in simulation"
        self.commit(done)
        self._mark_if_over(plan)
        # a victim whose pods still fit beside the placement as made (and within its queue's quota) stays
        for name in list(reversed(chosen)):
            if self._restore_fits(name):
                chosen.remove(name)
        for name in chosen:
            self.evicted[name] = [p for p, _, _ in self.running_by_group[name]]
            self.pending[name] = f"evicted (whole group) to make room for {plan.group.name!r}"

    def run(self) -> SessionResult:
        plans = self.enqueue()
        waiting = self.allocate_and_backfill(plans)
        self.preempt_and_reclaim(waiting)
        evictions = [p for name in sorted(self.evicted) for p in self.evicted[name]]
        return SessionResult(
            self.placements, evictions, sorted(self.overcommitted), dict(sorted(self.pending.items()))
        )


def run_session(
    nodes: Sequence[Node],
    queues: Sequence[Queue],
    groups: Sequence[PodGroup],
    running: Sequence[Placement],
    weights: Weights | None = None,
) -> SessionResult:
    """One scheduling session: what to bind and what to evict, given the cluster as it is now.

    ``groups`` holds every group, running and pending; ``running`` where each running pod is. Placements
    use only room free after ``evictions`` are gone (evicted groups are listed whole)."""
    return _Session(nodes, queues, groups, running, weights or Weights()).run()
